//! The faults bar: a process adding images is killed with SIGKILL at random
//! moments, 20 times; after each, the gallery opens, no row lacks its file, no
//! file lacks its row, and every image the child reported committed is there.
//!
//! The child is this test binary itself, re-run with `BRUME_GALLERY_CRASH_CHILD`
//! naming the data directory; it prints `committed <id>` after each add returns
//! and `deleting <id>` before deleting and purging one (so purges crash too).

mod common;

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use brume_gallery::{Deleted, Gallery, ImageId, Query, IMAGES_DIR, THUMBS_DIR};

const CHILD_ENV: &str = "BRUME_GALLERY_CRASH_CHILD";

/// Runs only as the child: adds images until killed.
#[test]
fn crash_child() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else { return };
    let (g, _) = Gallery::open(Path::new(&dir)).expect("child opens");
    let pid = std::process::id() as u64;
    let mut out = std::io::stdout().lock();
    for i in 0u64.. {
        let mut n = common::made(&format!("crash test {pid} {i}"), pid * 1_000_000 + i, 64, 48);
        n.job = Some((format!("{pid}"), i as u32));
        n.timings = Some(serde_json::json!({"i": i}));
        let id = g.add(n).expect("child add");
        writeln!(out, "committed {}", id.0).unwrap();
        out.flush().unwrap();
        if i % 7 == 3 {
            writeln!(out, "deleting {}", id.0).unwrap();
            out.flush().unwrap();
            g.delete(id).unwrap();
            g.purge().unwrap();
        }
    }
}

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

#[cfg(unix)]
#[test]
fn kill_9_twenty_times_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("gallery");
    let exe = std::env::current_exe().unwrap();
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    let mut committed = HashSet::new();
    let mut deleting = HashSet::new();
    let mut reimported = 0;
    let start = Instant::now();
    for round in 0..20 {
        let mut child = std::process::Command::new(&exe)
            .args(["crash_child", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, &dir)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Let the first rounds create the gallery, then kill at random moments.
        // (an add syncs three times: file, thumbnail, commit; tens of ms on a busy disk).
        let wait_ms = if round == 0 { 300 } else { 20 + xorshift(&mut seed) % 250 };
        std::thread::sleep(Duration::from_millis(wait_ms));
        child.kill().unwrap(); // SIGKILL
        let out = child.wait_with_output().unwrap();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some(id) = line.strip_prefix("committed ") {
                committed.insert(id.parse::<i64>().unwrap());
            } else if let Some(id) = line.strip_prefix("deleting ") {
                deleting.insert(id.parse::<i64>().unwrap());
            }
        }

        let (g, report) = Gallery::open(&dir).unwrap_or_else(|e| panic!("round {round}: the gallery does not open: {e}"));
        assert!(report.skipped.is_none());
        assert!(
            report.missing_files.is_empty(),
            "round {round}: committed rows lost their files: {report}"
        );
        assert!(report.orphaned.is_empty(), "round {round}: {report}");
        reimported += report.reimported.len();

        // Every row has its file and thumbnail...
        let mut shas = HashSet::new();
        let mut rows = HashSet::new();
        let mut cursor = None;
        loop {
            let page = g
                .list(&Query {
                    deleted: Deleted::Include,
                    cursor,
                    limit: Some(500),
                    ..Default::default()
                })
                .unwrap();
            for item in &page.items {
                let file = dir.join(IMAGES_DIR).join(format!("{}.png", item.sha256));
                assert_eq!(
                    std::fs::metadata(&file).map(|m| m.len()).ok(),
                    Some(item.bytes),
                    "round {round}: row {} lacks its file",
                    item.id
                );
                assert!(dir.join(THUMBS_DIR).join(format!("{}.png", item.sha256)).is_file());
                assert!(g.thumb_bytes(item.id).is_ok());
                shas.insert(item.sha256.clone());
                rows.insert(item.id.0);
            }
            match page.next_cursor {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        // ...every file has a row, and no temporary file is left.
        for dir in [dir.join(IMAGES_DIR), dir.join(THUMBS_DIR)] {
            for e in std::fs::read_dir(&dir).unwrap() {
                let name = e.unwrap().file_name().to_string_lossy().into_owned();
                let sha = name
                    .strip_suffix(".png")
                    .unwrap_or_else(|| panic!("round {round}: stray file {name}"));
                assert!(shas.contains(sha), "round {round}: file {name} has no row");
            }
        }
        // ...and every add the child saw commit is there (unless it was being purged).
        for id in committed.difference(&deleting) {
            assert!(rows.contains(id), "round {round}: committed image {id} lost");
            assert!(g.get(ImageId(*id)).is_ok());
        }
    }
    let survivors = committed.difference(&deleting).count();
    eprintln!(
        "20 kills in {:.1} s: {} adds committed, {} deleted+purged, {} files re-imported at open",
        start.elapsed().as_secs_f64(),
        committed.len(),
        deleting.len(),
        reimported
    );
    assert!(survivors >= 5, "the children committed too little to test anything: {survivors}");
}
