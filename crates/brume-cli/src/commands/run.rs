//! What `generate` and `edit` share: the request options, running the job
//! through the runtime (the one `brume serve` runs) with its progress line,
//! Ctrl-C and previews, and writing images that carry their recipe.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use brume::output::{Claimed, Output};
use brume::pipelines::recipe::Recipe;
use brume::samplers::{RngKind, SamplerKind};
use brume_runtime::{Edit, EventKind, JobId, JobOutput, JobSpec, JobState, Limits, PreviewPolicy, Runtime, RuntimeConfig, SubmitError};

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
    /// The prompt from the positional argument or `--prompt`.
    pub fn prompt(&self) -> anyhow::Result<String> {
        match self.prompt_pos.clone().or(self.prompt.clone()) {
            Some(p) => Ok(p),
            None => bail!("no prompt: give one as an argument or with --prompt"),
        }
    }

    /// The job these options ask for (settings the user left out take the
    /// model's defaults in the runtime, as `brume serve` does).
    pub fn spec(&self, edit: Edit) -> anyhow::Result<JobSpec> {
        Ok(JobSpec {
            unet: self.model.unet.clone(),
            negative_prompt: self.negative_prompt.clone(),
            sampler: self.sampler.as_deref().map(SamplerKind::parse).transpose()?,
            steps: self.steps,
            guidance: self.guidance,
            seed: Some(self.seed),
            rng: RngKind::parse(&self.rng)?,
            eta: self.eta,
            clip_skip: self.clip_skip,
            batch: self.batch,
            edit,
            previews: self.previews(),
            ..JobSpec::txt2img(self.prompt()?)
        })
    }

    /// The preview file, under the same rule as the outputs.
    pub fn preview_output(&self) -> Option<Output> {
        self.preview.as_ref().map(|p| Output::new(p, self.force))
    }

    /// Previews only when a preview file is asked for, every `--preview-every` steps.
    pub fn previews(&self) -> PreviewPolicy {
        match &self.preview {
            Some(_) if self.preview_every > 0 => PreviewPolicy { every: self.preview_every, min_interval: std::time::Duration::ZERO },
            _ => PreviewPolicy::OFF,
        }
    }

    /// Warnings about the request a user needs before the work: words the
    /// built-in model never saw, an output named as if it were not a PNG.
    pub fn warn_about_request(&self, prompt: &str) {
        if self.model.path().is_none() {
            if let Some(w) = crate::builtin::vocabulary_warning(prompt) {
                eprintln!("warning: {w}");
            }
        }
        if let Some(w) = brume::output::png_extension_warning(&self.out) {
            eprintln!("warning: {w}");
        }
    }

    /// The outputs for a batch (OUT, OUT-2, ...), checked before any work: an
    /// existing file needs --force, and what is not a regular file is never replaced.
    pub fn outputs(&self, batch: usize) -> anyhow::Result<Vec<Output>> {
        let outs: Vec<Output> = (0..batch).map(|i| Output::new(numbered(&self.out, i), self.force)).collect();
        for o in &outs {
            o.check()?;
        }
        if let Some(p) = &self.preview {
            if outs.iter().any(|o| o.path == *p || brume::output::same_file(&o.path, p)) {
                bail!("--preview {} is also an output; give the preview its own file", p.display());
            }
            Output::new(p, self.force).check().context("--preview")?;
        }
        Ok(outs)
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

    /// Starts the runtime over the chosen model with the memory options: the
    /// same runtime `brume serve` runs, here for one job.
    pub fn runtime(&self) -> anyhow::Result<Runtime> {
        let entry = self.model.entry();
        let mut config = RuntimeConfig::new(vec![entry]);
        config.memory = self.memory.policy();
        // One person at a terminal: the service's guard rails on work are off,
        // the engine's own limits (sizes, steps) still hold.
        config.limits = Limits { max_steps: 1000, max_batch: 64, max_guidance: 1000.0, ..Limits::default() };
        config.max_job_time = None;
        config.conditioning_cache = 1;
        config.warm_models = 1;
        Runtime::start(config).map_err(|e| match e {
            brume_runtime::StartError::Model { message, .. } => anyhow::anyhow!("{message}"),
            e => e.into(),
        })
    }
}

/// The settings of a recipe as a job: every value explicit, so the runtime
/// makes the same picture again.
pub fn spec_from_recipe(r: &Recipe, edit: Edit) -> anyhow::Result<JobSpec> {
    Ok(JobSpec {
        unet: r.unet.clone(),
        negative_prompt: r.negative_prompt.clone(),
        sampler: Some(SamplerKind::parse(&r.sampler)?),
        steps: Some(r.steps),
        guidance: Some(r.guidance_scale),
        width: Some(r.width),
        height: Some(r.height),
        seed: Some(r.seed),
        rng: RngKind::parse(&r.rng)?,
        eta: r.eta,
        clip_skip: r.clip_skip,
        batch: r.batch,
        edit,
        ..JobSpec::txt2img(r.prompt.clone())
    })
}

fn numbered(out: &Path, i: usize) -> PathBuf {
    if i == 0 {
        return out.to_path_buf();
    }
    let stem = out.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let ext = out.extension().map(|e| e.to_string_lossy().into_owned()).unwrap_or_else(|| "png".into());
    out.with_file_name(format!("{stem}-{}.{ext}", i + 1))
}

