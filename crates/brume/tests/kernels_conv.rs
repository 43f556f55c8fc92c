//! The direct 3x3 convolution kernel against candle's conv2d, on every instruction
//! set this CPU runs: channel counts that are and are not multiples of the 6-channel
//! register block, widths with and without vector tails (down to 1 pixel), batches,
//! and the layer path (`Conv2d` over mapped f32 weights) that dispatches to it. The
//! shapes cover both of the kernel's layouts: rows of whole vector blocks, and the
//! flat layout of narrow or odd-width maps (SD's 16x16 and 8x8 levels). Winograd
//! F(4x4, 3x3) (the layers' default on large maps) and the older F(2x2, 3x3) are held
//! to the same checks.

use brume::kernels::conv3x3::conv3x3_on;
use brume::kernels::Isa;
use brume::samplers::Rng;
use candle_core::{Device, Tensor};

/// The kernel mode and compute precision are process-wide: tests that switch them
/// take this lock so they do not switch each other's.
static GLOBAL_SWITCHES: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn rel_err(got: &Tensor, want: &Tensor) -> f32 {
    let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    diff / scale.max(f32::MIN_POSITIVE)
}

#[test]
fn conv3x3_many_shapes() {
    let shapes = &[
        (1, 1, 1, 1, 1),
        (1, 3, 5, 4, 7),
        (2, 4, 6, 8, 8),
        (1, 16, 16, 16, 16),
        (1, 7, 13, 9, 17),
        (2, 5, 7, 3, 33),
        (1, 32, 12, 12, 40),
        (1, 64, 19, 5, 64),
        (1, 9, 4, 31, 2),
        (2, 70, 13, 8, 8),
        (1, 40, 12, 4, 4),
        (2, 37, 7, 16, 16),
        (1, 5, 6, 3, 72),
        // The flat layout's blocking: several 32-channel panels with a short last
        // one, several 48-channel output chunks with a short last one, and more
        // position blocks than one task takes (3 images of 16x16).
        (2, 75, 100, 8, 8),
        (3, 33, 9, 16, 16),
        // Rows of whole 4-vector blocks (AVX-512 at widths of 64), one and two per row.
        (1, 7, 13, 3, 128),
        (2, 12, 6, 4, 64),
    ];
    check_conv3x3(conv3x3_on, shapes, 11, 2e-6);
}

/// The unfold + GEMM route AVX2 takes for maps of at most 8x8 positions, on every
/// instruction set: maps of one position, odd sides, SD's 8x8 with several images.
#[test]
fn conv3x3_gemm_route_many_shapes() {
    use brume::kernels::conv3x3::conv3x3_gemm_on;
    let shapes = &[(1, 1, 1, 1, 1), (1, 3, 5, 4, 7), (2, 70, 13, 8, 8), (3, 9, 4, 1, 5), (1, 200, 130, 4, 4), (2, 33, 7, 7, 9)];
    check_conv3x3(conv3x3_gemm_on, shapes, 14, 2e-6);
}

/// `conv` on every instruction set this CPU runs against candle's conv2d (padding 1)
/// on random inputs of `shapes` (batch, in, out, h, w), within `tol` relative.
fn check_conv3x3(conv: impl Fn(Isa, &Tensor, &Tensor) -> candle_core::Result<Tensor>, shapes: &[(usize, usize, usize, usize, usize)], seed: u64, tol: f32) {
    let dev = Device::Cpu;
    let mut rng = Rng::new(seed);
    for &(b, c, o, h, w) in shapes {
        let x = rng.randn(&[b, c, h, w], &dev).unwrap();
        let k = rng.randn(&[o, c, 3, 3], &dev).unwrap();
        let want = x.conv2d(&k, 1, 1, 1, 1).unwrap();
        for isa in Isa::all_supported() {
            let got = conv(isa, &x, &k).unwrap();
            assert_eq!(got.dims(), want.dims());
            let err = rel_err(&got, &want);
            assert!(err <= tol, "{} {:?}: rel err {err:.2e}", isa.name(), (b, c, o, h, w));
        }
    }
}

/// Shapes for both Winograd transforms: odd and even sides (partial tiles on the right
/// and bottom edges), single-pixel maps, channel counts off the GEMM's blocks, batches.
const WINOGRAD_SHAPES: &[(usize, usize, usize, usize, usize)] = &[
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
    (1, 6, 7, 10, 14),
];

