//! The fused GEGLU against candle's `a * gelu_erf(gate)` on every instruction set
//! this CPU runs, with row widths around the vector lengths and large |x| (where
//! erf saturates) and tiny ones (where gelu is ~x / 2).

use brume::kernels::geglu::geglu_on;
use brume::kernels::Isa;
use brume::samplers::Rng;
use candle_core::{Device, Tensor};

#[test]
fn geglu_matches_candle_on_every_path() {
    let dev = Device::Cpu;
    let mut rng = Rng::new(21);
    for &(rows, n, gain) in &[(1, 1, 1.0), (3, 7, 1.0), (5, 16, 3.0), (4, 33, 10.0), (2, 1280, 1.0), (77, 40, 1e-3), (9, 100, 6.0)] {
        let h = (rng.randn(&[rows, 2 * n], &dev).unwrap() * gain).unwrap();
        let want = (h.narrow(1, 0, n).unwrap() * h.narrow(1, n, n).unwrap().gelu_erf().unwrap()).unwrap();
        for isa in Isa::all_supported() {
            let got = geglu_on(isa, &h).unwrap();
            assert_eq!(got.dims(), want.dims());
            let diff = (&got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            // Absolute error against the larger of 1 and the output's size: erf's 1.5e-7
            // (times |x| / 2), f32 rounding at the scale of the values.
            let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1.0);
            assert!(diff / scale <= 1e-6, "{} {rows}x{n} gain {gain}: err {:.2e}", isa.name(), diff / scale);
        }
    }
    // Three-dimensional input (batch, tokens, 2n), as the transformer blocks give it.
    let h = rng.randn(&[2, 5, 8], &dev).unwrap();
    let got = geglu_on(Isa::Portable, &h).unwrap();
    assert_eq!(got.dims(), &[2, 5, 4]);
    assert!(geglu_on(Isa::Portable, &Tensor::zeros((2, 3), candle_core::DType::F32, &dev).unwrap()).is_err(), "odd width must be refused");
}

/// GELU and QuickGELU as one vector pass, against candle's ops, on every path: lengths
/// around the vector width and past a task's chunk, large |x| (saturated), tiny x,
/// and a transposed (strided) view.
#[test]
fn gelu_and_quick_gelu_match_candle_on_every_path() {
    use brume::kernels::gelu::{activation_on, Kind};
    let dev = Device::Cpu;
    let mut rng = Rng::new(22);
    for &(len, gain) in &[(1usize, 1.0), (15, 1.0), (16, 3.0), (33, 10.0), (77 * 3072, 1.0), (65537, 6.0), (40, 1e-3)] {
        let x = (rng.randn(&[len], &dev).unwrap() * gain).unwrap();
        for (kind, want) in [
            (Kind::Gelu, x.gelu_erf().unwrap()),
            (Kind::QuickGelu, (&x * candle_nn::ops::sigmoid(&(&x * 1.702).unwrap()).unwrap()).unwrap()),
        ] {
            for isa in Isa::all_supported() {
                let got = activation_on(isa, &x, kind).unwrap();
                let diff = (&got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1.0);
                assert!(diff / scale <= 1e-6, "{kind:?} {} len {len} gain {gain}: err {:.2e}", isa.name(), diff / scale);
            }
        }
    }
    let m = rng.randn(&[5, 7], &dev).unwrap().t().unwrap();
    let got = activation_on(Isa::Portable, &m, Kind::Gelu).unwrap();
    let diff = (&got - &m.gelu_erf().unwrap()).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(got.dims(), &[7, 5]);
    assert!(diff <= 1e-6, "strided input: {diff:.2e}");
}
