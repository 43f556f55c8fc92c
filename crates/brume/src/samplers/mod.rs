//! Samplers (diffusers calls them schedulers): one file per algorithm, the
//! shared noise schedule, and the noise sources.
//!
//! Every sampler follows diffusers' calling convention exactly, so a pipeline
//! loop is the same for all of them and step-by-step parity is meaningful:
//! evaluate the model at each of `timesteps()` (Heun lists interior timesteps
//! twice) on `scale_model_input(sample, i)`, then `step(output, i, sample)`.

pub mod ddim;
pub mod rng;
pub mod schedule;
pub mod torch_rng;

use candle_core::{Device, Tensor};

pub use ddim::Ddim;
pub use rng::Rng;
pub use schedule::{PredictionType, ScheduleConfig, TimestepSpacing};
pub use torch_rng::TorchRng;

use crate::error::RunError;

/// Where a sampler's fresh noise comes from: brume's seeded RNG, the
/// torch-compatible generator, or noise replayed from a parity fixture.
pub trait NoiseSource {
    fn randn(&mut self, shape: &[usize], device: &Device) -> candle_core::Result<Tensor>;
}

impl NoiseSource for Rng {
    fn randn(&mut self, shape: &[usize], device: &Device) -> candle_core::Result<Tensor> {
        Rng::randn(self, shape, device)
    }
}

/// Which generator turns a seed into noise (`--rng`).
///
/// `Brume` is brume's own generator: fast and identical everywhere, but its
/// pictures are brume's own. `Torch` reproduces `torch.Generator("cpu")` +
/// `torch.randn` bit for bit, so a seed names the same picture as in diffusers
/// run on CPU (starting latents and the fresh noise of ancestral samplers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RngKind {
    #[default]
    Brume,
    Torch,
}

impl RngKind {
    pub const ALL: &'static [RngKind] = &[RngKind::Brume, RngKind::Torch];

    pub fn cli_name(self) -> &'static str {
        match self {
            RngKind::Brume => "brume",
            RngKind::Torch => "torch",
        }
    }

    /// Parses an `--rng` name.
    pub fn parse(name: &str) -> Result<Self, RunError> {
        Self::ALL.iter().copied().find(|k| k.cli_name() == name).ok_or_else(|| {
            let known: Vec<&str> = Self::ALL.iter().map(|k| k.cli_name()).collect();
            RunError::Invalid(format!("unknown rng `{name}` (known: {})", known.join(", ")))
        })
    }
}

/// A fresh noise source of `kind` seeded with `seed`.
pub fn noise_source(kind: RngKind, seed: u64) -> Box<dyn NoiseSource> {
    match kind {
        RngKind::Brume => Box::new(Rng::new(seed)),
        RngKind::Torch => Box::new(TorchRng::new(seed)),
    }
}

/// One sampling algorithm configured for a number of steps.
pub trait Sampler {
    /// The model timesteps, in evaluation order (diffusers' `scheduler.timesteps`).
    fn timesteps(&self) -> &[f64];
    /// Standard deviation of the initial noise (diffusers' `init_noise_sigma`).
    fn init_noise_sigma(&self) -> f64;
    /// The model input for evaluation `index` (diffusers' `scale_model_input`).
    fn scale_model_input(&self, sample: &Tensor, index: usize) -> candle_core::Result<Tensor>;
    /// The update after evaluation `index` (diffusers' `step(...).prev_sample`).
    fn step(
        &mut self,
        model_output: &Tensor,
        index: usize,
        sample: &Tensor,
        noise: &mut dyn NoiseSource,
    ) -> candle_core::Result<Tensor>;
    /// `original` noised to the level at which evaluation `index` starts
    /// (diffusers' `add_noise` at `timesteps[index]`), for img2img and inpainting.
    fn add_noise(&self, original: &Tensor, noise: &Tensor, index: usize) -> candle_core::Result<Tensor>;
    /// Model evaluations per step (diffusers' `order`): 2 for Heun, else 1.
    fn order(&self) -> usize {
        1
    }
}

/// The samplers brume offers, by CLI name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SamplerKind {
    Ddim,
}

impl SamplerKind {
    pub const ALL: &'static [SamplerKind] = &[SamplerKind::Ddim];

    pub fn cli_name(self) -> &'static str {
        match self {
            SamplerKind::Ddim => "ddim",
        }
    }

    /// Parses a `--sampler` name.
    pub fn parse(name: &str) -> Result<Self, RunError> {
        Self::ALL.iter().copied().find(|k| k.cli_name() == name).ok_or_else(|| {
            let known: Vec<&str> = Self::ALL.iter().map(|k| k.cli_name()).collect();
            RunError::Invalid(format!("unknown sampler `{name}` (known: {})", known.join(", ")))
        })
    }

    /// The sampler a model's own `scheduler_config.json` asks for.
    pub fn from_config(cfg: &ScheduleConfig) -> Result<Self, RunError> {
        match cfg.class_name.as_deref() {
            None | Some("DDIMScheduler") => Ok(SamplerKind::Ddim),
            // PNDM (SD 1.5's shipped default) is not offered; DDIM is the standard
            // substitute and converges to the same images at typical step counts.
            Some("PNDMScheduler") => {
                tracing::info!("the model ships PNDMScheduler; using DDIM");
                Ok(SamplerKind::Ddim)
            }
            Some(other) => Err(RunError::Invalid(format!(
                "{}: scheduler class `{other}` is not supported; choose one with --sampler",
                cfg.path.display()
            ))),
        }
    }
}

/// Builds `kind` over the model's schedule for `steps` steps.
pub fn build(kind: SamplerKind, cfg: &ScheduleConfig, steps: usize, eta: f64) -> Result<Box<dyn Sampler>, RunError> {
    if steps == 0 {
        return Err(RunError::Invalid("steps must be at least 1".into()));
    }
    Ok(match kind {
        SamplerKind::Ddim => Box::new(Ddim::new(cfg, steps, eta)),
    })
}
