//! Bad input gets an error naming the file, tensor, shape or field; nothing panics.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use brume::loading::diffusers::open_component;
use brume::loading::safetensors::{write_safetensors, SafetensorsFile, StoredDType};
use brume::models::{UNet2DConditionModel, UNetConfig};
use brume::pipelines::{OpenOptions, SdModel};
use brume::LoadError;
use candle_core::{DType, Device};
use common::{assert_close, fixtures, Io};

fn unet_fixture() -> PathBuf {
    fixtures().join("parity/unet_sd1/model")
}

/// Copies the unet fixture's config and returns (tmpdir, tensors) for editing.
fn editable_unet() -> (tempfile::TempDir, Vec<(String, StoredDType, Vec<usize>, Vec<u8>)>) {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(unet_fixture().join("config.json"), tmp.path().join("config.json")).unwrap();
    let f = SafetensorsFile::open(&unet_fixture().join("diffusion_pytorch_model.safetensors")).unwrap();
    let tensors = f
        .entries()
        .iter()
        .map(|(k, e)| (k.clone(), e.dtype, e.shape.clone(), f.bytes(e).to_vec()))
        .collect();
    (tmp, tensors)
}

fn load_unet(dir: &Path) -> Result<UNet2DConditionModel, LoadError> {
    let cfg = UNetConfig::from_file(&dir.join("config.json"))?;
    let store = open_component(dir, None)?;
    UNet2DConditionModel::load(&store, &cfg, &Device::Cpu, DType::F32)
}

fn write(dir: &Path, tensors: &[(String, StoredDType, Vec<usize>, Vec<u8>)]) -> PathBuf {
    let p = dir.join("diffusion_pytorch_model.safetensors");
    write_safetensors(&p, tensors, &BTreeMap::new()).unwrap();
    p
}

fn err_of<T>(r: Result<T, LoadError>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_tensor_is_named() {
    let (tmp, mut t) = editable_unet();
    t.retain(|(k, ..)| k != "conv_out.weight");
    write(tmp.path(), &t);
    let e = err_of(load_unet(tmp.path()));
    assert!(e.contains("missing tensor `conv_out.weight`") && e.contains("[4, 16, 3, 3]"), "{e}");
}

#[test]
fn unexpected_tensor_is_named() {
    let (tmp, mut t) = editable_unet();
    t.push(("add_embedding.linear_1.weight".into(), StoredDType::F32, vec![2], vec![0; 8]));
    write(tmp.path(), &t);
    let e = err_of(load_unet(tmp.path()));
    assert!(e.contains("unexpected tensor") && e.contains("add_embedding.linear_1.weight"), "{e}");
}

#[test]
fn wrong_shape_is_named() {
    let (tmp, mut t) = editable_unet();
    let i = t.iter().position(|(k, ..)| k == "conv_in.bias").unwrap();
    t[i].2 = vec![8, 2];
    let p = write(tmp.path(), &t);
    let e = err_of(load_unet(tmp.path()));
    assert!(e.contains("conv_in.bias") && e.contains("[8, 2]") && e.contains("[16]"), "{e}");
    assert!(e.contains(&p.display().to_string()), "{e}");
}

#[test]
fn wrong_dtype_is_named() {
    let (tmp, mut t) = editable_unet();
    let i = t.iter().position(|(k, ..)| k == "conv_in.bias").unwrap();
    t[i].1 = StoredDType::I32;
    write(tmp.path(), &t);
    let e = err_of(load_unet(tmp.path()));
    assert!(e.contains("conv_in.bias") && e.contains("I32"), "{e}");
}

#[test]
fn truncated_file() {
    let (tmp, t) = editable_unet();
    let p = write(tmp.path(), &t);
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 100]).unwrap();
    let e = err_of(SafetensorsFile::open(&p));
    assert!(e.contains("past the end") && e.contains(&p.display().to_string()), "{e}");
    std::fs::write(&p, &bytes[..5]).unwrap();
    let e = err_of(SafetensorsFile::open(&p));
    assert!(e.contains("truncated"), "{e}");
}

#[test]
fn header_length_outside_file() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("x.safetensors");
    let mut bytes = 1_000_000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&p, &bytes).unwrap();
    let e = err_of(SafetensorsFile::open(&p));
    assert!(e.contains("truncated") && e.contains("header of 1000000 bytes"), "{e}");
    let mut bytes = u64::MAX.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&p, &bytes).unwrap();
    let e = err_of(SafetensorsFile::open(&p));
    assert!(e.contains("implausible"), "{e}");
}

#[test]
fn corrupt_header_json_and_offsets() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("x.safetensors");
    let header = b"{not json";
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    std::fs::write(&p, &bytes).unwrap();
    assert!(err_of(SafetensorsFile::open(&p)).contains("not valid JSON"));

    let header = br#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0; 12]);
    std::fs::write(&p, &bytes).unwrap();
    let e = err_of(SafetensorsFile::open(&p));
    assert!(e.contains("`w`") && e.contains("needs 16"), "{e}");

    let header = br#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,4000]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0; 16]);
    std::fs::write(&p, &bytes).unwrap();
    let e = err_of(SafetensorsFile::open(&p));
    assert!(e.contains("`w`") && e.contains("past the end"), "{e}");

    let header = br#"{"w":{"dtype":"Q7","shape":[4],"data_offsets":[0,16]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0; 16]);
    std::fs::write(&p, &bytes).unwrap();
    assert!(err_of(SafetensorsFile::open(&p)).contains("unsupported dtype `Q7`"));
}

