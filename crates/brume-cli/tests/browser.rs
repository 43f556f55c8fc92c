//! The web editor in a real browser against a real `brume serve` (issue 47).
//!
//! Debian's Chromium driven by npm's playwright-core (pinned in
//! crates/brume-web/browser-tests/package-lock.json). On a fresh machine the test installs what
//! it needs rather than skipping: `apt-get install chromium` (and node/npm) when missing and
//! running as root, `npm ci` when node_modules is missing. A missing browser that cannot be
//! installed is a failure, never a silent pass.
//!
//! - `BRUME_BROWSER_BENCH=1`: run only the benchmark (median over 20 strokes of pointer-up ->
//!   first preview and -> live result at the built-in model's size), printed.
//! - `BRUME_UPDATE_SCREENSHOTS=1`: write the desktop and phone screenshots to docs/ (otherwise
//!   they go to the test's temporary folder, so a test run leaves the tree clean).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The built-in model learned captions that name the size (models/builtin/MODEL_CARD.md).
const PROMPT: &str = "a large red circle on a blue background";

fn repo() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn tests_dir() -> PathBuf {
    repo().join("crates/brume-web/browser-tests")
}

fn run(cmd: &mut Command) -> Output {
    let shown = format!("{cmd:?}");
    let out = cmd.output().unwrap_or_else(|e| panic!("could not run {shown}: {e}"));
    assert!(
        out.status.success(),
        "{shown} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false)
}

fn have(program: &str) -> bool {
    Command::new(program).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// Installs Debian packages (after `apt-get update`), or fails saying what is missing.
fn apt_install(packages: &[&str], why: &str) {
    assert!(
        is_root(),
        "{why}: install {} (e.g. `sudo apt-get install -y {}`); the browser suite does not skip",
        packages.join(" "),
        packages.join(" ")
    );
    run(Command::new("apt-get").arg("update"));
    run(Command::new("apt-get").args(["install", "-y"]).args(packages).env("DEBIAN_FRONTEND", "noninteractive"));
}

/// Chromium, node and the pinned playwright-core, installed when missing.
fn prepare() {
    if !Path::new("/usr/bin/chromium").exists() {
        apt_install(&["chromium"], "/usr/bin/chromium is missing");
    }
    if !have("node") || !have("npm") {
        apt_install(&["nodejs", "npm"], "node and npm are missing");
    }
    if !tests_dir().join("node_modules/playwright-core").exists() {
        run(Command::new("npm").args(["ci", "--no-audit", "--no-fund"]).current_dir(tests_dir()));
    }
}

/// `brume serve` on a free loopback port with a fresh data directory; killed on drop.
struct Server {
    child: Child,
    base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn http_status(addr: &str, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").ok()?;
    let mut head = [0u8; 16];
    let n = s.read(&mut head).ok()?;
    std::str::from_utf8(&head[..n]).ok()?.split_whitespace().nth(1)?.parse().ok()
}

/// Starts `brume serve` on port 0 and reads the address from its `listening on http://ADDR`
/// line; the rest of its output goes to `log`.
fn serve(data_dir: &Path, log: &Path) -> Server {
    let log_file = std::fs::File::create(log).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_brume"))
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .stdout(Stdio::piped())
        .stderr(log_file.try_clone().unwrap())
        .spawn()
        .expect("start brume serve");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut log_file = log_file;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(addr) = line.strip_prefix("listening on http://") {
                let _ = tx.send(addr.trim().to_string());
            }
            let _ = writeln!(log_file, "{line}");
        }
    });
    let mut server = Server { child, base: String::new() };
    let start = Instant::now();
    let addr = loop {
        if let Ok(addr) = rx.recv_timeout(Duration::from_millis(100)) {
            break addr;
        }
        if let Ok(Some(status)) = server.child.try_wait() {
            panic!("brume serve exited ({status}):\n{}", std::fs::read_to_string(log).unwrap_or_default());
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "brume serve printed no `listening on` line in 60 s:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
    };
    assert_eq!(http_status(&addr, "/api/v1/capabilities"), Some(200), "brume serve does not answer the API on {addr}");
    assert_eq!(http_status(&addr, "/"), Some(200), "brume serve does not serve the editor on {addr}");
    server.base = format!("http://{addr}");
    server
}

/// Runs the spec with a time limit; returns its whole output and whether it passed.
fn spec(base: &str, out: &Path, docs: &Path, bench: bool) -> (bool, String) {
    let mut cmd = Command::new("node");
    cmd.arg("editor.spec.mjs").arg(base).arg(out).arg(docs).current_dir(tests_dir());
    cmd.env("BRUME_BROWSER_BENCH", if bench { "1" } else { "0" });
    let log = out.join("spec.log");
    let f = std::fs::File::create(&log).unwrap();
    let mut child = cmd.stdout(f.try_clone().unwrap()).stderr(f).spawn().expect("run node");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    match status {
        Some(s) => (s.success(), text),
        None => (false, format!("{text}\n(the browser suite ran past 300 s and was stopped)")),
    }
}

#[test]
fn the_editor_works_in_a_real_browser() {
    prepare();
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let docs = if std::env::var("BRUME_UPDATE_SCREENSHOTS").is_ok_and(|v| v == "1") { repo().join("docs") } else { out.clone() };
    std::fs::create_dir_all(&docs).unwrap();
    let bench = std::env::var("BRUME_BROWSER_BENCH").is_ok_and(|v| v == "1");
    let server = serve(&data, &tmp.path().join("serve.log"));
    let (ok, text) = spec(&server.base, &out, &docs, bench);
    println!("{text}");
    if !ok {
        let serve_log = std::fs::read_to_string(tmp.path().join("serve.log")).unwrap_or_default();
        let tail: String = serve_log.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
        panic!("the browser suite failed:\n{text}\n--- brume serve (last lines) ---\n{tail}");
    }
    if bench {
        return;
    }
    // The live result of a red disc painted on a blue canvas, judged by the shapes world.
    let path = out.join("red-disc.png");
    let img = image::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).to_rgb8();
    let spec = brume_world::parse_caption(PROMPT).expect("the test prompt parses");
    let verdict = brume_world::judge(&img, &spec);
    let seen = verdict.objects.first().and_then(|o| o.detected.as_ref()).map(|d| format!("{:?} {:?}", d.colour, d.shape));
    println!("judge: background {:?} (wanted blue), object {:?} (wanted red circle)", verdict.analysis.background, seen);
    assert!(verdict.background_colour, "the live result's background is {:?}, not blue", verdict.analysis.background);
    assert!(verdict.objects.first().is_some_and(|o| o.colour), "the live result has no red object: {seen:?}");
}
