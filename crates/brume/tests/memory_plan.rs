//! Memory strategies give the plain path's picture (tiling: nearly), the
//! planner takes the least lossy rung that fits and refuses cleanly when none
//! does, and a budget that shrinks mid-run leads to a fallback or a clean error.

use std::cell::Cell;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::rc::Rc;

use brume::memory::planner::{fixed, plan, rungs, with_headroom as room, ResolutionFallback};
use brume::memory::{
    estimate, AttentionMode, Branches, Guard, Kernels, ModelProfile, PrecisionVariant, ReducedOutput, RequestShape, Residency, RunSize, Strategy,
    TileSpec, VaeDecode,
};
use brume::pipelines::{txt2img, Flow, GenerationRequest, Generated, OpenOptions, RunOptions, SdModel};
use brume::runtime::budget::Budget;
use brume::samplers::{noise_source, RngKind};
use brume::RunError;
use candle_core::{DType, Tensor};

/// The built-in placeholder: the full SD architecture, narrow, so large sizes are quick.
fn model() -> SdModel {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/builtin"));
    SdModel::open(&dir, &OpenOptions::default()).unwrap()
}

fn request(size: usize) -> GenerationRequest {
    GenerationRequest { steps: 2, guidance_scale: 5.0, seed: 3, ..GenerationRequest::new("a red circle on the left", size) }
}

fn run(model: &SdModel, req: &GenerationRequest, opts: &RunOptions) -> Result<Generated, RunError> {
    let mut noise = noise_source(RngKind::Brume, req.seed);
    txt2img(model, req, opts, noise.as_mut(), None, &mut |_| Flow::Continue)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

fn mean_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().mean_all().unwrap().to_scalar::<f32>().unwrap()
}

fn with(strategy: Strategy) -> RunOptions {
    RunOptions { strategy, ..RunOptions::default() }
}

fn shape(size: usize) -> RequestShape {
    RequestShape { batch: 1, guided: true, width: size, height: size, encodes_image: false }
}

const SEQ: Strategy =
    Strategy { residency: Residency::Sequential, branches: Branches::Batched, attention: AttentionMode::Full, vae: VaeDecode::Full };
const SPLIT: Strategy = Strategy { branches: Branches::OneAtATime, ..SEQ };

#[test]
fn resident_sequential_and_chunked_give_the_same_picture() {
    let m = model();
    let req = request(128);
    let plain = run(&m, &req, &with(Strategy::PLAIN)).unwrap();
    let seq = run(&m, &req, &with(SEQ)).unwrap();
    assert_eq!(max_diff(&plain.image, &seq.image), 0.0, "sequential segments");
    // Chunked attention is <= 1e-6 per call (layers::attention's tests); through
    // two guided steps of a UNet and the VAE the difference stays far below one
    // 8-bit level (1/255 = 3.9e-3) of the written picture.
    for chunk in [7, 64, 255] {
        let s = Strategy { attention: AttentionMode::Chunked(NonZeroUsize::new(chunk).unwrap()), ..SEQ };
        let c = run(&m, &req, &with(s)).unwrap();
        let d = max_diff(&plain.latents, &c.latents).max(max_diff(&plain.image, &c.image));
        assert!(d <= 1e-4, "chunk {chunk}: max diff {d}");
    }
    // A chunk at least the query count is the full path, bit for bit.
    let big = Strategy { attention: AttentionMode::Chunked(NonZeroUsize::new(1 << 20).unwrap()), ..SEQ };
    assert_eq!(max_diff(&plain.image, &run(&m, &req, &with(big)).unwrap().image), 0.0);
}

