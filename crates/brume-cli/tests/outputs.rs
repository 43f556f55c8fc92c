//! Issue 52 end to end: what brume writes never costs the user a file
//! (class 1), interrupted work leaves nothing behind and a converted copy keeps
//! every part of the original (class 5), text read from images cannot drive the
//! terminal, and small files cannot make `info` use unbounded memory (class 4).

use std::path::Path;
use std::process::{Command, Output};

fn brume() -> Command {
    Command::new(env!("CARGO_BIN_EXE_brume"))
}

fn ok(o: &Output) {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn err(o: &Output) -> String {
    assert!(!o.status.success(), "expected a failure: {}", String::from_utf8_lossy(&o.stdout));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn hidden_entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with('.')).collect()
}

#[test]
fn convert_never_deletes_what_out_held_nor_replaces_a_link() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    // A folder that is not a conversion: refused even with --force, before any work.
    let e = err(&brume().args(["convert", "--precision", "int8", "--force", "--out"]).arg(&out).output().unwrap());
    assert!(e.contains("not a model brume converted"), "{e}");
    assert_eq!(std::fs::read_to_string(out.join("notes.txt")).unwrap(), "mine");
    // A symlink at --out: never replaced, its target untouched.
    #[cfg(unix)]
    {
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&out, &link).unwrap();
        let e = err(&brume().args(["convert", "--precision", "int8", "--force", "--out"]).arg(&link).output().unwrap());
        assert!(e.contains("symbolic link"), "{e}");
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    }
    assert_eq!(std::fs::read_to_string(out.join("notes.txt")).unwrap(), "mine");
    assert!(hidden_entries(tmp.path()).is_empty(), "{:?}", hidden_entries(tmp.path()));
}

#[test]
fn a_converted_builtin_model_keeps_its_tokenizer_and_second_unet() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    ok(&brume().args(["convert", "--precision", "int8", "--out"]).arg(&out).output().unwrap());
    assert!(out.join("tokenizer/tokenizer_config.json").is_file());
    assert!(out.join("unet_lcm/diffusion_pytorch_model.safetensors").is_file());
    // What runs on the original runs on the copy.
    let png = tmp.path().join("x.png");
    let run = brume().args(["generate", "a red circle", "--unet", "unet_lcm", "--steps", "2", "--model"]).arg(&out).arg("--out").arg(&png).output().unwrap();
    ok(&run);
    assert!(!String::from_utf8_lossy(&run.stderr).contains("absent"), "{}", String::from_utf8_lossy(&run.stderr));
}

#[cfg(unix)]
#[test]
fn an_interrupted_convert_leaves_no_debris() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    // int4 (k-means per tensor) takes long enough to be interrupted mid-way.
    let child = brume().args(["convert", "--precision", "int4", "--out"]).arg(&out).stderr(std::process::Stdio::piped()).spawn().unwrap();
    // Wait until the temporary folder exists, then Ctrl-C.
    let start = std::time::Instant::now();
    while hidden_entries(tmp.path()).is_empty() && start.elapsed().as_secs() < 20 {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // Ctrl-C twice, as an impatient user does: the second must not skip the clean-up.
    for _ in 0..2 {
        // SAFETY: signalling our own child by its id.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let o = child.wait_with_output().unwrap();
    assert!(!o.status.success(), "Ctrl-C did not stop the conversion");
    assert!(String::from_utf8_lossy(&o.stderr).contains("cancelled"), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!out.exists());
    assert!(hidden_entries(tmp.path()).is_empty(), "debris: {:?}", hidden_entries(tmp.path()));
}

#[cfg(unix)]
#[test]
fn force_never_writes_through_a_symlink() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("precious.txt");
    std::fs::write(&target, "precious").unwrap();
    let link = tmp.path().join("out.png");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let o = brume().args(["generate", "a red circle", "--steps", "1", "--force", "--out"]).arg(&link).output().unwrap();
    assert!(!o.status.success());
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious");
}

