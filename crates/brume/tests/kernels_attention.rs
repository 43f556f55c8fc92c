//! The fused attention kernel against candle's plain path, on every instruction
//! set this CPU runs, over many shapes: odd sizes, key tails, query tails, heads,
//! batch, head sizes of the real models, strided and broadcast inputs, causal
//! masks, and scores large enough that a naive softmax would overflow.

use brume::kernels::flash_attention::flash_attention_on;
use brume::kernels::Isa;
use brume::layers::{attention_reference, AttentionMask};
use brume::samplers::Rng;
use candle_core::{Device, Tensor};

/// max |fast - reference| / max |reference|.
fn rel_err(got: &Tensor, want: &Tensor) -> f32 {
    let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    diff / scale.max(f32::MIN_POSITIVE)
}

struct Case {
    b: usize,
    h: usize,
    nq: usize,
    nk: usize,
    d: usize,
    causal: bool,
    /// Multiplies the queries: large values make large, peaked scores.
    q_gain: f64,
}

/// A case's q, k, v from `seed`, with the softmax scale and mask: queries and values
/// laid out as the models make them ([b, n, h, d] viewed as [b, h, n, d]).
fn inputs(c: &Case, seed: u64) -> (Tensor, Tensor, Tensor, f64, AttentionMask) {
    let dev = Device::Cpu;
    let mut rng = Rng::new(seed);
    let q = (rng.randn(&[c.b, c.nq, c.h, c.d], &dev).unwrap() * c.q_gain).unwrap().transpose(1, 2).unwrap();
    let k = rng.randn(&[c.b, c.h, c.nk, c.d], &dev).unwrap();
    let v = rng.randn(&[c.b, c.nk, c.h, c.d], &dev).unwrap().transpose(1, 2).unwrap();
    let mask = if c.causal { AttentionMask::Causal } else { AttentionMask::None };
    (q, k, v, (c.d as f64).powf(-0.5), mask)
}

fn check(c: &Case, seed: u64) {
    let (q, k, v, scale, mask) = inputs(c, seed);
    let want = attention_reference(&q, &k, &v, scale, mask).unwrap();
    // Scores are rounded to f32 in both paths before the exponential, so their
    // outputs legitimately differ by about eps * |score| relative: 1e-5 holds for
    // ordinary scores (|s| < ~40), and the bound widens only for huge ones.
    let max_score = (q.contiguous().unwrap().matmul(&k.t().unwrap()).unwrap() * scale)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let tol = 1e-5f32.max(4.0 * f32::EPSILON * max_score);
    for isa in Isa::all_supported() {
        let got = flash_attention_on(isa, &q, &k, &v, scale, c.causal).unwrap();
        assert_eq!(got.dims(), want.dims());
        let err = rel_err(&got, &want);
        assert!(
            err <= tol,
            "{}: b{} h{} nq{} nk{} d{} causal {} gain {}: rel err {err:.2e} > {tol:.2e}",
            isa.name(),
            c.b,
            c.h,
            c.nq,
            c.nk,
            c.d,
            c.causal,
            c.q_gain
        );
    }
}

/// From 1024 queries on, strided keys and values are copied head by head before
/// the kernel runs (`flash_attention::packs_keys`): the same results, keys strided
/// too, with key and query tails, causal or not.
#[test]
fn long_query_runs_with_strided_keys_and_values() {
    let dev = Device::Cpu;
    for (i, &(nq, nk, d, causal)) in [(1024, 300, 40, false), (1030, 77, 24, false), (1100, 1100, 16, true)].iter().enumerate() {
        let mut rng = Rng::new(400 + i as u64);
        let h = 3;
        let q = rng.randn(&[1, nq, h, d], &dev).unwrap().transpose(1, 2).unwrap();
        let k = rng.randn(&[1, nk, h, d], &dev).unwrap().transpose(1, 2).unwrap();
        let v = rng.randn(&[1, nk, h, d], &dev).unwrap().transpose(1, 2).unwrap();
        let scale = (d as f64).powf(-0.5);
        let mask = if causal { AttentionMask::Causal } else { AttentionMask::None };
        let want = attention_reference(&q, &k, &v, scale, mask).unwrap();
        for isa in Isa::all_supported() {
            let got = flash_attention_on(isa, &q, &k, &v, scale, causal).unwrap();
            // The same kernel on contiguous copies made here: the copy changes no sum.
            let plain = flash_attention_on(isa, &q, &k.contiguous().unwrap(), &v.contiguous().unwrap(), scale, causal).unwrap();
            let same = (&got - &plain).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(same, 0.0, "{}: nq {nq} nk {nk} d {d}: copied keys changed the output", isa.name());
            let err = rel_err(&got, &want);
            assert!(err <= 1e-5, "{}: nq {nq} nk {nk} d {d} causal {causal}: rel err {err:.2e}", isa.name());
        }
    }
}

