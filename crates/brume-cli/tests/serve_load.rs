//! The load bar at CI size: `brume bench serve` with few requests and clients
//! (the full run is `brume bench serve`: 16 clients, 500 requests). The bench
//! itself checks every request answered (success, 4xx, or 429 with
//! Retry-After, retried), no 5xx, no panic, every success in the gallery
//! exactly once, RSS within 10 % of after warm-up, and that a repeated prompt
//! skips the text encoder; it exits non-zero when one fails.

use std::process::Command;

#[test]
fn bench_serve_at_ci_size_passes_its_bars() {
    let out = Command::new(env!("CARGO_BIN_EXE_brume"))
        .args([
            "bench",
            "serve",
            "--requests",
            "60",
            "--clients",
            "4",
            "--latency-runs",
            "3",
            "--latency-report-only",
        ])
        .env_remove("RUST_LOG")
        .output()
        .expect("brume runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(out.status.success(), "brume bench serve failed");
    for want in [
        "RESULT: PASS",
        ", 5xx: 0",
        "panics in the server's stderr: 0",
        "unanswered requests: 0",
        "text encoder skipped on repeats: 3/3",
    ] {
        assert!(stdout.contains(want), "`{want}` missing from the report");
    }
    // Every kind of the mix ran.
    for kind in [
        "native txt2img",
        "A1111 txt2img",
        "OpenAI generations",
        "native img2img",
        "cancel half-way",
        "malformed",
    ] {
        let row = stdout
            .lines()
            .find(|l| l.starts_with(kind))
            .unwrap_or_else(|| panic!("no row for {kind}"));
        let count: usize = row[20..]
            .split_whitespace()
            .next()
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        assert!(count > 0, "{kind} never ran: {row}");
    }
}
