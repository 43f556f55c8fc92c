//! Precision tiers end to end: the parity fixture model converted to every preset
//! loads like any model, its compressed weights stay packed, and its txt2img
//! output stays close to the fp32 output; corrupt compressed files are typed errors.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use brume::loading::diffusers::open_component;
use brume::loading::safetensors::{write_safetensors, SafetensorsFile, StoredDType};
use brume::loading::{Component, Segment};
use brume::pipelines::{txt2img, Flow, GenerationRequest, OpenOptions, RunOptions, SdModel};
use brume::quantization::convert::{convert, ConfigSource, RECORD_FILE};
use brume::quantization::format::{PrecisionTable, TensorScheme, PRECISION_KEY};
use brume::quantization::{Policy, QuantError, Scheme};
use brume::LoadError;
use candle_core::Tensor;
use common::{fixtures, Io, ReplayNoise};

fn source() -> PathBuf {
    fixtures().join("parity/pipeline_sd1/model")
}

fn convert_to(preset: &str, out: &Path) -> SdModel {
    let src = SdModel::open(&source(), &OpenOptions::default()).unwrap();
    let policy = Policy::preset(preset).unwrap();
    convert(&src, ConfigSource::Folder(&source()), Some(&source()), &policy, out, false).unwrap();
    SdModel::open(out, &OpenOptions::default()).unwrap()
}

/// The fixture's 5-step guided DDIM run from its recorded initial latents.
fn run(model: &SdModel) -> Tensor {
    let io = Io::open(fixtures().join("parity/pipeline_sd1/io.safetensors"));
    let req = GenerationRequest { steps: 5, guidance_scale: 7.5, ..GenerationRequest::new("a red circle on a blue background", 64) };
    let mut noise = ReplayNoise::new(vec![io.f32("in.latents")]);
    txt2img(model, &req, &RunOptions::default(), &mut noise, None, &mut |_| Flow::Continue).unwrap().image
}

/// PSNR in dB of images in [0, 1].
fn psnr(a: &Tensor, b: &Tensor) -> f64 {
    let mse = (a - b).unwrap().sqr().unwrap().mean_all().unwrap().to_scalar::<f32>().unwrap() as f64;
    10.0 * (1.0 / mse.max(1e-20)).log10()
}

/// The scheme the 4-bit presets give conv and linear weights.
fn preset_palettize4() -> Scheme {
    Scheme::parse(&format!("palettize4-g{}", brume::quantization::policy::PRESET_LUT_GROUP)).unwrap()
}

