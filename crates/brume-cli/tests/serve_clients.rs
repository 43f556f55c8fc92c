//! Real clients against `brume serve`: the official `openai` Python package
//! pointed at it through `base_url` (models, generate n=2, edit with a mask),
//! and the request sequences Open WebUI and SillyTavern send to an A1111
//! server (tools/clients/). Every picture must decode and carry its recipe.
//!
//! The pinned packages (tools/clients/requirements.txt) are installed with pip
//! into a venv under target/tmp when missing; without python3 or PyPI the test
//! fails rather than skipping.

#[path = "../src/commands/bench_serve/http.rs"]
mod http;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use http::ServeChild;

const TOKEN: &str = "client-test-token";

fn clients_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/clients")
}

/// The venv's python, with the pinned packages (installed on first use).
fn venv_python() -> PathBuf {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("client-venv");
    let py = venv.join("bin/python");
    let req = clients_dir().join("requirements.txt");
    let pins: Vec<String> = std::fs::read_to_string(&req)
        .expect("tools/clients/requirements.txt")
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect();
    let check = format!(
        "import importlib.metadata as m, sys; pins = {pins:?}; bad = [p for p in pins if m.version(p.split('==')[0]) != p.split('==')[1]]; sys.exit(1 if bad else 0)"
    );
    let ready = || {
        Command::new(&py)
            .args(["-c", &check])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if ready() {
        return py;
    }
    if !py.exists() {
        let out = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .output()
            .expect("python3 is needed for the client tests");
        assert!(
            out.status.success(),
            "python3 -m venv failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = Command::new(venv.join("bin/pip"))
        .args(["install", "--disable-pip-version-check", "-q", "-r"])
        .arg(&req)
        .output()
        .expect("pip runs");
    assert!(
        out.status.success(),
        "pip install -r {} failed:\n{}",
        req.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        ready(),
        "the pinned client packages are still missing after pip install"
    );
    py
}

fn run_script(py: &Path, script: &str, args: &[&str]) -> String {
    let out = Command::new(py)
        .arg(clients_dir().join(script))
        .args(args)
        .current_dir(clients_dir())
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("{script}:\n{stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.trim_end().ends_with("OK"),
        "{script} failed:\n{stdout}\n{stderr}"
    );
    stdout
}

#[test]
fn openai_sdk_open_webui_and_sillytavern_get_pictures_with_their_recipe() {
    let py = venv_python();
    let tmp = tempfile::tempdir().unwrap();
    let mut s = ServeChild::start(
        Path::new(env!("CARGO_BIN_EXE_brume")),
        &tmp.path().join("data"),
        &["--token", TOKEN],
        &[],
    )
    .expect("serve starts");
    let base = format!("http://{}", s.addr);
    run_script(
        &py,
        "openai_client.py",
        &["--base-url", &format!("{base}/v1"), "--api-key", TOKEN],
    );
    run_script(
        &py,
        "a1111_clients.py",
        &["--base-url", &base, "--auth", &format!("user:{TOKEN}")],
    );
    let stderr = s.stderr();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(s.stop());
}

/// Open WebUI sends an empty `authorization` header when no A1111 auth is
/// configured: a server without a token takes it as no credentials.
#[test]
fn an_empty_authorization_header_is_no_credentials() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = ServeChild::start(
        Path::new(env!("CARGO_BIN_EXE_brume")),
        &tmp.path().join("data"),
        &[],
        &[],
    )
    .expect("serve starts");
    let r = http::request(
        s.addr,
        "GET",
        "/sdapi/v1/options",
        &[("authorization", "")],
        &[],
        Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(s.stop());
}
