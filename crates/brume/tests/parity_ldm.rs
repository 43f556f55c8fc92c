//! LDM single-file checkpoints: mapped at load time onto our modules, they give
//! what diffusers computes after its own `from_single_file` conversion.

mod common;

use brume::pipelines::{OpenOptions, SdModel};
use candle_core::{DType, Device};
use common::{assert_close, fixtures, Io};

fn ldm_case(name: &str) {
    let dir = fixtures().join("ldm").join(name);
    let io = Io::open(dir.join("io.safetensors"));
    let opts = OpenOptions {
        config_dir: Some(dir.join("config")),
        ..Default::default()
    };
    let model = SdModel::open(&dir.join("model.safetensors"), &opts).unwrap();
    let dev = Device::Cpu;
    let te = model.text_encoder(&dev, DType::F32).unwrap();
    let out = te.forward(&io.ids("in.input_ids"), 0).unwrap();
    assert_close(&format!("{name} text"), &out.hidden, &io.f32("out.text_hidden"), 1e-4);
    let unet = model.unet(&dev, DType::F32).unwrap();
    let ts: Vec<f32> = io.f32("in.timestep").to_vec1().unwrap();
    let pred = unet.forward(&io.f32("in.sample"), &ts, &io.f32("in.encoder_hidden_states"), None).unwrap();
    assert_close(&format!("{name} unet"), &pred, &io.f32("out.unet"), 1e-4);
    let enc = model.vae_encoder(&dev, DType::F32).unwrap();
    let dist = enc.encode(&io.f32("in.image")).unwrap();
    assert_close(&format!("{name} vae mean"), &dist.mean, &io.f32("out.vae_mean"), 1e-4);
    assert_close(&format!("{name} vae logvar"), &dist.logvar, &io.f32("out.vae_logvar"), 1e-4);
    let dec = model.vae_decoder(&dev, DType::F32).unwrap();
    assert_close(&format!("{name} vae decode"), &dec.decode(&io.f32("in.latents")).unwrap(), &io.f32("out.vae_decoded"), 1e-4);
}

#[test]
fn ldm_sd1_single_file() {
    ldm_case("sd1_tiny");
}

#[test]
fn ldm_sd2_single_file_fused_qkv() {
    ldm_case("sd2_tiny");
}

#[test]
fn non_ldm_safetensors_is_refused_with_advice() {
    let p = fixtures().join("parity/unet_sd1/model/diffusion_pytorch_model.safetensors");
    let err = SdModel::open(&p, &OpenOptions::default()).err().expect("must fail").to_string();
    assert!(err.contains("not an LDM single-file checkpoint"), "{err}");
    assert!(err.contains("diffusion_pytorch_model.safetensors"), "{err}");
}
