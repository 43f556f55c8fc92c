//! Every component against diffusers / transformers on the committed fixtures
//! (tools/parity/make_fixtures.py): max |diff| / max |ref| <= 1e-4 in f32.

mod common;

use brume::loading::diffusers::open_component;
use brume::models::{
    AutoencoderKLConfig, AutoencoderTinyConfig, ClipTextConfig, ClipTextModel, TinyDecoder, TinyEncoder, VaeDecoder,
    VaeEncoder,
};
use candle_core::{DType, Device};
use common::{assert_close, fixtures, Io};

const TOL: f64 = 1e-4;

fn clip_case(case: &str) {
    let dir = fixtures().join("parity").join(case);
    let io = Io::open(dir.join("io.safetensors"));
    let model_dir = dir.join("model");
    let cfg = ClipTextConfig::from_file(&model_dir.join("config.json")).unwrap();
    let store = open_component(&model_dir, None).unwrap();
    let model = ClipTextModel::load(&store, &cfg, &Device::Cpu, DType::F32).unwrap();
    let ids = io.ids("in.input_ids");
    let out = model.forward(&ids, 0).unwrap();
    assert_close(&format!("{case} last_hidden_state"), &out.hidden, &io.f32("out.last_hidden_state"), TOL);
    assert_close(&format!("{case} pooler_output"), &out.pooled, &io.f32("out.pooler_output"), TOL);
    let skip = model.forward(&ids, 1).unwrap();
    assert_close(&format!("{case} penultimate (clip skip 1)"), &skip.hidden, &io.f32("out.penultimate"), TOL);
}

#[test]
fn clip_sd1_quick_gelu() {
    clip_case("clip_sd1");
}

#[test]
fn clip_sd2_gelu() {
    clip_case("clip_sd2");
}

fn unet_case(case: &str) {
    let (unet, io) = common::unet_fixture(case);
    assert_close(case, &common::unet_forward(&unet, &io), &io.f32("out.sample"), TOL);
}

#[test]
fn unet_sd1() {
    unet_case("unet_sd1");
}

#[test]
fn unet_sd2_linear_projection_per_block_heads_odd_size() {
    unet_case("unet_sd2");
}

#[test]
fn unet_inpainting_9_channels() {
    unet_case("unet_inpaint");
}

#[test]
fn unet_lcm_time_cond_proj() {
    unet_case("unet_lcm");
}

#[test]
fn unet_sdxs_no_mid_block_only_cross_attention() {
    unet_case("unet_sdxs");
}

#[test]
fn unet_plain_mid_block() {
    unet_case("unet_midplain");
}

#[test]
fn autoencoder_kl_encoder_and_decoder() {
    let dir = fixtures().join("parity").join("vae_kl");
    let io = Io::open(dir.join("io.safetensors"));
    let model_dir = dir.join("model");
    let cfg = AutoencoderKLConfig::from_file(&model_dir.join("config.json")).unwrap();
    let store = open_component(&model_dir, None).unwrap();
    let enc = VaeEncoder::load(&store, &cfg, &Device::Cpu, DType::F32).unwrap();
    let dist = enc.encode(&io.f32("in.image")).unwrap();
    assert_close("vae mean", &dist.mean, &io.f32("out.mean"), TOL);
    assert_close("vae logvar", &dist.logvar, &io.f32("out.logvar"), TOL);
    drop(enc);
    let dec = VaeDecoder::load(&store, &cfg, &Device::Cpu, DType::F32).unwrap();
    assert_close("vae decoded", &dec.decode(&io.f32("in.latents")).unwrap(), &io.f32("out.decoded"), TOL);
}

#[test]
fn autoencoder_tiny_encoder_and_decoder() {
    let dir = fixtures().join("parity").join("vae_tiny");
    let io = Io::open(dir.join("io.safetensors"));
    let model_dir = dir.join("model");
    let cfg = AutoencoderTinyConfig::from_file(&model_dir.join("config.json")).unwrap();
    let store = open_component(&model_dir, None).unwrap();
    let enc = TinyEncoder::load(&store, &cfg, &Device::Cpu, DType::F32).unwrap();
    assert_close("taesd latents", &enc.encode(&io.f32("in.image")).unwrap(), &io.f32("out.latents"), TOL);
    let dec = TinyDecoder::load(&store, &cfg, &Device::Cpu, DType::F32).unwrap();
    assert_close("taesd decoded", &dec.decode(&io.f32("in.latents")).unwrap(), &io.f32("out.decoded"), TOL);
}
