//! A whole UNet under `--compute bf16` on AMX tiles: in-place f32 weights are packed
//! for the tiles on first use and kept, so the second step must give exactly the
//! first step's answer, and both stay within bf16's error of diffusers' f32 output.
//! Its own binary, because the compute switch is process-wide.

mod common;

use brume::kernels::{set_compute, Compute};
use common::rel_err;

#[test]
fn unet_on_amx_tiles_matches_diffusers_and_reuses_its_packed_weights() {
    if !brume::kernels::amx::supported() {
        eprintln!("no AMX on this CPU (or BRUME_AMX=off): AMX UNet not run");
        return;
    }
    let (unet, io) = common::unet_fixture("unet_sd1");
    let run = || common::unet_forward(&unet, &io);
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
