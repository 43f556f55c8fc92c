//! What `generate` and `edit` share: the request options, the progress line,
//! Ctrl-C, previews, and writing images that carry their recipe.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use brume::pipelines::image_io::{save_png, to_rgb8};
use brume::pipelines::preview::latent_preview;
use brume::pipelines::recipe::Recipe;
use brume::pipelines::{Flow, GenerationRequest, Progress, SdModel};
use brume::samplers::{RngKind, SamplerKind};

use super::{MemoryArgs, ModelArgs};

/// Options every generation takes.
#[derive(clap::Args, Debug, Clone)]
pub struct GenArgs {
    /// What to draw.
    #[arg(value_name = "PROMPT")]
    pub prompt_pos: Option<String>,
    /// What to draw (alternative to the positional argument).
    #[arg(long = "prompt", conflicts_with = "prompt_pos")]
    pub prompt: Option<String>,
    /// What to steer away from.
    #[arg(long)]
    pub negative_prompt: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub memory: MemoryArgs,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Noise generator: brume (same on every machine) or torch (diffusers' CPU pictures).
    #[arg(long, default_value = "brume")]
    pub rng: String,
    /// Sampler: ddim, ddpm, euler, euler_a, heun, dpmpp_2m, dpmpp_2m_karras, dpmpp_2m_sde,
    /// unipc, lcm, tcd (default: the model's own scheduler config).
    #[arg(long)]
    pub sampler: Option<String>,
    /// Denoising steps (default: what the UNet folder's sampling_defaults.json recommends
    /// for its own scheduler, else 4 for the few-step samplers lcm and tcd and 20 for the rest).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Classifier-free guidance scale; <= 1 disables guidance (one UNet pass per step).
    /// Default: the UNet folder's recommendation (the built-in model's is 3.5), else 7.5.
    #[arg(long)]
    pub guidance: Option<f64>,
    /// DDIM eta (0 = deterministic).
    #[arg(long, default_value_t = 0.0)]
    pub eta: f64,
    /// Text-encoder layers to skip at the end (diffusers' clip_skip).
    #[arg(long, default_value_t = 0)]
    pub clip_skip: usize,
    /// Images per run (sharing the prompt encoding): OUT, OUT-2, OUT-3, ...
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Output PNG.
    #[arg(long, short, default_value = "brume.png")]
    pub out: PathBuf,
    /// Overwrite output files that exist.
    #[arg(long)]
    pub force: bool,
    /// Write a preview of the latents to this PNG while denoising.
    #[arg(long)]
    pub preview: Option<PathBuf>,
    /// Preview every k steps.
    #[arg(long, default_value_t = 1)]
    pub preview_every: usize,
    /// Re-create the image described by this PNG's recipe (its prompt, seed,
    /// settings, model and inputs); only --out, --force and --model apply.
    #[arg(long)]
    pub from: Option<PathBuf>,
}

impl GenArgs {
    /// The request from the options (sizes default to the model's native size).
    pub fn request(&self, model: &SdModel, width: Option<usize>, height: Option<usize>) -> anyhow::Result<GenerationRequest> {
        let Some(prompt) = self.prompt_pos.clone().or(self.prompt.clone()) else {
            bail!("no prompt: give one as an argument or with --prompt");
        };
        let size = model.default_size();
        let sampler = self.sampler.as_deref().map(SamplerKind::parse).transpose()?;
        let kind = model.sampler_kind(sampler)?;
        let settings = model.sampling_settings(kind, self.steps, self.guidance)?;
        Ok(GenerationRequest {
            prompt,
            negative_prompt: self.negative_prompt.clone(),
            steps: settings.steps,
            guidance_scale: settings.guidance_scale,
            width: width.unwrap_or(size),
            height: height.unwrap_or(size),
            seed: self.seed,
            rng: RngKind::parse(&self.rng)?,
            eta: self.eta,
            clip_skip: self.clip_skip,
            sampler,
            batch: self.batch,
        })
    }

    /// Output paths for a batch, refusing to overwrite without --force.
    pub fn outputs(&self, batch: usize) -> anyhow::Result<Vec<PathBuf>> {
        let paths: Vec<PathBuf> = (0..batch).map(|i| numbered(&self.out, i)).collect();
        if !self.force {
            if let Some(p) = paths.iter().find(|p| p.exists()) {
                bail!("{} exists; pass --force to overwrite it", p.display());
            }
        }
        Ok(paths)
    }

