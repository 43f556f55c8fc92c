//! The faults bar: `kill -9` of `brume serve` during a running job, 20 times
//! on the same data directory, restarting each time. After every restart the
//! gallery opens; after reconciliation no row lacks its file and no file lacks
//! its row (checked in the data directory and through the API); and every job
//! the client saw done before the kill is still in the gallery, with its
//! picture.

#[path = "../src/commands/bench_serve/http.rs"]
mod http;

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use http::ServeChild;
use serde_json::{json, Value};

const ROUNDS: usize = 20;

fn pngs_in(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn submit(s: &ServeChild, body: Value) -> String {
    let r = s.post_json("/api/v1/jobs", &body).expect("submit answered");
    assert_eq!(r.status, 202, "submit: {}", r.text());
    r.json()
        .and_then(|v| v["id"].as_str().map(str::to_string))
        .expect("job id")
}

fn state(s: &ServeChild, id: &str) -> Value {
    let r = s
        .get(&format!("/api/v1/jobs/{id}"))
        .expect("job status answered");
    assert_eq!(r.status, 200, "job {id}: {}", r.text());
    r.json().expect("job JSON")
}

/// Checks the gallery after a restart: the API's rows and the data dir's files
/// match one to one, every row's picture is served, and every job seen done
/// is there.
fn check_gallery(
    s: &ServeChild,
    dir: &Path,
    seen_done: &HashMap<i64, String>,
    round: usize,
) -> usize {
    let items = http::gallery_all(s.addr, "&deleted=include").expect("gallery lists");
    let rows: HashMap<i64, String> = items
        .iter()
        .map(|i| {
            (
                i["id"].as_i64().unwrap(),
                i["prompt"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    for (id, prompt) in seen_done {
        assert_eq!(
            rows.get(id),
            Some(prompt),
            "round {round}: gallery {id} (`{prompt}`), seen done before the kill, is lost"
        );
    }
    // Every row's picture and thumbnail are served (the file exists).
    for id in rows.keys() {
        let r = s.get(&format!("/api/v1/gallery/{id}/image")).unwrap();
        assert_eq!(
            r.status,
            200,
            "round {round}: row {id} has no picture: {}",
            r.text()
        );
        assert!(
            r.body.starts_with(b"\x89PNG"),
            "round {round}: row {id}'s picture is not a PNG"
        );
        let t = s.get(&format!("/api/v1/gallery/{id}/thumb")).unwrap();
        assert_eq!(t.status, 200, "round {round}: row {id} has no thumbnail");
    }
    // No file without its row: one content-addressed PNG per row (prompts and
    // seeds are unique, so no two rows share a picture), no temporary leftovers.
    let images = pngs_in(&dir.join("images"));
    let thumbs = pngs_in(&dir.join("thumbs"));
    for f in images.iter().chain(thumbs.iter()) {
        let stem = f.strip_suffix(".png").unwrap_or("");
        assert!(
            stem.len() == 64 && stem.bytes().all(|b| b.is_ascii_hexdigit()),
            "round {round}: stray file {f} in the data dir"
        );
    }
    assert_eq!(
        images.len(),
        rows.len(),
        "round {round}: {} picture files for {} rows",
        images.len(),
        rows.len()
    );
    assert_eq!(
        thumbs.len(),
        rows.len(),
        "round {round}: {} thumbnails for {} rows",
        thumbs.len(),
        rows.len()
    );
    rows.len()
}

#[test]
fn kill_9_during_running_jobs_20_times_loses_nothing_completed() {
    let exe = Path::new(env!("CARGO_BIN_EXE_brume"));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let mut seen_done: HashMap<i64, String> = HashMap::new();
    let started = Instant::now();
    let mut kills_while_running = 0;
    for round in 0..ROUNDS {
        let mut s = ServeChild::start(exe, &dir, &[], &[("RUST_LOG", "warn")])
            .unwrap_or_else(|e| panic!("round {round}: the server did not start: {e}"));
        let rows = check_gallery(&s, &dir, &seen_done, round);
        assert!(rows >= seen_done.len());

        // A long batch job, then short interactive ones that preempt it.
        let long = submit(
            &s,
            json!({"prompt": format!("faults long {round}"), "steps": 150, "width": 128, "height": 128, "seed": round, "preview_every": 0}),
        );
        let short: Vec<String> = (0..3)
            .map(|k| {
                submit(
                    &s,
                    json!({"prompt": format!("faults short {round}.{k}"), "unet": "unet_lcm", "steps": 1, "width": 64, "height": 64,
                           "seed": 1000 * round + k, "priority": "interactive", "preview_every": 0}),
                )
            })
            .collect();
        // Odd rounds kill as soon as the long job runs (a short one may be
        // mid-store); even rounds once the short ones are done.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let shorts: Vec<Value> = short.iter().map(|id| state(&s, id)).collect();
            for v in &shorts {
                if v["state"] == "done" {
                    for img in v["result"]["images"].as_array().unwrap() {
                        let prompt = format!(
                            "faults short {round}.{}",
                            short
                                .iter()
                                .position(|i| i == v["id"].as_str().unwrap())
                                .unwrap()
                        );
                        seen_done.insert(img["gallery_id"].as_i64().expect("gallery id"), prompt);
                    }
                }
                assert!(
                    v["state"] != "failed",
                    "round {round}: a short job failed: {v}"
                );
            }
            let l = state(&s, &long);
            let running = l["state"] == "running" && l["step"].as_u64().unwrap_or(0) >= 1;
            let all_done = shorts.iter().all(|v| v["state"] == "done");
            if running && (round % 2 == 1 || all_done) {
                kills_while_running += 1;
                break;
            }
            assert!(
                l["state"] != "done",
                "round {round}: the long job finished before the kill; make it longer: {l}"
            );
            assert!(
                Instant::now() < deadline,
                "round {round}: the long job never ran: {l}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        s.kill9();
        let stderr = s.stderr();
        assert!(
            !stderr.contains("panicked"),
            "round {round}: the server panicked:\n{stderr}"
        );
    }
    // A last start: the gallery opens, reconciled, and holds everything seen done.
    let mut s = ServeChild::start(exe, &dir, &[], &[("RUST_LOG", "warn")])
        .expect("the server starts after the last kill");
    let rows = check_gallery(&s, &dir, &seen_done, ROUNDS);
    assert!(s.stop(), "the server stops cleanly");
    println!(
        "{ROUNDS} kills while a job ran ({kills_while_running}); {} pictures seen done, {rows} rows at the end; {:.1} s",
        seen_done.len(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(kills_while_running, ROUNDS);
    assert!(
        seen_done.len() >= ROUNDS * 3 / 2,
        "too few jobs completed to test anything: {}",
        seen_done.len()
    );
}
