//! Benchmarks that print tables. Timings are medians over repeated runs,
//! alternated between the variants compared, because these machines are shared.

use std::time::Instant;

use anyhow::{bail, Context};
use brume::models::attention::{CrossContext, KvCache};
use brume::pipelines::conditioning::{conditioning, ConditioningCache};
use brume::pipelines::{Flow, GenerationRequest};
use candle_core::{DType, Tensor};

use super::{MemoryArgs, ModelArgs};

#[derive(clap::Subcommand, Debug)]
pub enum Bench {
    /// What the conditioning cache (cross-attention K/V reuse) saves.
    KvCache(KvArgs),
    /// Per precision tier: bytes per segment, peak RSS and private-dirty memory,
    /// seconds per UNet step, PSNR against fp32, prompt adherence (built-in model).
    Precision(super::bench_precision::PrecisionArgs),
    /// One tier's generation in its own process (used by `bench precision`).
    #[command(hide = true)]
    PrecisionRun(super::bench_precision::RunArgs),
    /// Estimated vs measured peak memory over tiers x sizes x memory plans, each
    /// row in a child process under an enforced limit equal to its budget.
    Memory(super::bench_memory::MemArgs),
    /// Each CPU kernel vs candle's plain path vs PyTorch (attention, group norm, conv).
    Kernels(super::bench_kernels::KernelArgs),
    /// brume vs PyTorch, ONNX Runtime and OpenVINO per component (UNets, VAE
    /// decoders, text encoder) on the same random-weight models.
    Speed(super::bench_speed::SpeedArgs),
    /// `brume serve` under load (mixed requests from concurrent clients), HTTP
    /// vs library latency, and a seeded fuzz (`--fuzz N`); exits non-zero when a bar fails.
    Serve(super::bench_serve::ServeArgs),
    /// The live pipeline on a synthetic moving scene: FPS, latency, pipeline vs one
    /// thread, each technique on/off (flicker), the governor, and the bars.
    Live(super::bench_live::LiveArgs),
}

#[derive(clap::Args, Debug)]
pub struct KvArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    memory: MemoryArgs,
    /// Image size in pixels (square).
    #[arg(long, default_value_t = 512)]
    size: usize,
    /// Denoising steps per variant (the FLOP count is also given for --steps-total).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// The run length the savings are totalled over.
    #[arg(long, default_value_t = 20)]
    steps_total: usize,
    /// Classifier-free guidance (2 UNet branches) as in ordinary generation.
    #[arg(long, default_value_t = 7.5)]
    guidance: f64,
}

pub fn run(b: Bench) -> anyhow::Result<()> {
    match b {
        Bench::KvCache(a) => kv_cache(a),
        Bench::Precision(a) => super::bench_precision::precision(a),
        Bench::PrecisionRun(a) => super::bench_precision::run_child(a),
        Bench::Memory(a) => super::bench_memory::run(a),
        Bench::Kernels(a) => super::bench_kernels::run(a),
        Bench::Speed(a) => super::bench_speed::run(a),
        Bench::Serve(a) => super::bench_serve::run(a),
        Bench::Live(a) => super::bench_live::run(a),
    }
}

/// Median, fastest and slowest of repeated timings (what every bench table
/// reports); `None` when there are none.
pub fn spread(v: &[f64]) -> Option<(f64, f64, f64)> {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    Some((*v.get(v.len() / 2)?, *v.first()?, *v.last()?))
}

/// The median of repeated timings; `None` when there are none.
pub fn median(v: &[f64]) -> Option<f64> {
    spread(v).map(|(m, _, _)| m)
}

fn kv_cache(a: KvArgs) -> anyhow::Result<()> {
    if a.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let budget = a.memory.budget()?;
    tracing::info!(%budget, "memory budget");
    let model = a.model.open()?;
    let dev = brume::runtime::default_device();
    let req = GenerationRequest {
        guidance_scale: a.guidance,
        ..GenerationRequest::new("a photograph of an astronaut riding a horse", a.size)
    };
    req.validate(&model)?;

    // Text encoder: first prompt (load + encode) vs the same prompt again (cache hit).
    let mut cache = ConditioningCache::new(4);
    let t = Instant::now();
    let cond = conditioning(&model, &req, &dev, DType::F32, Some(&mut cache), &mut |_| Flow::Continue)?;
    let te_first = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let again = conditioning(&model, &req, &dev, DType::F32, Some(&mut cache), &mut |_| Flow::Continue)?;
    let te_repeat = t.elapsed().as_secs_f64();
    assert!(std::rc::Rc::ptr_eq(&cond, &again));

    let unet = model.unet(&dev, DType::F32)?;
    let f = model.vae_config.scale_factor();
    let branches = if cond.guided { 2 } else { 1 };
    let mut rng = brume::samplers::Rng::new(0);
    let sample = rng.randn(&[branches, model.unet_config.in_channels, a.size / f, a.size / f], &dev)?;
    let kv = KvCache::new();
    let cached_ctx = CrossContext { cache: Some(&kv), ..CrossContext::uncached(&cond.context) };
    let plain_ctx = CrossContext::uncached(&cond.context);
    // Fill the cache (the first step of a generation pays for the projections).
    let fill = Instant::now();
    let first: Tensor = unet.forward_with(&sample, &[999.0], &cached_ctx, None)?;
    let fill_time = fill.elapsed().as_secs_f64();
    let (mut with, mut without) = (Vec::new(), Vec::new());
    let mut max_diff = 0f32;
    for i in 0..a.steps {
        let t = 999.0 - 50.0 * (i + 1) as f32;
        let s = Instant::now();
        let y0 = unet.forward_with(&sample, &[t], &plain_ctx, None)?;
        without.push(s.elapsed().as_secs_f64());
        let s = Instant::now();
        let y1 = unet.forward_with(&sample, &[t], &cached_ctx, None)?;
        with.push(s.elapsed().as_secs_f64());
        max_diff = max_diff.max((y0 - y1)?.abs()?.max_all()?.to_scalar::<f32>()?);
        eprint!("\rstep {}/{}", i + 1, a.steps);
    }
    eprintln!();
    drop(first);
    let ctx_dim = model.unet_config.cross_attention_dim[0];
    let flops = kv.projection_flops(ctx_dim);
    let (w, wo) = (median(&with).context("no timed steps")?, median(&without).context("no timed steps")?);
    println!("conditioning cache at {0}x{0}, {1} cross-attention layers, {2} UNet branch(es), model {3}", a.size, kv.layers(), branches, model.name);
    println!("{:<44} {:>14} {:>14}", "", "uncached", "cached");
    println!("{:<44} {:>14.3} {:>14.3}", "K/V projection GFLOP per step", flops as f64 / 1e9, 0.0);
    println!(
        "{:<44} {:>14.3} {:>14.3}",
        format!("K/V projection GFLOP per {}-step image", a.steps_total),
        flops as f64 * a.steps_total as f64 / 1e9,
        flops as f64 / 1e9
    );
    println!("{:<44} {:>14.3} {:>14.3}", format!("UNet step, median of {} (s)", a.steps), wo, w);
    println!("{:<44} {:>14.3} {:>14.3}", "text encoder on a repeated prompt (s)", te_first, te_repeat);
    println!("{:<44} {:>14} {:>14}", "K/V cache memory", "-", brume::runtime::memory::mib(kv.nbytes() as u64));
    println!("step ratio cached/uncached {:.3}; first (filling) step {:.3} s; max |cached - uncached| = {:.2e}", w / wo, fill_time, max_diff);
    Ok(())
}
