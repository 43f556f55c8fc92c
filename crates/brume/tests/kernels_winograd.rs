//! The Winograd F(2x2, 3x3) convolution against candle's conv2d on every instruction
//! set this CPU runs: odd and even sides (partial 2x2 tiles on the right and bottom
//! edges), single-pixel maps, channel counts off the GEMM's blocks, batches, and a
//! layer whose input is transformed in several chunks of tile rows. Then the layer
//! path with `BRUME_WINOGRAD=on`: a `Conv2d` on a map Winograd takes must match candle too.

use brume::kernels::winograd::conv3x3_on;
use brume::kernels::Isa;
use brume::samplers::Rng;
use candle_core::{Device, Tensor};

fn rel_err(got: &Tensor, want: &Tensor) -> f32 {
    let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    diff / scale.max(f32::MIN_POSITIVE)
}

#[test]
fn winograd_matches_candle_on_many_shapes() {
    let dev = Device::Cpu;
    let mut rng = Rng::new(23);
    for &(b, c, o, h, w) in &[
        (1, 1, 1, 1, 1),
        (1, 2, 3, 1, 2),
        (1, 3, 5, 4, 7),
        (2, 4, 6, 5, 5),
        (1, 7, 13, 9, 17),
        (1, 32, 32, 16, 16),
        (2, 33, 40, 17, 18),
        (1, 64, 19, 5, 64),
        (1, 9, 4, 31, 2),
        (3, 16, 70, 12, 11),
    ] {
        let x = rng.randn(&[b, c, h, w], &dev).unwrap();
        let k = rng.randn(&[o, c, 3, 3], &dev).unwrap();
        let want = x.conv2d(&k, 1, 1, 1, 1).unwrap();
        for isa in Isa::all_supported() {
            let got = conv3x3_on(isa, &x, &k).unwrap();
            assert_eq!(got.dims(), want.dims());
            let err = rel_err(&got, &want);
            // The transforms add up to 16 terms in f32 each way: a few ulps more than the direct sum.
            assert!(err <= 1e-5, "{} {:?}: rel err {err:.2e}", isa.name(), (b, c, o, h, w));
        }
    }
}

#[test]
fn winograd_in_chunks_matches_the_direct_kernel() {
    // 256 + 256 channels over 64x64: one tile row of transformed input and products is
    // 1 MiB, so a 16 MiB chunk takes 16 of the 32 tile rows and the image runs in two.
    let dev = Device::Cpu;
    let mut rng = Rng::new(5);
    let (b, c, o, h, w) = (2, 256, 256, 64, 64);
    let x = rng.randn(&[b, c, h, w], &dev).unwrap();
    let k = (rng.randn(&[o, c, 3, 3], &dev).unwrap() * 0.05).unwrap();
    let isa = brume::kernels::isa();
    let want = brume::kernels::conv3x3::conv3x3_on(isa, &x, &k).unwrap();
    let got = conv3x3_on(isa, &x, &k).unwrap();
    let err = rel_err(&got, &want);
    assert!(err <= 1e-5, "rel err {err:.2e}");
}

#[test]
fn winograd_rejects_mismatched_kernels() {
    let dev = Device::Cpu;
    let x = Tensor::zeros((1, 4, 8, 8), candle_core::DType::F32, &dev).unwrap();
    let wrong_in = Tensor::zeros((2, 3, 3, 3), candle_core::DType::F32, &dev).unwrap();
    let wrong_k = Tensor::zeros((2, 4, 1, 1), candle_core::DType::F32, &dev).unwrap();
    for k in [wrong_in, wrong_k] {
        let err = conv3x3_on(brume::kernels::isa(), &x, &k).unwrap_err().to_string();
        assert!(err.contains("does not fit"), "{err}");
    }
}

#[test]
fn layer_path_takes_winograd_on_large_maps() {
    use brume::layers::mapped::conv2d_dense;
    let dev = Device::Cpu;
    let mut rng = Rng::new(31);
    // Opt-in (no other test in this binary goes through the layers).
    brume::kernels::winograd::set_enabled(true);
    // 40 -> 36 channels at 20x20: wide and large enough for Winograd (f32 compute, the default).
    let x = rng.randn(&[2, 40, 20, 20], &dev).unwrap();
    let k = rng.randn(&[36, 40, 3, 3], &dev).unwrap();
    let want = x.conv2d(&k, 1, 1, 1, 1).unwrap();
    let got = conv2d_dense(&x, &k, 1, 1, true).unwrap();
    let err = rel_err(&got, &want);
    assert!(err <= 1e-5, "rel err {err:.2e}");
    // and it is Winograd's result, not the direct kernel's (their sums round differently)
    let winograd = conv3x3_on(brume::kernels::isa(), &x, &k).unwrap();
    assert_eq!(rel_err(&got, &winograd), 0.0);
}