fn case(b: usize, h: usize, nq: usize, nk: usize, d: usize) -> Case {
    Case { b, h, nq, nk, d, causal: false, q_gain: 1.0 }
}

#[test]
fn self_attention_many_shapes() {
    let shapes = [
        (1, 1, 1, 1, 1),
        (1, 1, 1, 1, 40),
        (2, 3, 17, 17, 7),
        (1, 8, 64, 64, 40),
        (1, 8, 65, 65, 40),
        (2, 5, 127, 127, 64),
        (1, 2, 129, 129, 80),
        (1, 1, 300, 300, 160),
        (3, 1, 33, 33, 3),
        (1, 4, 256, 256, 13),
    ];
    for (i, &(b, h, nq, nk, d)) in shapes.iter().enumerate() {
        check(&case(b, h, nq, nk, d), i as u64);
    }
}

#[test]
fn cross_attention_key_tails() {
    let shapes = [
        (1, 8, 256, 77, 40),
        (2, 8, 100, 77, 80),
        (1, 5, 70, 1, 64),
        (2, 2, 31, 129, 160),
        (1, 3, 17, 255, 9),
        (1, 1, 64, 513, 40),
    ];
    for (i, &(b, h, nq, nk, d)) in shapes.iter().enumerate() {
        check(&case(b, h, nq, nk, d), 100 + i as u64);
    }
}

#[test]
fn causal_masks_across_tiles() {
    for (i, &(b, h, n, d)) in [(2, 12, 77, 64), (1, 2, 200, 40), (1, 1, 1, 8), (1, 3, 129, 33)].iter().enumerate() {
        check(&Case { causal: true, ..case(b, h, n, n, d) }, 200 + i as u64);
    }
}

#[test]
fn large_scores_stay_finite_and_exact() {
    // Scores of several hundred: exp overflows without the running maximum.
    check(&Case { q_gain: 40.0, ..case(1, 2, 100, 300, 40) }, 300);
    check(&Case { q_gain: 40.0, causal: true, ..case(1, 1, 150, 150, 16) }, 301);
}

#[test]
fn broadcast_and_offset_views() {
    let dev = Device::Cpu;
    let mut rng = Rng::new(400);
    // Keys shared across the batch (stride 0) and views that start mid-buffer.
    let q = rng.randn(&[2, 4, 50, 24], &dev).unwrap();
    let kv = rng.randn(&[1, 4, 90, 24], &dev).unwrap();
    let k = kv.narrow(2, 3, 80).unwrap().broadcast_as((2, 4, 80, 24)).unwrap();
    let v = kv.narrow(2, 10, 80).unwrap().broadcast_as((2, 4, 80, 24)).unwrap();
    let want = attention_reference(&q, &k, &v, 0.2, AttentionMask::None).unwrap();
    for isa in Isa::all_supported() {
        let got = flash_attention_on(isa, &q, &k, &v, 0.2, false).unwrap();
        assert!(rel_err(&got, &want) <= 1e-5, "{}", isa.name());
    }
}