/// A PNG whose "parameters" text is `text` (tEXt) plus a zTXt of `inflated` bytes.
fn png_with_text(path: &Path, text: &str, inflated: usize) {
    use std::io::Write;
    let mut png = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut png, 8, 8);
        enc.set_color(png::ColorType::Rgb);
        enc.add_text_chunk("parameters".into(), text.into()).unwrap();
        let mut w = enc.write_header().unwrap();
        if inflated > 0 {
            let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
            let block = vec![b'a'; 1 << 20];
            for _ in 0..inflated >> 20 {
                z.write_all(&block).unwrap();
            }
            let mut data = b"comment\0\0".to_vec();
            data.extend_from_slice(&z.finish().unwrap());
            w.write_chunk(png::chunk::zTXt, &data).unwrap();
        }
        w.write_image_data(&[0u8; 8 * 8 * 3]).unwrap();
        w.finish().unwrap();
    }
    std::fs::write(path, png).unwrap();
}

#[test]
fn info_escapes_control_characters_and_refuses_a_text_bomb() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("evil.png");
    png_with_text(&p, "a cat\x1b]0;pwned\x07\x1b[2J\rhidden", 0);
    let o = brume().arg("info").arg(&p).output().unwrap();
    ok(&o);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!out.contains('\x1b') && !out.contains('\r') && !out.contains('\x07'), "{out:?}");
    assert!(out.contains("a cat"), "{out}");
    let bomb = tmp.path().join("bomb.png");
    png_with_text(&bomb, "x", 256 << 20);
    let o = brume().arg("info").arg(&bomb).output().unwrap();
    assert!(o.stdout.len() < 1 << 20, "printed {} bytes", o.stdout.len());
    assert!(String::from_utf8_lossy(&o.stderr).contains("comment"), "{}", String::from_utf8_lossy(&o.stderr));
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let t = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &t);
        } else {
            std::fs::copy(e.path(), t).unwrap();
        }
    }
}

#[test]
fn an_error_says_its_cause_once() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("m");
    copy_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/builtin"), &m);
    std::fs::write(m.join("vae/config.json"), "{").unwrap();
    let e = err(&brume().args(["inspect", "--model"]).arg(&m).output().unwrap());
    assert_eq!(e.matches("EOF while parsing").count(), 1, "{e}");
}

#[test]
fn eval_sheets_and_listings_are_checked_before_the_work() {
    let tmp = tempfile::tempdir().unwrap();
    for cmd in [["eval", "adherence"], ["eval", "showcase"], ["eval", "edits"]] {
        let flag = if cmd[1] == "showcase" { "--out" } else { "--sheet" };
        // An existing sheet, an existing listing beside it, a symlink: each refused, each kept.
        let sheet = tmp.path().join(format!("{}.png", cmd[1]));
        std::fs::write(&sheet, "mine").unwrap();
        let e = err(&brume().args(cmd).arg(flag).arg(&sheet).output().unwrap());
        assert!(e.contains("--force"), "{e}");
        assert_eq!(std::fs::read_to_string(&sheet).unwrap(), "mine");
        std::fs::remove_file(&sheet).unwrap();
        let listing = sheet.with_extension("txt");
        std::fs::write(&listing, "mine").unwrap();
        let e = err(&brume().args(cmd).arg(flag).arg(&sheet).output().unwrap());
        assert!(e.contains(".txt") && e.contains("--force"), "{e}");
        assert_eq!(std::fs::read_to_string(&listing).unwrap(), "mine");
        std::fs::remove_file(&listing).unwrap();
        #[cfg(unix)]
        {
            let target = tmp.path().join("target.txt");
            std::fs::write(&target, "precious").unwrap();
            std::os::unix::fs::symlink(&target, &sheet).unwrap();
            let e = err(&brume().args(cmd).arg(flag).arg(&sheet).arg("--force").output().unwrap());
            assert!(e.contains("symbolic link"), "{e}");
            assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious");
            std::fs::remove_file(&sheet).unwrap();
        }
        assert!(!sheet.exists());
    }
}