/// Turns a refused submission into the CLI's words: the field is the flag.
pub fn submit_error(e: SubmitError) -> anyhow::Error {
    match e {
        SubmitError::Invalid { field, message } => anyhow::anyhow!("--{}: {message}", field.replace('_', "-")),
        e => e.into(),
    }
}

/// Runs one job through the runtime, showing its progress on stderr (a
/// progress line on a terminal, nothing per step otherwise), writing previews
/// to `--preview`, and cancelling at the next step on Ctrl-C.
pub fn run_job(rt: &Runtime, spec: JobSpec, preview: Option<Output>) -> anyhow::Result<Arc<JobOutput>> {
    let mut events = rt.subscribe();
    let id = rt.submit(spec).map_err(submit_error)?;
    on_ctrl_c(rt.clone(), id);
    let mut bar = ProgressLine::new();
    let mut preview = preview.map(Claimed::new);
    loop {
        let event = match events.blocking_recv() {
            Ok(e) => e,
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
            Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
        };
        if event.job != id {
            continue;
        }
        match &event.kind {
            EventKind::Planned { summary } => eprintln!("{summary}"),
            EventKind::Notice { message } => eprintln!("warning: {message}"),
            EventKind::Loaded { segment } => {
                let m = brume::runtime::memory::read();
                tracing::info!(
                    "loaded {segment}; private dirty {}, RSS {}; {}",
                    m.private_dirty.map(brume::runtime::memory::mib).unwrap_or_default(),
                    m.rss.map(brume::runtime::memory::mib).unwrap_or_default(),
                    heap_now()
                );
            }
            EventKind::Step { step, total, eta_ms } => {
                // The heap at each step, to check the estimator phase by phase.
                tracing::info!("step {step}; {}", heap_now());
                bar.step(*step, *total, *eta_ms);
            }
            EventKind::Preview { png, .. } => {
                if let Some(p) = preview.as_mut() {
                    if let Err(e) = p.write_bytes(png) {
                        tracing::warn!("preview: {e}");
                    }
                }
            }
            EventKind::Done { .. } | EventKind::Failed { .. } | EventKind::Cancelled { .. } => break,
            _ => {}
        }
    }
    bar.end();
    let status = rt.wait(id).context("the runtime forgot the job")?;
    match status.state {
        JobState::Done => status.output.context("a finished job without its result"),
        JobState::Cancelled(_) => bail!("cancelled; nothing was written"),
        JobState::Failed(e) => Err(anyhow::anyhow!("{}", e.message)),
        other => bail!("the job ended {}", other.name()),
    }
}

/// Writes each picture of the result to its output (the PNG with its recipe),
/// saying where each went when it had to take another name.
pub fn write_outputs(out: &JobOutput, outputs: &[Output]) -> anyhow::Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for (img, o) in out.images.iter().zip(outputs) {
        let w = o.write_bytes(&img.png).with_context(|| format!("writing {}", o.path.display()))?;
        if let Some(note) = w.notice() {
            eprintln!("warning: {note}");
        }
        written.push(w.path);
    }
    Ok(written)
}

/// The picture size of a result.
pub fn size_of(out: &JobOutput) -> (u32, u32) {
    out.images.first().map(|i| (i.width, i.height)).unwrap_or((0, 0))
}

/// Ctrl-C cancels the job at its next step; a second Ctrl-C exits at once.
fn on_ctrl_c(rt: Runtime, id: JobId) {
    let pressed = AtomicBool::new(false);
    if let Err(e) = ctrlc::set_handler(move || {
        if pressed.swap(true, Ordering::SeqCst) {
            // Second Ctrl-C: the user really wants out now.
            std::process::exit(130);
        }
        eprintln!("\ncancelling after this step (Ctrl-C again to abort)");
        rt.cancel(id);
    }) {
        tracing::warn!("cannot install the Ctrl-C handler: {e}");
    }
}

/// The step, seconds per step and ETA, redrawn in place on a terminal; when
/// stderr is a file or a pipe, nothing per step (no carriage returns in logs).
struct ProgressLine {
    terminal: bool,
    last: Instant,
    step_times: Vec<f64>,
    drawn: bool,
}

impl ProgressLine {
    fn new() -> Self {
        Self { terminal: brume::output::stderr_is_terminal(), last: Instant::now(), step_times: Vec::new(), drawn: false }
    }

    fn step(&mut self, index: usize, total: usize, eta_ms: Option<u64>) {
        self.step_times.push(self.last.elapsed().as_secs_f64());
        self.last = Instant::now();
        if !self.terminal {
            return;
        }
        let mut sorted = self.step_times.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        let eta = eta_ms.map(|m| m as f64 / 1e3).unwrap_or(0.0);
        let width = 24;
        let done = width * index / total.max(1);
        eprint!("\r[{}{}] {index}/{total}  {median:.2} s/step  ETA {eta:.1} s ", "#".repeat(done), ".".repeat(width - done));
        let _ = std::io::stderr().flush();
        self.drawn = true;
    }

    fn end(&mut self) {
        if self.drawn {
            eprintln!();
            self.drawn = false;
        }
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