#[test]
fn guidance_branches_one_at_a_time_give_the_same_picture_for_less() {
    let m = model();
    let req = request(128);
    let plain = run(&m, &req, &with(SEQ)).unwrap();
    let split = run(&m, &req, &with(SPLIT)).unwrap();
    // Each image's arithmetic does not depend on the batch it is in.
    let d = max_diff(&plain.latents, &split.latents);
    assert!(d <= 1e-5, "split guidance: latents differ by {d}");
    assert_eq!(max_diff(&plain.image, &split.image), 0.0, "split guidance changed the picture");
    // Without the conditioning cache too, and the batch of two images.
    let opts = RunOptions { reuse_kv: false, ..with(SPLIT) };
    let uncached = run(&m, &req, &opts).unwrap();
    assert!(max_diff(&plain.latents, &uncached.latents) <= 1e-5);
    let two = GenerationRequest { batch: 2, ..request(64) };
    let (a, b) = (run(&m, &two, &with(SEQ)).unwrap(), run(&m, &two, &with(SPLIT)).unwrap());
    assert!(max_diff(&a.latents, &b.latents) <= 1e-5);
    // The estimator halves the UNet batch; unguided requests gain nothing.
    let p = ModelProfile::of(&m, DType::F32);
    let s = shape(512);
    let (seq_unet, split_unet) = (estimate(&p, &s, &SEQ).unet.private_dirty, estimate(&p, &s, &SPLIT).unet.private_dirty);
    assert!(split_unet < seq_unet, "{split_unet} vs {seq_unet}");
    let unguided = RequestShape { guided: false, ..s };
    assert_eq!(estimate(&p, &unguided, &SEQ), estimate(&p, &unguided, &SPLIT));
    // The planner splits when the UNet phase is what does not fit...
    let budget = Budget::explicit((room(split_unet) + room(seq_unet)) / 2, "between");
    let chosen = plan(&p, &s, &budget, ResolutionFallback::Off, &[]).unwrap();
    assert_eq!(chosen.strategy.branches, Branches::OneAtATime, "{}", chosen.summary());
    assert!(chosen.summary().contains("guidance branches one at a time"), "{}", chosen.summary());
    // ...and not when the batched UNet fits and only decoding needs tiles.
    let seq = estimate(&p, &s, &SEQ);
    assert!(seq.decode.private_dirty > seq.unet.private_dirty, "at 512 px the full decode is the peak");
    let chosen = plan(&p, &s, &Budget::explicit(room(seq_unet), "decode-bound"), ResolutionFallback::Off, &[]).unwrap();
    assert!(matches!(chosen.strategy.vae, VaeDecode::Tiled(_)), "{}", chosen.summary());
    assert_eq!(chosen.strategy.branches, Branches::Batched, "{}", chosen.summary());
}

#[test]
fn tiled_decoding_is_close_and_exact_with_one_tile() {
    let m = model();
    let req = request(256);
    let plain = run(&m, &req, &with(SEQ)).unwrap();
    // One tile covering the latent is the plain decoder.
    let whole = Strategy { vae: VaeDecode::Tiled(TileSpec::new(32, 8).unwrap()), ..SEQ };
    assert_eq!(max_diff(&plain.image, &run(&m, &req, &with(whole)).unwrap().image), 0.0);
    let tiled = Strategy { vae: VaeDecode::Tiled(TileSpec::new(12, 4).unwrap()), ..SEQ };
    let t = run(&m, &req, &with(tiled)).unwrap();
    assert_eq!(t.image.dims(), plain.image.dims());
    let (mean, max) = (mean_diff(&plain.image, &t.image), max_diff(&plain.image, &t.image));
    // The VAE's mid block attends over the whole latent, and a tile sees only
    // itself, so tiles differ from the full decode, by how much depends on the
    // weights (mean 0.048 in [-1, 1] for one trained VAE, 0.006 for the next).
    // What the blend must do is beat hard seams: the same tiles without
    // overlap, pasted edge to edge (0.062 and 0.014 for those two).
    assert!(mean > 0.0, "tiling changed nothing: the test would not see a broken blend");
    let hard = Strategy { vae: VaeDecode::Tiled(TileSpec::new(12, 0).unwrap()), ..SEQ };
    let h = run(&m, &req, &with(hard)).unwrap();
    let hard_mean = mean_diff(&plain.image, &h.image);
    eprintln!("tiled vs full decode: blended mean {mean}, max {max}; hard seams mean {hard_mean}");
    assert!(mean < hard_mean, "blended tiles (mean diff {mean}) no closer than hard seams ({hard_mean})");
    assert!(mean < 0.08, "tiled vs full: mean {mean}, max {max}");
}