#[test]
fn pickle_checkpoints_are_refused_not_executed() {
    let tmp = tempfile::tempdir().unwrap();
    // A zip (torch.save) and a raw pickle stream, whatever their names.
    let zip = tmp.path().join("model.safetensors");
    std::fs::write(&zip, b"PK\x03\x04 pretend this is archive/data.pkl").unwrap();
    let e = err_of(SafetensorsFile::open(&zip));
    assert!(e.contains("pickle") && e.contains("safetensors"), "{e}");
    let ckpt = tmp.path().join("sd.ckpt");
    std::fs::write(&ckpt, [0x80u8, 0x02, b'c', b'o', b's']).unwrap();
    let e = err_of(SdModel::open(&ckpt, &OpenOptions::default()));
    assert!(e.contains("never unpickles") && e.contains("sd.ckpt"), "{e}");
    // A component folder holding only a .bin.
    let comp = tmp.path().join("unet");
    std::fs::create_dir(&comp).unwrap();
    std::fs::write(comp.join("diffusion_pytorch_model.bin"), b"PK\x03\x04").unwrap();
    let e = err_of(open_component(&comp, None));
    assert!(e.contains("diffusion_pytorch_model.bin") && e.contains("pickle"), "{e}");
}

#[test]
fn unsupported_config_values_name_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(unet_fixture().join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["down_block_types"][0] = "SimpleCrossAttnDownBlock2D".into();
    let p = tmp.path().join("config.json");
    std::fs::write(&p, v.to_string()).unwrap();
    let e = err_of(UNetConfig::from_file(&p));
    assert!(e.contains("down_block_types") && e.contains("SimpleCrossAttnDownBlock2D"), "{e}");

    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["addition_embed_type"] = "text_time".into();
    std::fs::write(&p, v.to_string()).unwrap();
    let e = err_of(UNetConfig::from_file(&p));
    assert!(e.contains("addition_embed_type") && e.contains("not supported"), "{e}");

    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["_class_name"] = "UNet2DModel".into();
    std::fs::write(&p, v.to_string()).unwrap();
    assert!(err_of(UNetConfig::from_file(&p)).contains("UNet2DModel"));

    std::fs::write(&p, "{\"block_out_channels\": [32, 64,").unwrap();
    assert!(err_of(UNetConfig::from_file(&p)).contains("invalid JSON"));
}

/// Runs the sd1 UNet fixture from `dir` and compares with the reference.
fn check_unet_output(dir: &Path, variant: Option<&str>, tol: f64) {
    let io = Io::open(fixtures().join("parity/unet_sd1/io.safetensors"));
    let cfg = UNetConfig::from_file(&dir.join("config.json")).unwrap();
    let store = open_component(dir, variant).unwrap();
    let unet = UNet2DConditionModel::load(&store, &cfg, &Device::Cpu, DType::F32).unwrap();
    let ts: Vec<f32> = io.f32("in.timestep").to_vec1().unwrap();
    let out = unet.forward(&io.f32("in.sample"), &ts, &io.f32("in.encoder_hidden_states"), None).unwrap();
    assert_close("unet", &out, &io.f32("out.sample"), tol);
}

#[test]
fn sharded_index_loads_the_same_model() {
    let (tmp, t) = editable_unet();
    let half = t.len() / 2;
    let mut map = serde_json::Map::new();
    for (i, chunk) in [&t[..half], &t[half..]].iter().enumerate() {
        let name = format!("diffusion_pytorch_model-0000{}-of-00002.safetensors", i + 1);
        write_safetensors(&tmp.path().join(&name), chunk, &BTreeMap::new()).unwrap();
        for (k, ..) in chunk.iter() {
            map.insert(k.clone(), name.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(tmp.path().join("diffusion_pytorch_model.safetensors.index.json"), index.to_string()).unwrap();
    check_unet_output(tmp.path(), None, 1e-4);
}

#[test]
fn fp16_variant_is_found_and_upcast() {
    let (tmp, t) = editable_unet();
    let f16: Vec<_> = t
        .into_iter()
        .map(|(k, _, s, b)| {
            let h: Vec<u8> = b
                .chunks_exact(4)
                .flat_map(|c| half::f16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes())
                .collect();
            (k, StoredDType::F16, s, h)
        })
        .collect();
    write_safetensors(&tmp.path().join("diffusion_pytorch_model.fp16.safetensors"), &f16, &BTreeMap::new()).unwrap();
    // Asked for explicitly, and found on its own when it is the only file.
    check_unet_output(tmp.path(), Some("fp16"), 2e-2);
    check_unet_output(tmp.path(), None, 2e-2);
    let e = err_of(open_component(tmp.path(), Some("bf16")).map(|_| ()));
    assert!(e.contains("bf16") || e.contains("not found"), "{e}");
}

#[test]
fn mismatched_components_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixtures().join("parity/pipeline_sd1/model");
    copy_dir(&src, tmp.path());
    // A text encoder wider than the UNet's cross-attention.
    let te_cfg = tmp.path().join("text_encoder/config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&te_cfg).unwrap()).unwrap();
    v["hidden_size"] = 16.into();
    std::fs::write(&te_cfg, v.to_string()).unwrap();
    let e = err_of(SdModel::open(tmp.path(), &OpenOptions::default()));
    assert!(e.contains("cross_attention_dim") && e.contains("hidden_size"), "{e}");
}

#[test]
fn not_a_model_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let e = err_of(SdModel::open(tmp.path(), &OpenOptions::default()));
    assert!(e.contains("model_index.json"), "{e}");
    let e = err_of(SdModel::open(&tmp.path().join("nope"), &OpenOptions::default()));
    assert!(e.contains("not found"), "{e}");
}

fn copy_dir(src: &Path, dst: &Path) {
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        let to = dst.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            std::fs::create_dir_all(&to).unwrap();
            copy_dir(&entry.path(), &to);
        } else {
            std::fs::copy(entry.path(), &to).unwrap();
        }
    }
}