/// Winograd F(4x4, 3x3) one strip of tiles at a time, on [`WINOGRAD_SHAPES`] and on
/// maps several strips wide (a partial last strip, partial tiles at the edges, the
/// tiny VAE's 64 channels), against candle's conv.
#[test]
fn winograd43_strips_many_shapes() {
    check_conv3x3(brume::kernels::winograd43_strips::conv3x3_on, WINOGRAD_SHAPES, 37, 1e-5);
    check_conv3x3(brume::kernels::winograd43_strips::conv3x3_on, &[(1, 64, 64, 40, 136), (2, 33, 35, 18, 70), (1, 64, 3, 64, 64)], 41, 2e-5);
}

/// Winograd F(2x2, 3x3) on [`WINOGRAD_SHAPES`].
#[test]
fn winograd_many_shapes() {
    // The transforms add up to 16 terms in f32 each way: a few ulps more than the direct sum.
    check_conv3x3(brume::kernels::winograd::conv3x3_on, WINOGRAD_SHAPES, 23, 1e-5);
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
    let want = conv3x3_on(isa, &x, &k).unwrap();
    let got = brume::kernels::winograd::conv3x3_on(isa, &x, &k).unwrap();
    let err = rel_err(&got, &want);
    assert!(err <= 1e-5, "rel err {err:.2e}");
}

/// The layers follow the Winograd mode: by default (`auto`) F(4x4, 3x3) on a large
/// map with many channels and the direct kernel on a small one; `off` the direct
/// kernel everywhere; `f2` the older F(2x2, 3x3) where its size rules allow. Each is
/// checked to be that kernel's result to the bit, and all within 1e-5 of candle's conv.
#[test]
fn layer_path_follows_the_winograd_mode() {
    use brume::kernels::winograd::{set_mode, Mode};
    use brume::kernels::{winograd, winograd43};
    use brume::layers::mapped::conv2d_dense;
    let _switches = GLOBAL_SWITCHES.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::Cpu;
    let mut rng = Rng::new(31);
    let isa = brume::kernels::isa();
    // 256 -> 256 at 64x64 takes F(4x4) under auto; 40 -> 36 at 20x20 is too small for it.
    let big = (rng.randn(&[1, 256, 64, 64], &dev).unwrap(), (rng.randn(&[256, 256, 3, 3], &dev).unwrap() * 0.05).unwrap());
    let small = (rng.randn(&[2, 40, 20, 20], &dev).unwrap(), rng.randn(&[36, 40, 3, 3], &dev).unwrap());
    let layer = |mode: Mode, (x, k): &(Tensor, Tensor)| {
        set_mode(mode);
        let y = conv2d_dense(x, k, 1, 1, true);
        set_mode(Mode::Auto);
        y.unwrap()
    };
    for (x, k) in [&big, &small] {
        let want = x.conv2d(k, 1, 1, 1, 1).unwrap();
        for mode in [Mode::Auto, Mode::Off, Mode::F2] {
            let err = rel_err(&layer(mode, &(x.clone(), k.clone())), &want);
            assert!(err <= 5e-5, "{mode:?} {:?}: rel err {err:.2e}", x.dims());
        }
    }
    let same = |a: &Tensor, b: &Tensor| rel_err(a, b) == 0.0;
    assert!(same(&layer(Mode::Auto, &big), &winograd43::conv3x3_on(isa, &big.0, &big.1).unwrap()));
    assert!(same(&layer(Mode::Off, &big), &conv3x3_on(isa, &big.0, &big.1).unwrap()));
    assert!(same(&layer(Mode::F2, &big), &winograd::conv3x3_on(isa, &big.0, &big.1).unwrap()));
    assert!(same(&layer(Mode::Auto, &small), &conv3x3_on(isa, &small.0, &small.1).unwrap()));
    assert!(same(&layer(Mode::F2, &small), &winograd::conv3x3_on(isa, &small.0, &small.1).unwrap()));
    // and the kernels do differ, so the checks above can tell them apart
    assert!(!same(&winograd43::conv3x3_on(isa, &big.0, &big.1).unwrap(), &conv3x3_on(isa, &big.0, &big.1).unwrap()));
}

