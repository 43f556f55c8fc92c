use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use brume::pipelines::image_io::{save_png, to_rgb8};
use brume::pipelines::{txt2img, Flow, GenerationRequest, Progress, RunOptions};
use brume::samplers::{noise_source, RngKind, SamplerKind};

use super::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// What to draw.
    #[arg(value_name = "PROMPT")]
    prompt_pos: Option<String>,
    /// What to draw (alternative to the positional argument).
    #[arg(long = "prompt", conflicts_with = "prompt_pos")]
    prompt: Option<String>,
    /// What to steer away from.
    #[arg(long)]
    negative_prompt: Option<String>,
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Denoising steps (DDIM).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Classifier-free guidance scale; <= 1 disables guidance (one UNet pass per step).
    #[arg(long, default_value_t = 7.5)]
    guidance: f64,
    /// Output width in pixels (default: the model's native size).
    #[arg(long)]
    width: Option<usize>,
    /// Output height in pixels (default: the model's native size).
    #[arg(long)]
    height: Option<usize>,
    /// Noise generator: brume (same on every machine) or torch (diffusers' CPU pictures).
    #[arg(long, default_value = "brume")]
    rng: String,
    /// Sampler (default: the model's own scheduler config).
    #[arg(long)]
    sampler: Option<String>,
    /// Text-encoder layers to skip at the end (diffusers' clip_skip).
    #[arg(long, default_value_t = 0)]
    clip_skip: usize,
    /// Output PNG.
    #[arg(long, short, default_value = "brume.png")]
    out: PathBuf,
    /// Overwrite the output file if it exists.
    #[arg(long)]
    force: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let Some(prompt) = a.prompt_pos.or(a.prompt) else {
        bail!("no prompt: give one as an argument or with --prompt");
    };
    if a.out.exists() && !a.force {
        bail!("{} exists; pass --force to overwrite it", a.out.display());
    }
    let model = a.model.open()?;
    let size = model.default_size();
    let req = GenerationRequest {
        prompt,
        negative_prompt: a.negative_prompt,
        steps: a.steps,
        guidance_scale: a.guidance,
        width: a.width.unwrap_or(size),
        height: a.height.unwrap_or(size),
        seed: a.seed,
        rng: RngKind::parse(&a.rng)?,
        eta: 0.0,
        clip_skip: a.clip_skip,
        sampler: a.sampler.as_deref().map(SamplerKind::parse).transpose()?,
        batch: 1,
    };
    let opts = RunOptions::default();
    let start = Instant::now();
    let mut last = Instant::now();
    let mut progress = |p: &Progress| {
        if let Progress::Step { index, total, .. } = *p {
            let step = last.elapsed().as_secs_f64();
            last = Instant::now();
            let eta = step * (total - index) as f64;
            eprint!("\rstep {index}/{total}  {step:.2} s/step  ETA {eta:.1} s   ");
            let _ = std::io::stderr().flush();
            if index == total {
                eprintln!();
            }
        }
        Flow::Continue
    };
    let mut noise = noise_source(req.rng, req.seed)?;
    let out = txt2img(&model, &req, &opts, noise.as_mut(), None, &mut progress)?;
    let img = to_rgb8(&out.image)?;
    save_png(&img, &a.out).with_context(|| format!("writing {}", a.out.display()))?;
    let mem = brume::runtime::memory::read();
    println!(
        "wrote {} ({}x{}, {} steps, seed {}) in {:.2} s{}",
        a.out.display(),
        req.width,
        req.height,
        req.steps,
        req.seed,
        start.elapsed().as_secs_f64(),
        mem.peak_rss
            .map(|b| format!(", peak RSS {}", brume::runtime::memory::mib(b)))
            .unwrap_or_default()
    );
    Ok(())
}
