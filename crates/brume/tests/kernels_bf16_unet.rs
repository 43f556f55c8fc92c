//! A whole UNet under `--compute bf16`, on AMX tiles where the CPU has them, else on
//! AVX512-BF16 vectors: in-place f32 weights are rounded and packed for the kernel on
//! first use and kept, so the second step must give exactly the first step's answer,
//! and both stay within bf16's error of diffusers' f32 output. Its own binary,
//! because the compute switch is process-wide.

mod common;

use brume::kernels::{set_compute, Compute};
use common::rel_err;

#[test]
fn bf16_unet_matches_diffusers_and_reuses_its_packed_weights() {
    if !brume::kernels::conv3x3_bf16::supported() {
        eprintln!("no AVX512-BF16 on this CPU: bf16 UNet not run");
        return;
    }
    let kernel = if brume::kernels::amx::supported() { "AMX" } else { "AVX512-BF16" };
    let (unet, io) = common::unet_fixture("unet_sd1");
    let run = || common::unet_forward(&unet, &io);
    let f32_out = run();
    set_compute(Compute::Bf16).unwrap();
    let first = run();
    let second = run();
    set_compute(Compute::F32).unwrap();
    let want = io.f32("out.sample");
    let flat = |t: &candle_core::Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(flat(&first), flat(&second), "{kernel}: the cached packed weights changed the answer");
    let e = rel_err(&first, &want);
    assert!(e > 1e-6 && e <= 3e-2, "bf16 on {kernel} vs diffusers f32: {e:.2e}");
    assert!(rel_err(&f32_out, &want) <= 1e-4, "f32 after bf16 must be unchanged");
}
