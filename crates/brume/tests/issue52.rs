//! One test per class of issue 52, each written against APIs that already
//! existed before the fix, so it can be run on the old tree to see it fail:
//! class 2 (wrong results reported as success), class 3 (panics and aborts on
//! input), class 4 (unbounded memory from small files). Class 1 is in
//! `output_rule.rs` and `precision.rs::converting_refuses_to_overwrite`,
//! class 5 in `precision.rs::a_cancelled_convert_leaves_nothing` and the CLI tests.

use std::io::Write;
use std::path::{Path, PathBuf};

use brume::memory::planner::{plan, ResolutionFallback};
use brume::memory::{ModelProfile, RequestShape};
use brume::models::config::ConfigReader;
use brume::pipelines::{txt2img, Flow, GenerationRequest, OpenOptions, RunOptions, SdModel};
use brume::runtime::budget::Budget;
use brume::samplers::schedule::ScheduleConfig;
use brume::samplers::{noise_source, RngKind, SamplerKind};
use candle_core::DType;
use serde_json::json;

fn builtin_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/builtin"))
}

fn builtin() -> SdModel {
    SdModel::open(&builtin_root(), &OpenOptions::default()).unwrap()
}

fn run(model: &SdModel, req: &GenerationRequest) -> brume::error::Result<brume::pipelines::Generated> {
    let mut noise = noise_source(req.rng, req.seed);
    txt2img(model, req, &RunOptions::default(), noise.as_mut(), None, &mut |_| Flow::Continue)
}

fn schedule(fields: serde_json::Value) -> Result<ScheduleConfig, brume::LoadError> {
    let serde_json::Value::Object(map) = fields else { unreachable!() };
    ScheduleConfig::from_reader(&ConfigReader::from_map(Path::new("scheduler_config.json"), map))
}