    /// The recipe stored in `--from`, if given.
    pub fn from_recipe(&self) -> anyhow::Result<Option<Recipe>> {
        let Some(p) = &self.from else { return Ok(None) };
        match brume::pipelines::recipe::read_recipe(p)? {
            Some(r) => {
                // Re-creating bit for bit means multiplying in the precision it was made with.
                let want = r.compute.as_deref().unwrap_or("f32");
                let c = brume::kernels::Compute::parse(want).with_context(|| format!("{}: unknown compute precision `{want}`", p.display()))?;
                if c != brume::kernels::compute() {
                    tracing::info!(compute = want, "following the recipe's compute precision");
                    brume::kernels::set_compute(c).map_err(|e| anyhow::anyhow!("{} was made with --compute {want}: {e}", p.display()))?;
                }
                Ok(Some(r))
            }
            None => bail!("{} has no brume recipe (was it written by brume?)", p.display()),
        }
    }
}

fn numbered(out: &Path, i: usize) -> PathBuf {
    if i == 0 {
        return out.to_path_buf();
    }
    let stem = out.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let ext = out.extension().map(|e| e.to_string_lossy().into_owned()).unwrap_or_else(|| "png".into());
    out.with_file_name(format!("{stem}-{}.{ext}", i + 1))
}

/// Ctrl-C sets a flag the progress callback turns into a clean cancel between steps.
pub fn cancel_flag() -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let f = flag.clone();
    if let Err(e) = ctrlc::set_handler(move || {
        if f.swap(true, Ordering::SeqCst) {
            // Second Ctrl-C: the user really wants out now.
            std::process::exit(130);
        }
        eprintln!("\ncancelling after this step (Ctrl-C again to abort)");
    }) {
        tracing::warn!("cannot install the Ctrl-C handler: {e}");
    }
    flag
}

/// The progress line (step, seconds per step, ETA), previews and cancellation.
pub fn progress_reporter(
    preview: Option<PathBuf>,
    every: usize,
    cancel: Arc<AtomicBool>,
) -> impl FnMut(&Progress) -> Flow {
    let mut last = Instant::now();
    let mut step_times: Vec<f64> = Vec::new();
    move |p: &Progress| {
        match p {
            Progress::Loaded(seg) => {
                let m = brume::runtime::memory::read();
                tracing::info!(
                    "loaded {seg}; private dirty {}, RSS {}; {}",
                    m.private_dirty.map(brume::runtime::memory::mib).unwrap_or_default(),
                    m.rss.map(brume::runtime::memory::mib).unwrap_or_default(),
                    heap_now()
                );
                last = Instant::now();
            }
            Progress::Step { index, total, latents } => {
                // The heap at each step, to check the estimator phase by phase.
                tracing::info!("step {index}; {}", heap_now());
                step_times.push(last.elapsed().as_secs_f64());
                last = Instant::now();
                let mut sorted = step_times.clone();
                sorted.sort_by(|a, b| a.total_cmp(b));
                let median = sorted[sorted.len() / 2];
                let eta = median * (total - index) as f64;
                let width = 24;
                let done = width * index / total.max(&1);
                eprint!(
                    "\r[{}{}] {index}/{total}  {median:.2} s/step  ETA {eta:.1} s ",
                    "#".repeat(done),
                    ".".repeat(width - done)
                );
                let _ = std::io::stderr().flush();
                if index == total {
                    eprintln!();
                }
                if let Some(path) = &preview {
                    if every > 0 && (index % every == 0 || index == total) {
                        match latent_preview(latents, 8) {
                            Ok(img) => {
                                if let Err(e) = save_png(&img, path, None) {
                                    tracing::warn!("preview: {e}");
                                }
                            }
                            Err(e) => tracing::warn!("preview: {e}"),
                        }
                    }
                }
            }
        }
        if cancel.load(Ordering::SeqCst) {
            Flow::Cancel
        } else {
            Flow::Continue
        }
    }
}

/// Writes each image of the batch with its recipe (seed noted per image).
pub fn save_batch(image: &candle_core::Tensor, paths: &[PathBuf], recipe: &Recipe) -> anyhow::Result<()> {
    for (i, path) in paths.iter().enumerate() {
        let img = to_rgb8(&image.get(i)?.unsqueeze(0)?)?;
        save_png(&img, path, Some(recipe)).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Turns a cancelled run into a clean message.
pub fn finish(result: brume::error::Result<brume::pipelines::Generated>) -> anyhow::Result<brume::pipelines::Generated> {
    match result {
        Err(brume::RunError::Cancelled) => bail!("cancelled; nothing was written"),
        other => Ok(other?),
    }
}

/// The heap's live bytes and its peak so far, when the counting allocator is
/// installed. It does not start a new peak: `--memory-report`'s watch reads the
/// same counter.
fn heap_now() -> String {
    match brume::runtime::memory::heap() {
        Some((live, peak)) => {
            use brume::runtime::memory::mib;
            format!("heap {} live, peak {} so far", mib(live), mib(peak))
        }
        None => "heap not counted".to_string(),
    }
}
