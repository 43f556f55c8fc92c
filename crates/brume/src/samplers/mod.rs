//! Samplers (diffusers calls them schedulers): one file per algorithm, the
//! shared noise schedule, and the noise sources.
//!
//! Every sampler follows diffusers' calling convention exactly, so a pipeline
//! loop is the same for all of them and step-by-step parity is meaningful:
//! evaluate the model at each of `timesteps()` (Heun lists interior timesteps
//! twice) on `scale_model_input(sample, i)`, then `step(output, i, sample)`.

pub mod ddim;
pub mod ddpm;
pub mod dpm_solver;
pub mod euler;
pub mod euler_ancestral;
pub mod heun;
pub mod lcm;
pub mod rng;
pub mod schedule;
pub mod sigmas;
pub mod tcd;
pub mod torch_rng;
pub mod unipc;

use candle_core::{Device, Tensor};

pub use ddim::Ddim;
pub use ddpm::Ddpm;
pub use dpm_solver::{DpmAlgorithm, DpmSolver, DpmVariant};
pub use euler::Euler;
pub use euler_ancestral::EulerAncestral;
pub use heun::Heun;
pub use lcm::Lcm;
pub use tcd::Tcd;
pub use unipc::UniPc;
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
    /// Samplers on the alpha (variance-preserving) parameterisation start from
    /// unit noise; sigma-based ones (Euler, Heun) override this.
    fn init_noise_sigma(&self) -> f64 {
        1.0
    }
    /// The model input for evaluation `index` (diffusers' `scale_model_input`):
    /// the sample as is, except for sigma-based samplers, which override this.
    fn scale_model_input(&self, sample: &Tensor, _index: usize) -> candle_core::Result<Tensor> {
        Ok(sample.clone())
    }
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
    Ddpm,
    Euler,
    EulerAncestral,
    Heun,
    /// DPM-Solver++ 2M on the model's own sigma spacing.
    DpmPP2M,
    /// DPM-Solver++ 2M on Karras sigmas.
    DpmPP2MKarras,
    /// SDE-DPM-Solver++ 2M (fresh noise every step).
    DpmPP2MSde,
    UniPc,
    Lcm,
    Tcd,
}

impl SamplerKind {
    pub const ALL: &'static [SamplerKind] = &[
        SamplerKind::Ddim,
        SamplerKind::Ddpm,
        SamplerKind::Euler,
        SamplerKind::EulerAncestral,
        SamplerKind::Heun,
        SamplerKind::DpmPP2M,
        SamplerKind::DpmPP2MKarras,
        SamplerKind::DpmPP2MSde,
        SamplerKind::UniPc,
        SamplerKind::Lcm,
        SamplerKind::Tcd,
    ];

    /// Samplers made for distilled models (LCM, TCD): a handful of steps, not twenty.
    pub fn is_few_step(self) -> bool {
        matches!(self, SamplerKind::Lcm | SamplerKind::Tcd)
    }

    pub fn cli_name(self) -> &'static str {
        match self {
            SamplerKind::Ddim => "ddim",
            SamplerKind::Ddpm => "ddpm",
            SamplerKind::Euler => "euler",
            SamplerKind::EulerAncestral => "euler_a",
            SamplerKind::Heun => "heun",
            SamplerKind::DpmPP2M => "dpmpp_2m",
            SamplerKind::DpmPP2MKarras => "dpmpp_2m_karras",
            SamplerKind::DpmPP2MSde => "dpmpp_2m_sde",
            SamplerKind::UniPc => "unipc",
            SamplerKind::Lcm => "lcm",
            SamplerKind::Tcd => "tcd",
        }
    }

    /// Parses a `--sampler` name.
    pub fn parse(name: &str) -> Result<Self, RunError> {
        Self::ALL.iter().copied().find(|k| k.cli_name() == name).ok_or_else(|| {
            let known: Vec<&str> = Self::ALL.iter().map(|k| k.cli_name()).collect();
            RunError::Invalid(format!("unknown sampler `{name}` (known: {})", known.join(", ")))
        })
    }

    /// The sampler a model's own `scheduler_config.json` asks for (its
    /// diffusers `_class_name`, and for DPM-Solver its `algorithm_type` and
    /// `use_karras_sigmas`).
    pub fn from_config(cfg: &ScheduleConfig) -> Result<Self, RunError> {
        Ok(match cfg.class_name.as_deref() {
            None | Some("DDIMScheduler") => SamplerKind::Ddim,
            // PNDM (SD 1.5's shipped default) is not offered; DDIM is the standard
            // substitute and converges to the same images at typical step counts.
            Some("PNDMScheduler") => {
                tracing::info!("the model ships PNDMScheduler; using DDIM");
                SamplerKind::Ddim
            }
            Some("DDPMScheduler") => SamplerKind::Ddpm,
            Some("EulerDiscreteScheduler") => SamplerKind::Euler,
            Some("EulerAncestralDiscreteScheduler") => SamplerKind::EulerAncestral,
            Some("HeunDiscreteScheduler") => SamplerKind::Heun,
            Some("UniPCMultistepScheduler") => SamplerKind::UniPc,
            Some("LCMScheduler") => SamplerKind::Lcm,
            Some("TCDScheduler") => SamplerKind::Tcd,
            Some("DPMSolverMultistepScheduler") => {
                let c = cfg.options();
                let karras = c.bool("use_karras_sigmas", false)?;
                match (c.string("algorithm_type")?.as_deref(), karras) {
                    (None | Some("dpmsolver++"), false) => SamplerKind::DpmPP2M,
                    (None | Some("dpmsolver++"), true) => SamplerKind::DpmPP2MKarras,
                    (Some("sde-dpmsolver++"), false) => SamplerKind::DpmPP2MSde,
                    (Some("sde-dpmsolver++"), true) => {
                        return Err(c
                            .error(
                                "use_karras_sigmas",
                                "SDE-DPM-Solver++ on Karras sigmas is not offered; choose --sampler dpmpp_2m_sde or \
                                 dpmpp_2m_karras",
                            )
                            .into())
                    }
                    (Some(other), _) => {
                        return Err(c
                            .error(
                                "algorithm_type",
                                format!(
                                    "`{other}` is not supported by brume (supported: dpmsolver++, sde-dpmsolver++); \
                                     choose one with --sampler"
                                ),
                            )
                            .into())
                    }
                }
            }
            Some(other) => {
                return Err(RunError::Invalid(format!(
                    "{}: scheduler class `{other}` is not supported; choose one with --sampler",
                    cfg.path.display()
                )))
            }
        })
    }
}