#[test]
fn every_preset_converts_loads_and_stays_close_to_fp32() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = run(&SdModel::open(&source(), &OpenOptions::default()).unwrap());
    // (preset, minimum PSNR in dB against fp32 with the same latents). Measured on this
    // tiny random-weight fixture (hidden size 8, so every weight matters): fp32 exact,
    // fp16 66.4, bf16 48.2, int8 40.5, int4-attn-fp16 19.2, int4 19.5, ternary-attn-fp16 13.1.
    let cases: [(&str, f64); 7] = [
        ("fp32", 200.0),
        ("fp16", 60.0),
        ("bf16", 43.0),
        ("int8", 36.0),
        ("int4-attn-fp16", 16.0),
        ("int4", 16.0),
        ("ternary-attn-fp16", 10.0),
    ];
    let fp32_weights = brume::memory::segment_weights(
        &SdModel::open(&source(), &OpenOptions::default()).unwrap(),
        Segment::Unet,
        candle_core::DType::F32,
    );
    assert_eq!(fp32_weights.scratch, 0, "f32 weights are read in place");
    for (preset, min_psnr) in cases {
        let out = tmp.path().join(preset);
        let model = convert_to(preset, &out);
        // The estimator sees what the layers do: packed weights stay clean pages of
        // the file (only vectors are private, as for fp32), plus one expansion block.
        let w = brume::memory::segment_weights(&model, Segment::Unet, candle_core::DType::F32);
        assert_eq!(w.private, fp32_weights.private, "{preset}: private weights");
        assert!(w.mapped <= model.segment_bytes(Segment::Unet) as u64, "{preset}");
        if preset == "fp16" {
            let half = fp32_weights.mapped as f64 / 2.0;
            assert!((w.mapped as f64 - half).abs() < 0.01 * half, "fp16 maps half of fp32: {} vs {half}", w.mapped);
        }
        let largest = model
            .store(Component::Unet)
            .iter()
            .filter(|(_, t)| t.shape().len() >= 2 && t.scheme() != Some(Scheme::F32))
            .map(|(_, t)| t.shape().iter().product::<usize>() as u64 * 4)
            .max()
            .unwrap_or(0);
        assert_eq!(w.scratch, largest, "{preset}: the scratch is the largest packed weight (all under one block)");
        // Self-describing: the record names the policy and the source's fingerprint.
        let record: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join(RECORD_FILE)).unwrap()).unwrap();
        assert_eq!(record["policy"], preset);
        assert_eq!(record["source_hash"].as_str().unwrap().len(), 10);
        // Each segment its own file; bytes are what the schemes imply.
        for (seg, file) in [
            (Segment::TextEncoder, "text_encoder/model.safetensors"),
            (Segment::Unet, "unet/diffusion_pytorch_model.safetensors"),
            (Segment::VaeEncoder, "vae/vae_encoder.safetensors"),
            (Segment::VaeDecoder, "vae/vae_decoder.safetensors"),
        ] {
            let f = SafetensorsFile::open(&out.join(file)).unwrap();
            let table = PrecisionTable::of(&f).unwrap().unwrap();
            let implied: usize = table.tensors.values().map(|t| Scheme::parse(&t.scheme).unwrap().nbytes(&t.shape)).sum();
            assert_eq!(model.segment_bytes(seg), implied, "{preset} {seg}");
            assert_eq!(record["segment_bytes"][seg.name()].as_u64().unwrap() as usize, implied, "{preset} {seg}");
        }
        let q = model.store(Component::Unet).get("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight").unwrap();
        let ff = model.store(Component::Unet).get("down_blocks.0.attentions.0.transformer_blocks.0.ff.net.2.weight").unwrap();
        let norm = model.store(Component::Unet).get("down_blocks.0.resnets.0.norm1.weight").unwrap();
        let p4 = preset_palettize4();
        let (want_q, want_ff) = match preset {
            "fp32" => (Scheme::F32, Scheme::F32),
            "bf16" => (Scheme::BF16, Scheme::BF16),
            "fp16" => (Scheme::F16, Scheme::F16),
            "int8" => (Scheme::Int8, Scheme::Int8),
            "int4" => (p4, p4),
            "int4-attn-fp16" => (Scheme::F16, p4),
            _ => (Scheme::F16, Scheme::Ternary),
        };
        assert_eq!((q.scheme(), ff.scheme()), (Some(want_q), Some(want_ff)), "{preset}");
        assert!(matches!(norm.scheme(), Some(Scheme::F16 | Scheme::F32 | Scheme::BF16)), "{preset}: norms stay float");

        let image = run(&model);
        let p = psnr(&image, &reference);
        let rel = common::rel_err(&image, &reference);
        eprintln!("{preset:<18} PSNR {p:6.1} dB, max rel diff {rel:.2e}");
        if preset == "fp32" {
            assert_eq!(rel, 0.0, "fp32 conversion must be exact");
        }
        assert!(p >= min_psnr, "{preset}: PSNR {p:.1} dB < {min_psnr}");
    }
}