#[test]
fn planner_takes_the_least_lossy_rung_that_fits() {
    let m = model();
    // On the plain path, where chunked attention is a rung of its own.
    let p = ModelProfile::of(&m, DType::F32).with_kernels(Kernels::REFERENCE);
    let s = shape(512);
    let need = |st: Strategy| estimate(&p, &s, &st).peak.private_dirty;
    let plain = need(Strategy::PLAIN);
    let seq = need(SEQ);
    assert!(seq <= plain);
    let none: [PrecisionVariant; 0] = [];
    let roomy = plan(&p, &s, &Budget::explicit(room(plain), "roomy"), ResolutionFallback::Off, &none).unwrap();
    assert_eq!(roomy.strategy, Strategy::PLAIN);
    assert!(roomy.fallbacks().is_empty() && roomy.summary().contains("runs as asked") && !roomy.summary().contains("fallback"));
    // Just below the plain need: something cheaper, and it says which.
    let tight = plan(&p, &s, &Budget::explicit(room(plain) - 1, "tight"), ResolutionFallback::Off, &none).unwrap();
    assert_ne!(tight.strategy, Strategy::PLAIN);
    assert!(tight.estimate.peak.private_dirty < plain);
    assert!(!tight.fallbacks().is_empty());
    // Much tighter: guidance branches one at a time, chunked attention and tiles, still at 512.
    let chunk = Strategy { attention: AttentionMode::Chunked(NonZeroUsize::new(64).unwrap()), ..SPLIT };
    let tiles = Strategy { vae: VaeDecode::Tiled(TileSpec::new(16, 4).unwrap()), ..chunk };
    let floor = need(tiles);
    let small = plan(&p, &s, &Budget::explicit(room(floor) + (1 << 20), "small"), ResolutionFallback::Off, &none).unwrap();
    assert_eq!(small.size, RunSize::Requested);
    assert!(matches!(small.strategy.attention, AttentionMode::Chunked(_)), "{}", small.summary());
    // Below that: a lower resolution, reported as asked.
    let lower = plan(&p, &s, &Budget::explicit(room(floor) - (1 << 20), "lower"), ResolutionFallback::Report, &none).unwrap();
    assert!(matches!(lower.size, RunSize::Reduced { width: 448, height: 448, output: ReducedOutput::ReportedSmaller } | RunSize::Reduced { width: 384, height: 384, .. }), "{:?}", lower.size);
    assert!(lower.summary().contains("lower resolution"), "{}", lower.summary());
    // And nothing at all: a refusal naming the budget and the smallest need.
    let e = plan(&p, &s, &Budget::explicit(1 << 20, "1MiB"), ResolutionFallback::Upscale, &none).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, RunError::OverBudget { .. }), "{msg}");
    assert!(msg.contains("1.0 MiB") && msg.contains("--memory-budget 1MiB") && msg.contains("needs"), "{msg}");
    // A fixed plan that does not fit is refused too.
    assert!(fixed(&p, &s, &Budget::explicit(room(plain) - 1, "x"), Strategy::PLAIN).is_err());
}

#[test]
fn planner_uses_an_installed_lower_precision_variant_last() {
    let m = model();
    let p = ModelProfile::of(&m, DType::F32).with_kernels(Kernels::REFERENCE);
    let s = shape(512);
    // A stand-in variant whose weights are smaller: the same model in f16 compute
    // (weights materialised at 2 bytes; activations at 2 bytes).
    let small = ModelProfile::of(&m, DType::F16).with_kernels(Kernels::REFERENCE);
    let tiles = Strategy {
        attention: AttentionMode::Chunked(NonZeroUsize::new(64).unwrap()),
        vae: VaeDecode::Tiled(TileSpec::new(16, 4).unwrap()),
        ..SPLIT
    };
    let floor = estimate(&p, &s, &tiles).peak.private_dirty;
    let variant_floor = estimate(&small, &s, &tiles).peak.private_dirty;
    assert!(variant_floor < floor);
    let budget = Budget::explicit((room(floor) + room(variant_floor)) / 2, "between");
    let variants = [PrecisionVariant { label: "f16".into(), model: &small }];
    let chosen = plan(&p, &s, &budget, ResolutionFallback::Off, &variants).unwrap();
    assert_eq!(chosen.variant.as_ref().map(|(i, l)| (*i, l.as_str())), Some((0, "f16")));
    assert!(chosen.summary().contains("lower precision (f16)"), "{}", chosen.summary());
    // Without the variant the same budget is refused (resolution fallback off).
    assert!(plan(&p, &s, &budget, ResolutionFallback::Off, &[]).is_err());
}

