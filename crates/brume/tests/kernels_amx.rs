//! A whole UNet under `--compute bf16` on AMX tiles: in-place f32 weights are packed
//! for the tiles on first use and kept, so the second step must give exactly the
//! first step's answer, and both stay within bf16's error of diffusers' f32 output.
//! Its own binary, because the compute switch is process-wide.

mod common;

use brume::kernels::{set_compute, Compute};
use brume::loading::diffusers::open_component;
use brume::models::{UNet2DConditionModel, UNetConfig};
use candle_core::{DType, Device};
use common::{fixtures, rel_err, Io};

#[test]
fn unet_on_amx_tiles_matches_diffusers_and_reuses_its_packed_weights() {
    if !brume::kernels::amx::supported() {
        eprintln!("no AMX on this CPU (or BRUME_AMX=off): AMX UNet not run");
        return;
    }
    let dir = fixtures().join("parity").join("unet_sd1");
    let io = Io::open(dir.join("io.safetensors"));
    let model_dir = dir.join("model");
    let cfg = UNetConfig::from_file(&model_dir.join("config.json")).unwrap();
    let store = open_component(&model_dir, None).unwrap();
    let unet = UNet2DConditionModel::load(&store, &cfg, &Device::Cpu, DType::F32).unwrap();
    let ts: Vec<f32> = io.f32("in.timestep").to_vec1().unwrap();
    let run = || unet.forward(&io.f32("in.sample"), &ts, &io.f32("in.encoder_hidden_states"), None).unwrap();
    let f32_out = run();
    set_compute(Compute::Bf16).unwrap();
    let first = run();
    let second = run();
    set_compute(Compute::F32).unwrap();
    let want = io.f32("out.sample");
    let flat = |t: &candle_core::Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(flat(&first), flat(&second), "the cached packed weights changed the answer");
    let e = rel_err(&first, &want);
    assert!(e > 1e-6 && e <= 3e-2, "bf16 on AMX vs diffusers f32: {e:.2e}");
    assert!(rel_err(&f32_out, &want) <= 1e-4, "f32 after AMX must be unchanged");
}