#[test]
fn converting_refuses_to_overwrite() {
    let tmp = tempfile::tempdir().unwrap();
    let src = SdModel::open(&source(), &OpenOptions::default()).unwrap();
    let policy = Policy::preset("int8").unwrap();
    let conv = |out: &Path, force| convert(&src, ConfigSource::Folder(&source()), Some(&source()), &policy, out, force);
    // Never the input, nor a folder holding it, even with --force.
    for out in [source(), source().join("..")] {
        let e = conv(&out, true).unwrap_err().to_string();
        assert!(e.contains("input model"), "{e}");
    }
    let out = tmp.path().join("m");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep"), b"x").unwrap();
    let e = conv(&out, false).unwrap_err().to_string();
    assert!(e.contains("already exists") && e.contains("--force"), "{e}");
    assert!(out.join("keep").exists());
    // --force never deletes what a folder held (issue 52): a folder that is not
    // a conversion is refused, before any work.
    let e = conv(&out, true).unwrap_err().to_string();
    assert!(e.contains("not a model brume converted"), "{e}");
    assert!(out.join("keep").exists());
    // A previous conversion is replaced, but not a file of the user's put into it.
    std::fs::remove_file(out.join("keep")).unwrap();
    conv(&out, false).unwrap();
    std::fs::write(out.join("keep"), b"x").unwrap();
    let e = conv(&out, true).unwrap_err().to_string();
    assert!(e.contains("keep") && e.contains("deletes nothing"), "{e}");
    assert!(out.join("keep").exists() && out.join(RECORD_FILE).exists());
    std::fs::remove_file(out.join("keep")).unwrap();
    conv(&out, true).unwrap();
    assert!(out.join(RECORD_FILE).exists());
    // A symlink at OUT is never replaced, even with --force.
    #[cfg(unix)]
    {
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&out, &link).unwrap();
        let e = conv(&link, true).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        std::fs::remove_file(&link).unwrap();
    }
    // No temporary folder left behind.
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().starts_with('.')).collect();
    assert!(leftovers.is_empty());
}

/// A one-tensor component folder with a precision table, for corruption tests.
fn write_component(dir: &Path, tensors: &[(String, StoredDType, Vec<usize>, Vec<u8>)], schemes: &[(&str, &str, Vec<usize>)]) {
    let mut table = PrecisionTable::new();
    for (name, scheme, shape) in schemes {
        table.tensors.insert(name.to_string(), TensorScheme { scheme: scheme.to_string(), shape: shape.clone() });
    }
    let meta: BTreeMap<String, String> = [(PRECISION_KEY.to_string(), table.to_json())].into();
    write_safetensors(&dir.join("diffusion_pytorch_model.safetensors"), tensors, &meta).unwrap();
}

fn quant_error(dir: &Path) -> (String, QuantError) {
    match open_component(dir, None) {
        Err(LoadError::Quantized { tensor, source, path }) => {
            assert!(path.ends_with("diffusion_pytorch_model.safetensors"));
            (tensor, *source)
        }
        Err(other) => panic!("expected a compressed-tensor error, got {other}"),
        Ok(_) => panic!("expected an error"),
    }
}