/// A copy of the built-in model whose `file` is rewritten by `edit`.
fn edited_copy(dir: &Path, file: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let root = dir.join("m");
    copy_dir(&builtin_root(), &root);
    let p = root.join(file);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
    root
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

// ---- class 2: wrong results reported as success ----

#[test]
fn class2_absurd_guidance_or_eta_is_an_error_not_a_black_picture() {
    let model = builtin();
    for (g, eta) in [(1e30, 0.0), (7.5, 1e6), (-1e30, 0.0)] {
        let req = GenerationRequest {
            steps: 2,
            guidance_scale: g,
            eta,
            sampler: Some(SamplerKind::Ddim),
            ..GenerationRequest::new("a red circle", 32)
        };
        let e = run(&model, &req).err().unwrap_or_else(|| panic!("guidance {g} eta {eta} reported success")).to_string();
        assert!(e.contains("guidance") || e.contains("eta"), "{e}");
    }
}

#[test]
fn class2_scheduler_betas_out_of_range_and_vae_scaling_zero_are_errors() {
    for bad in [
        json!({"beta_start": 0.5, "beta_end": 1.5}),
        json!({"beta_start": -0.1}),
        json!({"beta_start": 0.02, "beta_end": 0.01}),
        json!({"beta_start": 0.5, "beta_end": 0.99, "beta_schedule": "linear"}),
    ] {
        let e = schedule(bad.clone()).err().unwrap_or_else(|| panic!("{bad} accepted")).to_string();
        assert!(e.contains("beta"), "{e}");
    }
    let c = ConfigReader::from_map(Path::new("vae/config.json"), json!({"scaling_factor": 0.0}).as_object().unwrap().clone());
    let e = brume::models::AutoencoderKLConfig::from_reader(&c).err().expect("scaling_factor 0 accepted").to_string();
    assert!(e.contains("scaling_factor"), "{e}");
}

#[test]
fn class2_the_fingerprint_changes_with_any_config_or_weight() {
    let base = brume::pipelines::recipe::model_hash(&builtin());
    let tmp = tempfile::tempdir().unwrap();
    let root = edited_copy(tmp.path(), "scheduler/scheduler_config.json", |v| v["beta_end"] = json!(0.013));
    let changed = brume::pipelines::recipe::model_hash(&SdModel::open(&root, &OpenOptions::default()).unwrap());
    assert_ne!(base, changed, "a scheduler config change must change the fingerprint");
    // Same header and length, one weight byte different.
    let tmp = tempfile::tempdir().unwrap();
    let root = edited_copy(tmp.path(), "unet/config.json", |_| {});
    let w = root.join("unet/diffusion_pytorch_model.safetensors");
    let mut bytes = std::fs::read(&w).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(&w, bytes).unwrap();
    let changed = brume::pipelines::recipe::model_hash(&SdModel::open(&root, &OpenOptions::default()).unwrap());
    assert_ne!(base, changed, "a weight change must change the fingerprint");
}

#[test]
fn class2_non_finite_weights_are_an_error_naming_the_component() {
    let tmp = tempfile::tempdir().unwrap();
    let root = edited_copy(tmp.path(), "unet/config.json", |_| {});
    // The UNet's last stored value (an f16 of a linear weight) becomes NaN.
    let w = root.join("unet/diffusion_pytorch_model.safetensors");
    let mut bytes = std::fs::read(&w).unwrap();
    let n = bytes.len();
    bytes[n - 2..].copy_from_slice(&half_nan());
    std::fs::write(&w, bytes).unwrap();
    let model = SdModel::open(&root, &OpenOptions::default()).unwrap();
    let req = GenerationRequest { steps: 2, sampler: Some(SamplerKind::Ddim), ..GenerationRequest::new("a red circle", 32) };
    let e = run(&model, &req).err().expect("NaN weights reported success").to_string();
    assert!(e.contains("UNet") && e.contains("not finite"), "{e}");
}

/// f16 NaN, little-endian.
fn half_nan() -> [u8; 2] {
    0x7e00u16.to_le_bytes()
}

// ---- class 3: panics and aborts on input ----

#[test]
fn class3_planning_a_tiny_or_odd_size_is_an_error_not_a_panic() {
    let model = builtin();
    let profile = ModelProfile::of(&model, DType::F32);
    for (w, h) in [(64, 4), (4, 64), (0, 64), (64, 12), (1 << 40, 8)] {
        let shape = RequestShape { batch: 1, guided: true, width: w, height: h, encodes_image: false };
        let r = std::panic::catch_unwind(|| plan(&profile, &shape, &Budget::explicit(64 << 30, "test"), ResolutionFallback::Report, &[]).is_err());
        assert_eq!(r.ok(), Some(true), "{w}x{h}: planning must fail cleanly");
    }
}

#[test]
fn class3_huge_num_train_timesteps_is_an_error_not_an_abort() {
    // 1 is the fuzzer's find (fuzz/artifacts/configs): a one-entry sigma table indexed at 1.
    for n in [u64::MAX, 1 << 40, 1 << 33, 1, 0] {
        let e = schedule(json!({ "num_train_timesteps": n })).err().unwrap_or_else(|| panic!("{n} accepted")).to_string();
        assert!(e.contains("num_train_timesteps"), "{e}");
    }
}

// ---- class 4: unbounded memory from small files ----

/// A PNG with one zTXt chunk inflating to `inflated` bytes.
fn ztxt_bomb(path: &Path, inflated: usize) {
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
    let block = vec![b'a'; 1 << 20];
    for _ in 0..inflated >> 20 {
        z.write_all(&block).unwrap();
    }
    let compressed = z.finish().unwrap();
    let mut data = b"parameters\0\0".to_vec();
    data.extend_from_slice(&compressed);
    let mut png = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut png, 8, 8);
        enc.set_color(png::ColorType::Rgb);
        let mut w = enc.write_header().unwrap();
        w.write_chunk(png::chunk::zTXt, &data).unwrap();
        w.write_image_data(&[0u8; 8 * 8 * 3]).unwrap();
        w.finish().unwrap();
    }
    std::fs::write(path, png).unwrap();
}

#[test]
fn class4_a_text_chunk_that_inflates_past_the_bound_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("bomb.png");
    ztxt_bomb(&p, 64 << 20);
    assert!(std::fs::metadata(&p).unwrap().len() < 1 << 20);
    match brume::pipelines::recipe::read_png_text(&p) {
        Err(e) => assert!(e.to_string().contains("parameters"), "{e}"),
        Ok(chunks) => panic!("read {} bytes of text from a {} byte file", chunks.iter().map(|(_, v)| v.len()).sum::<usize>(), std::fs::metadata(&p).unwrap().len()),
    }
    // Ordinary metadata still reads.
    let ok = tmp.path().join("ok.png");
    ztxt_bomb(&ok, 1 << 20);
    let chunks = brume::pipelines::recipe::read_png_text(&ok).unwrap();
    assert_eq!(chunks[0].1.len(), 1 << 20);
    let _ = RngKind::Brume;
}