/// F(4x4, 3x3) on SD 1.5's first-level shape (320 channels at 64x64) and on a kernel
/// large enough that U is made a transform row at a time (640 channels: 9.4 MiB per
/// row, 16 MiB held at most), against the direct kernel: within 5e-5 of the largest
/// output (measured 1.3e-5 at 256 channels, 2.9e-5 at 640; the direct kernel is ~3e-6
/// from candle's).
#[test]
fn winograd43_on_sd_shapes_matches_the_direct_kernel() {
    let dev = Device::Cpu;
    let mut rng = Rng::new(8);
    let isa = brume::kernels::isa();
    for (b, c, o, h, w) in [(1, 320, 320, 64, 64), (2, 640, 640, 32, 32)] {
        let x = rng.randn(&[b, c, h, w], &dev).unwrap();
        let k = (rng.randn(&[o, c, 3, 3], &dev).unwrap() * (1.0 / (9.0 * c as f64).sqrt())).unwrap();
        let want = conv3x3_on(isa, &x, &k).unwrap();
        let got = brume::kernels::winograd43::conv3x3_on(isa, &x, &k).unwrap();
        let err = rel_err(&got, &want);
        assert!(err <= 5e-5, "{:?}: rel err {err:.2e}", (b, c, o, h, w));
    }
}

#[test]
fn narrow_maps_take_the_flat_layout_and_whole_blocks_the_row_one() {
    use brume::kernels::conv3x3::scratch_bytes;
    // Every vector width brume runs (8 or 16 lanes, blocks of 2 vectors) divides 64.
    assert_eq!(scratch_bytes(2, 320, 64, 64), 0);
    // 8 and 10 pixels wide are narrower than any block: a zero-bordered copy of the
    // input: at least the planes with a zero row above and below (AVX-512's dense
    // layout; elsewhere a zero column each side too), and at most the bordered planes,
    // one block (32) and the last block's two farthest taps more per plane.
    let (b, c, h, w) = (2, 1280, 8, 10);
    let bytes = scratch_bytes(b, c, h, w);
    let rows = b * c * (h + 2) * w * 4;
    let padded = b * c * (h + 2) * (w + 2) * 4;
    assert!(bytes >= rows && bytes <= padded + b * c * (32 + 2) * 4, "{bytes} bytes for {padded} padded");
    // A copy past its cap (16 MiB) falls back to the row layout.
    assert_eq!(scratch_bytes(2, 4096, 100, 100), 0);
}

#[test]
fn conv3x3_rejects_mismatched_kernels() {
    let dev = Device::Cpu;
    let x = Tensor::zeros((1, 4, 8, 8), candle_core::DType::F32, &dev).unwrap();
    let wrong_in = Tensor::zeros((2, 3, 3, 3), candle_core::DType::F32, &dev).unwrap();
    let wrong_k = Tensor::zeros((2, 4, 1, 1), candle_core::DType::F32, &dev).unwrap();
    for isa in Isa::all_supported() {
        for conv in [conv3x3_on, brume::kernels::winograd::conv3x3_on, brume::kernels::winograd43::conv3x3_on] {
            assert!(conv(isa, &x, &wrong_in).is_err());
            assert!(conv(isa, &x, &wrong_k).is_err());
        }
    }
}

#[test]
fn layer_dispatch_matches_plain_conv_in_both_modes() {
    use brume::kernels::{set_mode, KernelMode};
    use brume::layers::mapped::conv2d_dense;
    let _switches = GLOBAL_SWITCHES.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::Cpu;
    let mut rng = Rng::new(12);
    // 20x20 and, on AVX2, the GEMM route's 8x8.
    for (b, hw) in [(1, 20), (2, 8)] {
        let x = rng.randn(&[b, 24, hw, hw], &dev).unwrap();
        let k = rng.randn(&[30, 24, 3, 3], &dev).unwrap();
        let want = x.conv2d(&k, 1, 1, 1, 1).unwrap();
        // Fast mode runs the direct kernel, reference mode the im2col + GEMM path.
        for mode in [KernelMode::Fast, KernelMode::Reference] {
            set_mode(mode);
            let got = conv2d_dense(&x, &k, 1, 1, true).unwrap();
            set_mode(KernelMode::Fast);
            assert!(rel_err(&got, &want) <= 2e-6, "{mode:?} {hw}x{hw}");
        }
    }
}