#[test]
fn corrupt_compressed_files_are_typed_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let t = |name: &str, dtype, shape: Vec<usize>| {
        let n = shape.iter().product::<usize>() * match dtype {
            StoredDType::F16 => 2,
            StoredDType::F32 => 4,
            _ => 1,
        };
        (name.to_string(), dtype, shape, vec![0u8; n])
    };
    // A valid 4-bit [8, 6] tensor: 24 index bytes, a [1, 16] table.
    write_component(d, &[t("w", StoredDType::U8, vec![24]), t("w.lut", StoredDType::F16, vec![1, 16])], &[("w", "palettize4", vec![8, 6])]);
    let store = open_component(d, None).unwrap();
    assert_eq!(store.len(), 1, "the table is folded into its tensor");
    assert_eq!(store.get("w").unwrap().shape(), vec![8, 6]);
    assert_eq!(store.get("w").unwrap().nbytes(), 24 + 32);

    // LUT size against the bit width.
    write_component(d, &[t("w", StoredDType::U8, vec![24]), t("w.lut", StoredDType::F16, vec![1, 4])], &[("w", "palettize4", vec![8, 6])]);
    let (name, e) = quant_error(d);
    assert_eq!(name, "w");
    assert_eq!(e, QuantError::LutSize { bits: 4, groups: 1, levels: 16, found: vec![1, 4] });
    assert!(e.to_string().contains("4-bit"), "{e}");
    // Index bytes against the shape.
    write_component(d, &[t("w", StoredDType::U8, vec![23]), t("w.lut", StoredDType::F16, vec![1, 16])], &[("w", "palettize4", vec![8, 6])]);
    assert_eq!(quant_error(d).1, QuantError::IndexBytes { shape: vec![8, 6], bits: 4, expected: 24, found: 23 });
    // Unknown scheme.
    write_component(d, &[t("w", StoredDType::U8, vec![24])], &[("w", "palettize5", vec![8, 6])]);
    assert!(matches!(quant_error(d).1, QuantError::UnknownScheme { scheme } if scheme == "palettize5"));
    // Missing companion.
    write_component(d, &[t("w", StoredDType::I8, vec![8, 6])], &[("w", "int8", vec![8, 6])]);
    assert_eq!(quant_error(d).1, QuantError::MissingCompanion { companion: "w.scale".into() });
    // Wrong scale shape.
    write_component(d, &[t("w", StoredDType::I8, vec![8, 6]), t("w.scale", StoredDType::F32, vec![6])], &[("w", "int8", vec![8, 6])]);
    assert!(matches!(quant_error(d).1, QuantError::PartMismatch { .. }));
    // A described tensor that is absent.
    write_component(d, &[t("w", StoredDType::F16, vec![8, 6])], &[("w", "fp16", vec![8, 6]), ("gone", "fp16", vec![2])]);
    assert_eq!(quant_error(d), ("gone".to_string(), QuantError::MissingData));
    // A float scheme whose stored dtype disagrees.
    write_component(d, &[t("w", StoredDType::F32, vec![8, 6])], &[("w", "fp16", vec![8, 6])]);
    assert!(matches!(quant_error(d).1, QuantError::PartMismatch { .. }));
}

#[test]
fn truncated_converted_file_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    drop(convert_to("int4-attn-fp16", &out));
    let unet = out.join("unet/diffusion_pytorch_model.safetensors");
    let bytes = std::fs::read(&unet).unwrap();
    std::fs::write(&unet, &bytes[..bytes.len() - 100]).unwrap();
    let e = match SdModel::open(&out, &OpenOptions::default()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a truncated file opened"),
    };
    assert!(e.contains("diffusion_pytorch_model.safetensors") && e.contains("truncated"), "{e}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            copy_dir(&p, &to.join(e.file_name()));
        } else {
            std::fs::copy(&p, to.join(e.file_name())).unwrap();
        }
    }
}

#[test]
fn another_unet_subfolder_converts_into_its_own_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    copy_dir(&source(), &src);
    copy_dir(&source().join("unet"), &src.join("unet_lcm"));
    let opts = OpenOptions { unet: Some("unet_lcm".into()), ..OpenOptions::default() };
    let model = SdModel::open(&src, &opts).unwrap();
    let out = tmp.path().join("out");
    let policy = Policy::preset("int4-attn-fp16").unwrap();
    let rec = convert(&model, ConfigSource::Folder(&src), Some(&src), &policy, &out, false).unwrap();
    assert!(out.join("unet_lcm/diffusion_pytorch_model.safetensors").is_file() && !out.join("unet").exists());
    // Policies still name its tensors `unet/...`.
    assert!(rec.schemes.contains_key(&preset_palettize4().to_string()));
    let converted = SdModel::open(&out, &opts).unwrap();
    let ff = converted.store(Component::Unet).get("down_blocks.0.attentions.0.transformer_blocks.0.ff.net.2.weight").unwrap();
    assert_eq!(ff.scheme(), Some(preset_palettize4()));
    run(&converted);
}