#[test]
fn mismatched_shapes_are_errors() {
    let dev = Device::Cpu;
    let q = Tensor::zeros((1, 2, 5, 8), candle_core::DType::F32, &dev).unwrap();
    let k = Tensor::zeros((1, 2, 6, 8), candle_core::DType::F32, &dev).unwrap();
    let v = Tensor::zeros((1, 2, 7, 8), candle_core::DType::F32, &dev).unwrap();
    assert!(flash_attention_on(Isa::Portable, &q, &k, &v, 1.0, false).is_err());
    let kd = Tensor::zeros((1, 2, 6, 4), candle_core::DType::F32, &dev).unwrap();
    assert!(flash_attention_on(Isa::Portable, &q, &kd, &kd, 1.0, false).is_err());
}

/// AMX tiles: both products in bf16 (q, k and v rounded, the probabilities split
/// into two bf16 halves), f32 softmax and sums. Against the reference on the same
/// rounded q, k, v, what is left is q's rounding after the softmax scale is folded
/// in and the order of the sums; against f32, bf16's error.
#[test]
fn amx_attention_matches_within_bf16_rounding() {
    if !brume::kernels::amx::supported() {
        eprintln!("no AMX on this CPU (or BRUME_AMX=off): AMX attention not run");
        return;
    }
    matches_within_bf16_rounding(brume::kernels::attention_amx::attention_amx);
}

/// AVX512-BF16 dot products (CPUs without AMX): q, k, v and the probabilities
/// rounded (one bf16 each, where the AMX kernel splits P in two), held to the same bounds.
#[test]
fn avx512_bf16_attention_matches_within_bf16_rounding() {
    if !brume::kernels::conv3x3_bf16::supported() || brume::kernels::amx::supported() {
        eprintln!("no AVX512-BF16 on this CPU, or AMX (where the tile kernel runs instead): not run");
        return;
    }
    matches_within_bf16_rounding(brume::kernels::attention_bf16::attention_bf16);
}

type AttentionFn = fn(&Tensor, &Tensor, &Tensor, f64, bool) -> candle_core::Result<Tensor>;

fn matches_within_bf16_rounding(kernel: AttentionFn) {
    let round = |t: &Tensor| t.to_dtype(candle_core::DType::BF16).unwrap().to_dtype(candle_core::DType::F32).unwrap();
    let cases = [
        case(1, 1, 1, 1, 1),
        case(2, 3, 17, 17, 7),
        case(1, 8, 65, 65, 40),
        case(1, 2, 129, 129, 80),
        case(2, 8, 100, 77, 40),
        case(1, 1, 300, 300, 160),
        case(1, 1, 64, 513, 33),
        Case { causal: true, ..case(2, 12, 77, 77, 64) },
        Case { causal: true, ..case(1, 3, 129, 129, 33) },
        Case { q_gain: 40.0, ..case(1, 2, 100, 300, 40) },
    ];
    for (i, c) in cases.iter().enumerate() {
        let (q, k, v, scale, mask) = inputs(c, 400 + i as u64);
        let got = kernel(&q, &k, &v, scale, c.causal).unwrap();
        let rounded = attention_reference(&round(&q), &round(&k), &round(&v), scale, mask).unwrap();
        let full = attention_reference(&q, &k, &v, scale, mask).unwrap();
        assert_eq!(got.dims(), full.dims());
        let what = format!("b{} h{} nq{} nk{} d{} causal {} gain {}", c.b, c.h, c.nq, c.nk, c.d, c.causal, c.q_gain);
        // Peaked scores (gain 40, scores of several hundred) turn bf16's rounding of q
        // (scaled first here) into whole units of score, so the softmax may pick a
        // neighbouring key: the bound there is loose, but the output must stay finite
        // and a convex combination of v's rows.
        let peaked = c.q_gain > 1.0;
        let e = rel_err(&got, &rounded);
        assert!(e <= if peaked { 0.15 } else { 1e-2 }, "{what}: {e:.2e} vs the rounded reference");
        let e = rel_err(&got, &full);
        assert!(e.is_finite() && e <= if peaked { 0.2 } else { 2e-2 }, "{what}: {e:.2e} vs f32");
        let vmax = round(&v).abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        let gmax = got.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(gmax <= vmax * 1.01, "{what}: |out| {gmax} beyond max |v| {vmax}");
    }
}