#[test]
fn planner_keeps_rss_within_a_working_set_and_warns_when_it_cannot() {
    let m = model();
    let p = ModelProfile::of(&m, DType::F32).with_kernels(Kernels::REFERENCE);
    let s = shape(512);
    let rss = |prof: &ModelProfile, st: Strategy| estimate(prof, &s, &st).peak.rss;
    let roomy = estimate(&p, &s, &Strategy::PLAIN).peak.private_dirty * 2;
    let none: [PrecisionVariant; 0] = [];
    // Sequential segments hold one segment's mapped weights at a time, so a working
    // set just below the resident plan's RSS makes the planner drop to them,
    // though private memory alone would allow the plain path.
    let resident_rss = rss(&p, Strategy::PLAIN);
    assert!(rss(&p, SEQ) < resident_rss);
    let budget = Budget::explicit(roomy, "roomy").with_working_set(resident_rss - 1);
    let chosen = plan(&p, &s, &budget, ResolutionFallback::Off, &none).unwrap();
    assert_eq!(chosen.strategy.residency, Residency::Sequential, "{}", chosen.summary());
    assert!(chosen.over_working_set().is_none() && !chosen.summary().contains("warning"), "{}", chosen.summary());
    // A working set below every rung: a lower-precision variant whose RSS fits wins,
    // though the model itself fits in private memory...
    let floor = rungs(&p, &s, roomy).into_iter().map(|st| rss(&p, st)).min().unwrap();
    let small = ModelProfile::of(&m, DType::F16).with_kernels(Kernels::REFERENCE);
    let small_floor = rungs(&small, &s, roomy).into_iter().map(|st| rss(&small, st)).min().unwrap();
    assert!(small_floor < floor, "{small_floor} vs {floor}");
    let budget = Budget::explicit(roomy, "roomy").with_working_set(floor - 1);
    let variants = [PrecisionVariant { label: "f16".into(), model: &small }];
    let chosen = plan(&p, &s, &budget, ResolutionFallback::Off, &variants).unwrap();
    assert_eq!(chosen.variant.as_ref().map(|(_, l)| l.as_str()), Some("f16"), "{}", chosen.summary());
    // ...and without one the model runs, with a warning naming the working set.
    // (sequential segments, which page less and give the same picture).
    let chosen = plan(&p, &s, &budget, ResolutionFallback::Off, &none).unwrap();
    assert_eq!(chosen.strategy, SEQ, "{}", chosen.summary());
    assert_eq!(chosen.over_working_set(), Some(floor - 1));
    assert!(chosen.summary().contains("working set") && chosen.summary().contains("--precision-variant"), "{}", chosen.summary());
    // Device tiers carry their published working set.
    let a16 = Budget::resolve(Some("a16"), None).unwrap();
    assert_eq!(a16.working_set(), Some(1 << 30).map(|_| brume::runtime::budget::tier("a16").unwrap().working_set));
    assert_eq!(Budget::explicit(1 << 30, "1GiB").working_set(), None);
}

