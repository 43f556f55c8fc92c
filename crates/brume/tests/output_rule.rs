//! The output rule (issue 52, class 1): an existing file, a symlink and a file
//! created during the run survive without --force; --force replaces only a
//! regular file; a failed or cancelled folder write leaves nothing behind.

use std::path::Path;

use brume::output::{Claimed, Output, OutputDir, OutputError};

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap()
}

#[test]
fn an_existing_file_is_refused_before_the_work_and_kept_at_commit() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("out.png");
    std::fs::write(&p, "mine").unwrap();
    let out = Output::new(&p, false);
    assert!(matches!(out.check(), Err(OutputError::Exists { .. })));
    let w = out.write_bytes(b"result").unwrap();
    assert_eq!(read(&p), "mine");
    assert_eq!(w.path, dir.path().join("out.1.png"));
    assert_eq!(read(&w.path), "result");
    assert!(w.notice().unwrap().contains("out.1.png"));
}

#[test]
fn a_file_created_during_the_run_survives() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("out.png");
    let out = Output::new(&p, false);
    out.check().unwrap();
    // Another run finishes first.
    let other = Output::new(&p, false).write_bytes(b"first").unwrap();
    assert_eq!(other.path, p);
    let w = out.write_bytes(b"second").unwrap();
    assert_eq!(read(&p), "first");
    assert_eq!(read(&w.path), "second");
    assert_ne!(w.path, p);
    // No temporary files are left.
    let names: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
}

#[cfg(unix)]
#[test]
fn a_symlink_is_never_followed_or_replaced_even_with_force() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("target.txt");
    std::fs::write(&target, "precious").unwrap();
    let link = dir.path().join("out.png");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    for force in [false, true] {
        let out = Output::new(&link, force);
        assert!(out.check().is_err());
        let r = out.write_bytes(b"result");
        if force {
            assert!(matches!(r, Err(OutputError::NotRegular { .. })), "{r:?}");
        }
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(read(&target), "precious");
    }
    // A dangling link is not written through either.
    let dangling = dir.path().join("dangling.png");
    std::os::unix::fs::symlink(dir.path().join("nowhere"), &dangling).unwrap();
    let w = Output::new(&dangling, false).write_bytes(b"x").unwrap();
    assert_ne!(w.path, dangling);
    assert!(!dir.path().join("nowhere").exists());
}

#[cfg(unix)]
#[test]
fn force_never_replaces_a_fifo_or_a_folder() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe.png");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let r = Output::new(&fifo, true).write_bytes(b"x");
    assert!(matches!(r, Err(OutputError::NotRegular { kind: "a named pipe", .. })), "{r:?}");
    let folder = dir.path().join("folder.png");
    std::fs::create_dir(&folder).unwrap();
    assert!(matches!(Output::new(&folder, true).check(), Err(OutputError::NotRegular { .. })));
    assert!(Output::new(&folder, true).write_bytes(b"x").is_err());
    assert!(folder.is_dir());
}

#[test]
fn force_replaces_a_regular_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("out.png");
    std::fs::write(&p, "old").unwrap();
    let out = Output::new(&p, true);
    out.check().unwrap();
    let w = out.write_bytes(b"new").unwrap();
    assert_eq!(w.path, p);
    assert_eq!(read(&p), "new");
}

#[test]
fn a_missing_folder_is_named_before_the_work() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("no/such/out.png");
    let e = Output::new(&p, false).check().unwrap_err();
    assert!(e.to_string().contains("does not exist"), "{e}");
}

#[test]
fn a_claimed_preview_is_rewritten_only_while_it_is_ours() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("preview.png");
    let mut c = Claimed::new(Output::new(&p, false));
    c.write_bytes(b"1").unwrap();
    c.write_bytes(b"2").unwrap();
    assert_eq!(read(&p), "2");
    // The user replaces it: brume stops writing there.
    std::fs::remove_file(&p).unwrap();
    std::fs::write(&p, "user's").unwrap();
    assert!(matches!(c.write_bytes(b"3"), Err(OutputError::Changed { .. })));
    assert_eq!(read(&p), "user's");
    // An existing file (e.g. the edit's own input) is never the preview's.
    let mut c = Claimed::new(Output::new(&p, false));
    assert!(c.check().is_err());
    let w = c.write_bytes(b"4").unwrap();
    assert_ne!(w.path, p);
    assert_eq!(read(&p), "user's");
}

#[test]
fn a_folder_output_keeps_what_it_held() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    std::fs::write(out.join("marker.json"), "{}").unwrap();
    let is_ours = |p: &Path| p.join("marker.json").is_file();
    // Without force: refused before the work.
    assert!(OutputDir::new(&out, false).check(is_ours).is_err());
    // With force: the new tree does not rewrite notes.txt, so nothing is deleted.
    let od = OutputDir::new(&out, true);
    od.check(is_ours).unwrap();
    let tmp = od.temp().unwrap();
    std::fs::write(tmp.path().join("marker.json"), "{\"new\":1}").unwrap();
    let tmp_path = tmp.path().to_path_buf();
    let e = od.commit(tmp, is_ours).unwrap_err();
    assert!(e.to_string().contains("notes.txt"), "{e}");
    assert_eq!(read(&out.join("notes.txt")), "mine");
    assert!(!tmp_path.exists(), "the temporary folder is removed");
    // A tree the new one fully rewrites is replaced.
    std::fs::remove_file(out.join("notes.txt")).unwrap();
    let tmp = od.temp().unwrap();
    std::fs::write(tmp.path().join("marker.json"), "{\"new\":1}").unwrap();
    od.commit(tmp, is_ours).unwrap();
    assert_eq!(read(&out.join("marker.json")), "{\"new\":1}");
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 1, "{left:?}");
}

#[test]
fn a_folder_created_during_the_run_survives() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model");
    let od = OutputDir::new(&out, false);
    od.check(|_| false).unwrap();
    let tmp = od.temp().unwrap();
    std::fs::write(tmp.path().join("a"), "new").unwrap();
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("b"), "theirs").unwrap();
    assert!(od.commit(tmp, |_| false).is_err());
    assert_eq!(read(&out.join("b")), "theirs");
    assert!(!out.join("a").exists());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn control_characters_are_escaped() {
    let s = brume::output::escape_control("a\x1b[2Jb\rc\nd\u{202e}e");
    assert_eq!(s, "a\\u{1b}[2Jb\\rc\nd\\u{202e}e");
}
