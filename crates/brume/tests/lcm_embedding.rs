//! The LCM w-embedding brume feeds distilled UNets equals diffusers'
//! `get_guidance_scale_embedding` (tools/samplers/make_lcm_embedding_fixture.py).

mod common;

use brume::models::embeddings::guidance_scale_embedding;
use candle_core::Device;
use common::{assert_close, fixtures, Io};

/// Tolerance: the embedding takes sin/cos of `1000 w * freq`, up to ~7000 rad,
/// where a one-ulp difference between torch's vectorised `exp` and the platform
/// `expf` in a frequency becomes ~5e-4 in the output. Narrow widths, where the
/// arguments stay small, agree to 1e-7.
#[test]
fn guidance_scale_embedding_matches_diffusers() {
    let io = Io::open(fixtures().join("lcm/guidance_embedding.safetensors"));
    let w: Vec<f32> = io.f32("in.w").to_vec1().unwrap();
    for dim in [16, 32, 256, 17] {
        let got = guidance_scale_embedding(&w, dim, &Device::Cpu).unwrap();
        let tol = if dim <= 32 { 1e-6 } else { 1e-3 };
        assert_close(&format!("w-embedding dim {dim}"), &got, &io.f32(&format!("out.dim{dim}")), tol);
    }
}
