//! The `brume` command end to end on the built-in model and the fixtures.

use std::process::Command;

fn brume() -> Command {
    Command::new(env!("CARGO_BIN_EXE_brume"))
}

fn fixtures() -> std::path::PathBuf {
    std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures"))
}

#[test]
fn generate_with_the_builtin_model_writes_a_png_and_never_overwrites() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.png");
    let run = brume().args(["generate", "a red circle on a blue background", "--steps", "3", "--out"]).arg(&out).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let img = image::open(&out).unwrap();
    assert_eq!((img.width(), img.height()), (64, 64));
    // Same seed, same picture; the existing file is kept without --force.
    let again = brume().args(["generate", "--prompt", "a red circle on a blue background", "--steps", "3", "--out"]).arg(&out).output().unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    let out2 = tmp.path().join("y.png");
    let third = brume().args(["generate", "a red circle on a blue background", "--steps", "3", "--out"]).arg(&out2).output().unwrap();
    assert!(third.status.success());
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&out2).unwrap(), "same seed must give the same PNG");
}

#[test]
fn bad_requests_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.png");
    let run = brume().args(["generate", "--out"]).arg(&out).output().unwrap();
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("no prompt"));
    let run = brume().args(["generate", "cat", "--width", "100", "--out"]).arg(&out).output().unwrap();
    assert!(String::from_utf8_lossy(&run.stderr).contains("multiples of 8"), "{}", String::from_utf8_lossy(&run.stderr));
    let run = brume().args(["generate", "cat", "--model", "/nonexistent/model", "--out"]).arg(&out).output().unwrap();
    assert!(String::from_utf8_lossy(&run.stderr).contains("/nonexistent/model"));
    assert!(!out.exists());
}

#[test]
fn inspect_reports_segments() {
    let run = brume().arg("inspect").arg(fixtures().join("parity/pipeline_sd2v/model")).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let text = String::from_utf8_lossy(&run.stdout);
    for s in ["text_encoder", "vae_encoder", "unet", "vae_decoder", "VPrediction", "F32"] {
        assert!(text.contains(s), "missing {s} in\n{text}");
    }
}

#[test]
fn random_model_of_a_real_config_loads() {
    // SDXS is the smallest real preset; f16 keeps the write small and fast.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sdxs");
    let run = brume().args(["random-model", "--preset", "sdxs-512", "--out"]).arg(&dir).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let run = brume().arg("inspect").arg(&dir).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let text = String::from_utf8_lossy(&run.stdout);
    assert!(text.contains("AutoencoderTiny") && text.contains("native size  512x512"), "{text}");
    let again = brume().args(["random-model", "--preset", "sdxs-512", "--out"]).arg(&dir).output().unwrap();
    assert!(!again.status.success(), "must not overwrite an existing folder");
}
