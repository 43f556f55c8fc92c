//! The fused group norm (+ SiLU) kernel against the plain candle path, on every
//! instruction set this CPU runs: many channel/group splits, spatial sizes with
//! vector tails, batches, and inputs whose mean is large against their spread.

use brume::kernels::group_norm::group_norm_on;
use brume::kernels::Isa;
use brume::layers::{Activation, GroupNorm};
use brume::samplers::Rng;
use candle_core::{Device, Tensor};

fn rel_err(got: &Tensor, want: &Tensor) -> f32 {
    let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    diff / scale.max(f32::MIN_POSITIVE)
}

/// `shape` is [batch, channels, ...]; the input is `randn * gain + offset`.
fn check(shape: &[usize], groups: usize, gain: f64, offset: f64, seed: u64) {
    let dev = Device::Cpu;
    let mut rng = Rng::new(seed);
    let c = shape[1];
    let x = rng.randn(shape, &dev).unwrap().affine(gain, offset).unwrap();
    let w = rng.randn(&[c], &dev).unwrap();
    let b = rng.randn(&[c], &dev).unwrap();
    let eps = 1e-5;
    let gn = GroupNorm::from_tensors(w.clone(), b.clone(), groups, eps).unwrap();
    let plain = gn.forward_reference(&x).unwrap();
    let plain_silu = Activation::Silu.forward(&plain).unwrap();
    for isa in Isa::all_supported() {
        for (silu, want) in [(false, &plain), (true, &plain_silu)] {
            let got = group_norm_on(isa, &x, &w, &b, groups, eps, silu).unwrap();
            assert_eq!(got.dims(), want.dims());
            let err = rel_err(&got, want);
            assert!(err <= 1e-5, "{} {shape:?} groups {groups} silu {silu} offset {offset}: rel err {err:.2e}", isa.name());
        }
    }
}

#[test]
fn group_norm_many_shapes() {
    let cases: [(&[usize], usize); 9] = [
        (&[1, 320, 64, 64], 32),
        (&[2, 64, 7, 5], 32),
        (&[1, 6, 3, 3], 3),
        (&[3, 4, 1, 1], 2),
        (&[1, 32, 17], 32),
        (&[2, 12, 9, 11], 4),
        (&[1, 640, 8, 8], 32),
        (&[1, 1, 33, 1], 1),
        (&[2, 128, 13, 16], 32),
    ];
    for (i, (shape, groups)) in cases.iter().enumerate() {
        check(shape, *groups, 1.0, 0.0, i as u64);
    }
}

#[test]
fn group_norm_offset_and_scaled_inputs() {
    // A mean 50x the spread: a one-pass E[x^2] - E[x]^2 would lose digits here.
    check(&[2, 64, 16, 16], 32, 1.0, 50.0, 10);
    check(&[1, 32, 9, 7], 8, 300.0, 0.0, 12);
}

/// Group norm in f64, the truth both f32 paths approximate.
fn group_norm_f64(x: &[f32], c: usize, groups: usize, w: &[f32], b: &[f32], eps: f64) -> Vec<f64> {
    let hw = x.len() / c;
    let span = c / groups * hw;
    let mut out = vec![0.0; x.len()];
    for g in 0..groups {
        let xs: Vec<f64> = x[g * span..(g + 1) * span].iter().map(|&v| v as f64).collect();
        let mean = xs.iter().sum::<f64>() / span as f64;
        let var = xs.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / span as f64;
        for (i, v) in xs.iter().enumerate() {
            let ch = g * (c / groups) + i / hw;
            out[g * span + i] = (v - mean) / (var + eps).sqrt() * w[ch] as f64 + b[ch] as f64;
        }
    }
    out
}

#[test]
fn group_norm_ill_conditioned_is_as_exact_as_plain() {
    // Mean 2000x the spread: both f32 paths lose digits in the mean, by different
    // summation orders, so they are compared with the f64 truth instead.
    let dev = Device::Cpu;
    let mut rng = Rng::new(11);
    let (c, groups, eps) = (32, 8, 1e-5);
    let x = rng.randn(&[1, c, 9, 7], &dev).unwrap().affine(1e-3, -2.0).unwrap();
    let w = rng.randn(&[c], &dev).unwrap();
    let b = rng.randn(&[c], &dev).unwrap();
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let truth = group_norm_f64(&flat(&x), c, groups, &flat(&w), &flat(&b), eps);
    let err = |t: &Tensor| {
        let got = flat(t);
        let scale = truth.iter().fold(0f64, |m, v| m.max(v.abs()));
        got.iter().zip(&truth).fold(0f64, |m, (&g, &t)| m.max((g as f64 - t).abs())) / scale
    };
    let plain = err(&GroupNorm::from_tensors(w.clone(), b.clone(), groups, eps).unwrap().forward_reference(&x).unwrap());
    for isa in Isa::all_supported() {
        let fast = err(&group_norm_on(isa, &x, &w, &b, groups, eps, false).unwrap());
        assert!(fast <= 2.0 * plain + 1e-6, "{}: error vs f64 {fast:.2e}, plain path's {plain:.2e}", isa.name());
    }
}

#[test]
fn group_norm_bad_groups_are_errors() {
    let dev = Device::Cpu;
    let x = Tensor::zeros((1, 6, 2, 2), candle_core::DType::F32, &dev).unwrap();
    let w = Tensor::ones(6, candle_core::DType::F32, &dev).unwrap();
    assert!(group_norm_on(Isa::Portable, &x, &w, &w, 4, 1e-5, false).is_err());
    let w5 = Tensor::ones(5, candle_core::DType::F32, &dev).unwrap();
    assert!(group_norm_on(Isa::Portable, &x, &w5, &w5, 1, 1e-5, false).is_err());
    assert!(GroupNorm::from_tensors(w.clone(), w5, 3, 1e-5).is_err());
}