/// Builds `kind` over the model's schedule for `steps` steps.
///
/// `eta` is what diffusers pipelines pass as `eta` to `step`: DDIM's noise
/// weight and TCD's gamma (diffusers' `StableDiffusionPipeline` passes 0.0 by
/// default, which makes TCD deterministic; TCD's authors suggest 0.3, see
/// [`tcd::DEFAULT_GAMMA`]). The other samplers ignore it. For DPM-Solver the
/// kind decides Karras sigmas and the SDE variant, whatever the config's own
/// `use_karras_sigmas` / `algorithm_type` say; every other option comes from
/// the config.
pub fn build(kind: SamplerKind, cfg: &ScheduleConfig, steps: usize, eta: f64) -> Result<Box<dyn Sampler>, RunError> {
    if steps == 0 {
        return Err(RunError::Invalid("steps must be at least 1".into()));
    }
    let dpm = |algorithm, karras| DpmVariant { algorithm, karras };
    let sampler: Box<dyn Sampler> = match kind {
        SamplerKind::Ddim => Box::new(Ddim::new(cfg, steps, eta)),
        SamplerKind::Ddpm => Box::new(Ddpm::new(cfg, steps)?),
        SamplerKind::Euler => Box::new(Euler::new(cfg, steps, None)?),
        SamplerKind::EulerAncestral => Box::new(EulerAncestral::new(cfg, steps)?),
        SamplerKind::Heun => Box::new(Heun::new(cfg, steps)?),
        SamplerKind::DpmPP2M => Box::new(DpmSolver::new(cfg, steps, dpm(DpmAlgorithm::DpmSolverPP, false))?),
        SamplerKind::DpmPP2MKarras => Box::new(DpmSolver::new(cfg, steps, dpm(DpmAlgorithm::DpmSolverPP, true))?),
        SamplerKind::DpmPP2MSde => Box::new(DpmSolver::new(cfg, steps, dpm(DpmAlgorithm::SdeDpmSolverPP, false))?),
        SamplerKind::UniPc => Box::new(UniPc::new(cfg, steps)?),
        SamplerKind::Lcm => Box::new(Lcm::new(cfg, steps)?),
        SamplerKind::Tcd => Box::new(Tcd::new(cfg, steps, eta)?),
    };
    // Every timestep must index the training schedule: a config's steps_offset
    // (or spacing) can push the first past it, where samplers would read a
    // neighbouring alpha (a wrong picture) or out of bounds (a panic).
    let n = cfg.num_train_timesteps as f64;
    if let Some(&t) = sampler.timesteps().iter().find(|t| !(t.is_finite() && **t >= 0.0 && **t < n)) {
        return Err(RunError::Invalid(format!(
            "{}: {steps} steps of {} give timestep {t}, outside the schedule's 0..{} (steps_offset {}, {:?} spacing); \
             use fewer steps or fix the config",
            cfg.path.display(),
            kind.cli_name(),
            cfg.num_train_timesteps,
            cfg.steps_offset,
            cfg.timestep_spacing
        )));
    }
    if sampler.timesteps().is_empty() {
        return Err(RunError::Invalid(format!("{}: {steps} steps of {} give no timestep", cfg.path.display(), kind.cli_name())));
    }
    Ok(sampler)
}
