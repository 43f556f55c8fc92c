//! The fuzz bar at CI size: seeded random and malformed requests against the
//! three APIs and the gallery (`brume bench serve --fuzz N --seed S`; the full
//! bar is 10,000). No 5xx, no panic, no answer carrying a file from outside
//! the data directory, nothing written outside it, and the server still runs
//! a good job after. `BRUME_FUZZ_N` and `BRUME_FUZZ_SEED` run it longer or
//! replay another seed (a failure names its case number and seed).

use std::process::Command;

#[test]
fn seeded_fuzz_gets_no_5xx_no_panic_and_the_server_keeps_serving() {
    let n = std::env::var("BRUME_FUZZ_N").unwrap_or_else(|_| "1500".into());
    let seed = std::env::var("BRUME_FUZZ_SEED").unwrap_or_else(|_| "46".into());
    let out = Command::new(env!("CARGO_BIN_EXE_brume"))
        .args(["bench", "serve", "--fuzz", &n, "--seed", &seed])
        .env_remove("RUST_LOG")
        .output()
        .expect("brume runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "brume bench serve --fuzz failed");
    for want in [
        "RESULT: PASS",
        "5xx: 0; no answer: 0; leaks of files outside the data dir: 0",
        "panics in the server's stderr: 0",
        "files written outside the data dir: 0",
        "good requests after the fuzz: native job done",
    ] {
        assert!(stdout.contains(want), "`{want}` missing from the report");
    }
}