/// Tails of every kind, short products (m <= 192: narrow blocks, k in chunks of 128 for
/// k = 801; on AVX2 the weight-rows path, also up to 256 rows narrower than the weight)
/// and long ones (k in chunks past 1280 for k = 1500), and tasks that walk several
/// 48-row chunks against several column strips.
#[test]
fn linear_kernel_many_shapes() {
    use brume::kernels::matmul::linear_on;
    let dev = Device::Cpu;
    let mut rng = Rng::new(13);
    for &(m, k, n) in &[(1, 1, 1), (1, 320, 1280), (5, 7, 3), (6, 16, 16), (77, 64, 64), (130, 96, 257), (49, 33, 40), (300, 320, 33), (100, 801, 70), (100, 300, 801), (600, 320, 70), (200, 1500, 70), (250, 300, 801), (77, 768, 3072), (154, 3072, 768), (256, 1280, 1300), (300, 100, 301), (256, 64, 600), (257, 64, 600)] {
        let a = rng.randn(&[m, k], &dev).unwrap();
        let w = rng.randn(&[n, k], &dev).unwrap();
        let want = a.matmul(&w.t().unwrap()).unwrap();
        for isa in Isa::all_supported() {
            let got = linear_on(isa, &a, &w).unwrap();
            assert_eq!(got.dims(), want.dims());
            let err = rel_err(&got, &want);
            // One sequential sum per output: its rounding grows with the depth k.
            let tol = 2e-6 * (k as f32 / 1000.0).max(1.0).sqrt();
            assert!(err <= tol, "{} {:?}: rel err {err:.2e}", isa.name(), (m, k, n));
        }
    }
}