#[test]
fn a_budget_that_shrinks_mid_run_falls_back_then_refuses_cleanly() {
    let m = model();
    // 512 px: a 64x64 latent, where the plain path's score matrix (4096 x 4096 per
    // head and image) outweighs the UNet's other activations even with one head.
    let req = request(512);
    // Estimated as the plain path, so that chunking is a fallback the guard can
    // take; the run itself may use the fused kernel (same picture either way).
    let p = ModelProfile::of(&m, DType::F32).with_kernels(Kernels::REFERENCE);
    let s = shape(512);
    // Decoding tiled from the start, so that the UNet is what a shrinking budget squeezes.
    let start = Strategy { vae: VaeDecode::Tiled(TileSpec::new(16, 4).unwrap()), ..SEQ };
    // What the steps still ahead need under a strategy (the UNet and decoding).
    let ahead = |st: &Strategy| {
        let e = estimate(&p, &s, st);
        e.unet.private_dirty.max(e.decode.private_dirty)
    };
    let plain_need = ahead(&start);
    let split = Strategy { branches: Branches::OneAtATime, ..start };
    let split_need = ahead(&split);
    let chunked = Strategy { attention: AttentionMode::Chunked(NonZeroUsize::new(64).unwrap()), ..split };
    let chunked_need = ahead(&chunked);
    assert!(chunked_need < split_need && split_need < plain_need, "{chunked_need} < {split_need} < {plain_need}");
    let reference = run(&m, &req, &with(start)).unwrap();

    // The budget drops after the text encoder ran: first below the plain need
    // (the same picture with guidance branches one at a time), then also below
    // that (attention chunked as well).
    for (shrink, chunks) in [((room(plain_need) + room(split_need)) / 2, false), ((room(split_need) + room(chunked_need)) / 2, true)] {
        let calls = Rc::new(Cell::new(0usize));
        let c = calls.clone();
        let probe = Box::new(move || {
            c.set(c.get() + 1);
            Budget::explicit(if c.get() > 1 { shrink } else { plain_need * 2 }, "shrinking")
        });
        let guard = Rc::new(Guard::new(p.clone(), s, start, probe));
        let opts = RunOptions { strategy: start, guard: Some(guard.clone()), ..RunOptions::default() };
        let out = run(&m, &req, &opts).unwrap();
        assert_eq!(guard.strategy().branches, Branches::OneAtATime, "{:?}", guard.strategy());
        assert!(guard.notes().iter().any(|n| n.contains("guidance branches one at a time")), "{:?}", guard.notes());
        assert_eq!(matches!(guard.strategy().attention, AttentionMode::Chunked(_)), chunks, "{:?}", guard.strategy());
        assert_eq!(guard.notes().iter().any(|n| n.contains("chunked attention")), chunks, "{:?}", guard.notes());
        assert!(max_diff(&out.image, &reference.image) <= 1e-4, "the fallback changed the picture");
    }

    // Shrinking to almost nothing before step 2: a clean refusal naming the step.
    let c = Rc::new(Cell::new(0usize));
    let c2 = c.clone();
    let probe = Box::new(move || {
        c2.set(c2.get() + 1);
        Budget::explicit(if c2.get() > 3 { 1 << 20 } else { plain_need * 2 }, "vanishing")
    });
    let guard = Rc::new(Guard::new(p, s, SEQ, probe));
    let opts = RunOptions { strategy: SEQ, guard: Some(guard), ..RunOptions::default() };
    let e = run(&m, &req, &opts).err().expect("must refuse");
    let msg = e.to_string();
    assert!(matches!(e, RunError::OverBudget { .. }) && msg.contains("before step 2"), "{msg}");
}

#[test]
fn fused_kernels_need_less_and_leave_no_attention_rung() {
    let m = model();
    let reference = ModelProfile::of(&m, DType::F32).with_kernels(Kernels::REFERENCE);
    let fused = reference.clone().with_kernels(Kernels { fused_norm: true, fused_attention: true, direct_conv: true, bf16_attention: None, winograd: false, upsample_in_place: true, bf16_winograd: false });
    let s = shape(512);
    let (r, f) = (estimate(&reference, &s, &SEQ), estimate(&fused, &s, &SEQ));
    // A 64x64 latent: 4096 queries x 4096 keys of scores per head on the plain path.
    assert!(f.unet.private_dirty < r.unet.private_dirty, "{} vs {}", f.unet.private_dirty, r.unet.private_dirty);
    assert!(f.decode.private_dirty < r.decode.private_dirty);
    // Weights do not depend on the kernels (compared per phase: the fixture's packed
    // weights are mapped, so which phase peaks decides the overall figure).
    for (a, b) in [(f.text, r.text), (f.unet, r.unet), (f.decode, r.decode)] {
        assert_eq!(a.rss - a.private_dirty, b.rss - b.private_dirty);
    }
    // No score matrix, nothing to chunk: the rungs go from sequential to tiles.
    let ladder = rungs(&fused, &s, 1 << 20);
    assert!(ladder.iter().all(|st| st.attention == AttentionMode::Full), "{ladder:?}");
    assert!(ladder.iter().any(|st| matches!(st.vae, VaeDecode::Tiled(_))), "{ladder:?}");
    assert!(rungs(&reference, &s, 1 << 20).iter().any(|st| matches!(st.attention, AttentionMode::Chunked(_))));
}