/// A row's product does not depend on how many rows came with it, on either side of the
/// short-product line (m <= 192: narrow blocks, 16 KiB strips; above: wide blocks, 320
/// KiB strips): a guided batch and its branches one at a time must give the same
/// picture, bit for bit.
#[test]
fn linear_kernel_rows_do_not_depend_on_the_batch() {
    use brume::kernels::matmul::linear_on;
    let dev = Device::Cpu;
    let mut rng = Rng::new(14);
    for &(k, n) in &[(768, 3072), (3072, 768), (320, 100), (1500, 257)] {
        let a = rng.randn(&[400, k], &dev).unwrap();
        let w = rng.randn(&[n, k], &dev).unwrap();
        for isa in Isa::all_supported() {
            let all = linear_on(isa, &a, &w).unwrap();
            for m in [1, 77, 154, 193, 300] {
                let part = linear_on(isa, &a.narrow(0, 0, m).unwrap(), &w).unwrap();
                let want = all.narrow(0, 0, m).unwrap();
                let diff = (part - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert_eq!(diff, 0.0, "{} k {k} n {n}: the first {m} of 400 rows differ by {diff:e}", isa.name());
            }
        }
    }
}

/// candle's f32 tensor rounded to bf16 and back: the factors the bf16 kernels multiply.
fn round_bf16(t: &Tensor) -> Tensor {
    t.to_dtype(candle_core::DType::BF16).unwrap().to_dtype(candle_core::DType::F32).unwrap()
}

/// A bf16-product 3x3 conv against candle's f32 conv of the bf16-rounded factors (the
/// only difference left is the order of the sums) and against the f32 conv itself.
fn check_rounded_conv(conv: impl Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>, shapes: &[(usize, usize, usize, usize, usize)], seed: u64) {
    let dev = Device::Cpu;
    let mut rng = Rng::new(seed);
    for &(b, c, o, h, w) in shapes {
        let x = rng.randn(&[b, c, h, w], &dev).unwrap();
        let k = rng.randn(&[o, c, 3, 3], &dev).unwrap();
        let got = conv(&x, &k).unwrap();
        let want = round_bf16(&x).conv2d(&round_bf16(&k), 1, 1, 1, 1).unwrap();
        let err = rel_err(&got, &want);
        assert!(err <= 1e-5, "{:?}: rel err {err:.2e} vs the rounded f32 conv", (b, c, o, h, w));
        // And against the f32 conv itself: bf16's rounding of both factors.
        let full = x.conv2d(&k, 1, 1, 1, 1).unwrap();
        assert!(rel_err(&got, &full) <= 2e-2, "{:?}", (b, c, o, h, w));
    }
}

/// A bf16-product `a w^T` against candle's product of the rounded factors and the f32 one.
fn check_rounded_linear(linear: impl Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>, shapes: &[(usize, usize, usize)], seed: u64) {
    let dev = Device::Cpu;
    let mut rng = Rng::new(seed);
    for &(m, k, n) in shapes {
        let a = rng.randn(&[m, k], &dev).unwrap();
        let w = rng.randn(&[n, k], &dev).unwrap();
        let got = linear(&a, &w).unwrap();
        let want = round_bf16(&a).matmul(&round_bf16(&w).t().unwrap()).unwrap();
        let err = rel_err(&got, &want);
        assert!(err <= 1e-5, "{:?}: rel err {err:.2e} vs the rounded f32 product", (m, k, n));
        assert!(rel_err(&got, &a.matmul(&w.t().unwrap()).unwrap()) <= 2e-2, "{:?}", (m, k, n));
    }
}

/// bf16 products, f32 sums (`vdpbf16ps`).
#[test]
fn conv3x3_bf16_matches_the_rounded_f32_conv() {
    use brume::kernels::conv3x3_bf16::{conv3x3_bf16, supported};
    if !supported() {
        eprintln!("no AVX512-BF16 on this CPU: bf16 conv not run");
        return;
    }
    let shapes = [
        (1, 1, 1, 1, 1),
        (1, 3, 5, 4, 7),
        (2, 4, 6, 8, 8),
        (1, 7, 13, 9, 17),
        (2, 5, 7, 3, 33),
        (1, 64, 19, 5, 64),
        (1, 32, 12, 12, 40),
        (2, 71, 13, 8, 8),
        (2, 36, 7, 16, 16),
        (1, 5, 6, 3, 72),
        // The flat (narrow-map) path's blocking: several 32-pair channel panels with a
        // short last one (150, 66 and odd 65 input channels), several 48-channel
        // output chunks with a short last one (100 outputs), and more position blocks
        // than one task takes (3 images of 16x16: 27 blocks of 32).
        (2, 150, 100, 8, 8),
        (3, 66, 9, 16, 16),
        (1, 65, 50, 5, 20),
    ];
    check_rounded_conv(conv3x3_bf16, &shapes, 14);
}

#[test]
fn linear_bf16_matches_the_rounded_f32_product() {
    use brume::kernels::conv3x3_bf16::supported;
    use brume::kernels::matmul_bf16::linear_bf16;
    if !supported() {
        eprintln!("no AVX512-BF16 on this CPU: bf16 GEMM not run");
        return;
    }
    // k odd, in one panel and split evenly over several (801 values: 3 panels of
    // ~134 pairs), n with and without vector tails, m under a block, and tasks that
    // walk several 48-row chunks against several column strips (m 100, n 801); past
    // 192 rows the 4-vector block, in one panel of k and in three (k 2600).
    let shapes = [(1, 1, 1), (5, 7, 3), (6, 16, 16), (77, 64, 64), (130, 301, 257), (49, 33, 40), (300, 320, 33), (13, 640, 96), (100, 801, 70), (61, 390, 97), (100, 70, 801), (100, 801, 801), (250, 2600, 131)];
    check_rounded_linear(linear_bf16, &shapes, 15);
}

/// The forms the layers keep under `--compute bf16` without AMX: a linear weight
/// rounded once into column strips (k past one 384-value panel, so a strip spans
/// several of the task's K steps), a 1x1 kernel rounded once into pair rows, and a
/// 3x3 kernel rounded once into its channel-pair table.
#[test]
fn prepacked_bf16_weights_match_the_rounded_f32_products() {
    use brume::kernels::conv3x3_bf16::supported;
    use brume::kernels::matmul_bf16::{conv1x1_bf16_prepacked, linear_bf16_prepacked};
    if !supported() {
        eprintln!("no AVX512-BF16 on this CPU: packed bf16 weights not run");
        return;
    }
    let shapes = [(1, 1, 1), (5, 7, 3), (6, 16, 16), (77, 64, 64), (130, 301, 257), (49, 33, 40), (300, 320, 33), (13, 640, 96), (7, 1281, 70), (100, 801, 70), (100, 801, 801), (250, 2600, 131)];
    check_rounded_linear(linear_bf16_prepacked, &shapes, 20);
    check_rounded_linear(|a, w| conv1x1_bf16_prepacked(a, &w.t()?.contiguous()?), &shapes, 21);
}

#[test]
fn layers_follow_the_compute_precision() {
    use brume::kernels::conv3x3_bf16::supported;
    use brume::kernels::{set_compute, Compute};
    use brume::layers::mapped::conv2d_dense;
    let _switches = GLOBAL_SWITCHES.lock().unwrap_or_else(|e| e.into_inner());
    if !supported() {
        assert!(set_compute(Compute::Bf16).is_err(), "bf16 must be refused without AVX512-BF16");
        return;
    }
    let dev = Device::Cpu;
    let mut rng = Rng::new(16);
    let x = rng.randn(&[1, 16, 12, 12], &dev).unwrap();
    for (k, p) in [(3, 1), (1, 0)] {
        let w = rng.randn(&[8, 16, k, k], &dev).unwrap();
        let f32_out = conv2d_dense(&x, &w, 1, p, true).unwrap();
        set_compute(Compute::Bf16).unwrap();
        let bf16_out = conv2d_dense(&x, &w, 1, p, true);
        set_compute(Compute::F32).unwrap();
        let e = rel_err(&bf16_out.unwrap(), &f32_out);
        // Rounded factors: visibly different from f32, still within bf16's error.
        assert!(e > 1e-6 && e <= 2e-2, "{k}x{k}: {e:.2e}");
    }
}

/// AMX tiles: the same rounded factors as the AVX512-BF16 kernels, so against
/// candle's f32 conv of the rounded factors only the order of the sums differs.
/// Shapes cover K, M and N tails (channels not a multiple of 32, odd widths, 8x8
/// maps), SD's 320-channel level and a batch of two.
#[test]
fn conv3x3_amx_matches_the_rounded_f32_conv() {
    use brume::kernels::amx::{conv3x3_amx, supported};
    if !supported() {
        eprintln!("no AMX on this CPU (or BRUME_AMX=off): AMX conv not run");
        return;
    }
    let shapes = [(1, 1, 1, 1, 1), (1, 3, 5, 4, 7), (2, 32, 32, 8, 8), (1, 33, 40, 9, 17), (2, 64, 19, 16, 16), (1, 96, 64, 5, 64), (2, 71, 33, 8, 8), (1, 320, 320, 24, 24)];
    check_rounded_conv(conv3x3_amx, &shapes, 17);
}

#[test]
fn gemm_amx_matches_the_rounded_f32_product() {
    use brume::kernels::amx::{conv1x1_amx, linear_amx, supported};
    if !supported() {
        eprintln!("no AMX on this CPU (or BRUME_AMX=off): AMX GEMM not run");
        return;
    }
    // Every tail: m, n, k below, at and past a 32 block; k odd; SD's 320 -> 1280 width.
    let shapes = [(1, 1, 1), (5, 7, 3), (32, 32, 32), (77, 64, 64), (130, 301, 257), (49, 33, 40), (300, 320, 33), (64, 320, 1280)];
    check_rounded_linear(linear_amx, &shapes, 18);
    // The [k, n] layout of B (a 1x1 conv's activations): a [m, k] x x [k, n], as a linear of x^T.
    check_rounded_linear(|a, w| conv1x1_amx(a, &w.t()?.contiguous()?), &shapes, 19);
}

/// Empty products on AMX: no rows, no columns, or k = 0 (a zero output), never a panic.
#[test]
fn gemm_amx_takes_empty_factors() {
    use brume::kernels::amx::{linear_amx, supported};
    if !supported() {
        eprintln!("no AMX on this CPU (or BRUME_AMX=off): AMX GEMM not run");
        return;
    }
    let dev = Device::Cpu;
    for &(m, k, n) in &[(0, 4, 3), (3, 4, 0), (3, 0, 5)] {
        let a = Tensor::zeros((m, k), candle_core::DType::F32, &dev).unwrap();
        let w = Tensor::ones((n, k), candle_core::DType::F32, &dev).unwrap();
        let got = linear_amx(&a, &w).unwrap();
        assert_eq!(got.dims(), &[m, n]);
        assert!(got.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().all(|&v| v == 0.0));
    }
}

/// Winograd F(4x4, 3x3) on [`WINOGRAD_SHAPES`] (sides that are and are not multiples
/// of 4); SD's own shapes are in `winograd43_on_sd_shapes_matches_the_direct_kernel`.
#[test]
fn winograd43_many_shapes() {
    check_conv3x3(brume::kernels::winograd43::conv3x3_on, WINOGRAD_SHAPES, 29, 1e-5);
}

/// Winograd F(2x2, 3x3) with bf16 products (`kernels::winograd_bf16`). Its transforms
/// are rounded, not the factors, so no rounded f32 conv reproduces it. Two checks instead:
/// (1) on values whose transforms bf16 holds exactly (inputs in {-2, ..., 2}, weights in
/// quarters of {-4, ..., 4}) it must equal candle's f32 conv up to the order of the sums,
/// over odd sizes, odd channel counts (a zero high half in the last pair), tile counts
/// that end strips short, and batches: this pins the layout, the transforms and the
/// borders; (2) on random values at the channel counts the layers give it (>= 256), its
/// error against the f32 conv stays within 1e-2 and 3x the direct bf16 kernel's (float64
/// emulation gives ~1.6x; with a handful of channels the transforms' cancellations are
/// not averaged out, which is why the layers never take it there). The layers' packed
/// transform gives the same values, to the bit, as the per-call one.
#[test]
fn winograd_bf16_is_exact_on_exact_values_and_near_the_direct_bf16_error() {
    use brume::kernels::conv3x3_bf16::{conv3x3_bf16, supported};
    use brume::kernels::winograd_bf16::{conv3x3_winograd_bf16, conv3x3_winograd_bf16_packed, PackedWinogradPairs};
    if !supported() {
        eprintln!("no AVX512-BF16 on this CPU: bf16 Winograd not run");
        return;
    }
    let dev = Device::Cpu;
    let mut rng = Rng::new(31);
    let steps = |t: Tensor, half_range: f64, step: f64| ((t * half_range).unwrap().round().unwrap().clamp(-half_range, half_range).unwrap() * step).unwrap();
    for (b, c, o, h, w) in [(1, 1, 1, 1, 1), (1, 3, 5, 4, 7), (2, 7, 13, 9, 17), (1, 65, 33, 5, 20), (2, 64, 48, 16, 16), (1, 12, 80, 32, 31)] {
        let x = steps(rng.randn(&[b, c, h, w], &dev).unwrap(), 2.0, 1.0);
        let k = steps(rng.randn(&[o, c, 3, 3], &dev).unwrap(), 4.0, 0.25);
        let err = rel_err(&conv3x3_winograd_bf16(&x, &k).unwrap(), &x.conv2d(&k, 1, 1, 1, 1).unwrap());
        assert!(err <= 1e-5, "{:?}: winograd bf16 err {err:.2e} on exact values", (b, c, o, h, w));
    }
    for (b, c, o, h, w) in [(1, 256, 256, 16, 16), (2, 320, 260, 17, 32)] {
        let x = rng.randn(&[b, c, h, w], &dev).unwrap();
        let k = (rng.randn(&[o, c, 3, 3], &dev).unwrap() * (1.0 / (9.0 * c as f64).sqrt())).unwrap();
        let full = x.conv2d(&k, 1, 1, 1, 1).unwrap();
        let got = conv3x3_winograd_bf16(&x, &k).unwrap();
        let (err, direct) = (rel_err(&got, &full), rel_err(&conv3x3_bf16(&x, &k).unwrap(), &full));
        let shape = (b, c, o, h, w);
        assert!(err <= 1e-2 && err <= 3.0 * direct, "{shape:?}: winograd bf16 err {err:.2e}, direct bf16 {direct:.2e}");
        let ws = k.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let packed = conv3x3_winograd_bf16_packed(&x, &PackedWinogradPairs::new(&ws, o, c).unwrap()).unwrap();
        assert_eq!(packed.flatten_all().unwrap().to_vec1::<f32>().unwrap(), got.flatten_all().unwrap().to_vec1::<f32>().unwrap(), "{shape:?}");
    }
}
