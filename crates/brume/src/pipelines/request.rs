//! What a person asks for, what they get back, and how progress is reported.

use candle_core::Tensor;

use super::model::SdModel;
use crate::error::{Result, RunError};
use crate::loading::Segment;
use crate::samplers::{RngKind, SamplerKind};

/// Everything that determines a generation, whatever the pipeline.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    pub prompt: String,
    /// `None` is diffusers' default: the empty prompt as the unconditional branch.
    pub negative_prompt: Option<String>,
    pub steps: usize,
    /// Classifier-free guidance; <= 1 disables it (one UNet pass per step). For
    /// LCM-distilled UNets it is fed to the UNet as the w-embedding instead.
    pub guidance_scale: f64,
    pub width: usize,
    pub height: usize,
    pub seed: u64,
    /// Which generator turns the seed into noise.
    pub rng: RngKind,
    pub eta: f64,
    /// Text-encoder layers to skip at the end (diffusers' `clip_skip`).
    pub clip_skip: usize,
    /// `None`: the sampler the model's scheduler config names.
    pub sampler: Option<SamplerKind>,
    /// Images per run; they share the prompt encoding and draw consecutive noise.
    pub batch: usize,
}

impl GenerationRequest {
    /// A request with diffusers' defaults for everything but the prompt.
    pub fn new(prompt: impl Into<String>, size: usize) -> Self {
        Self {
            prompt: prompt.into(),
            negative_prompt: None,
            steps: 20,
            guidance_scale: 7.5,
            width: size,
            height: size,
            seed: 0,
            rng: RngKind::Brume,
            eta: 0.0,
            clip_skip: 0,
            sampler: None,
            batch: 1,
        }
    }

    /// The sampler to use: the requested one, else the model's own.
    pub fn sampler_kind(&self, model: &SdModel) -> Result<SamplerKind> {
        model.sampler_kind(self.sampler)
    }

    /// The sampler configured over the model's schedule for these steps.
    pub fn build_sampler(&self, model: &SdModel) -> Result<Box<dyn crate::samplers::Sampler>> {
        let kind = self.sampler_kind(model)?;
        if let Some(w) = model.sampler_mismatch(kind) {
            tracing::warn!("{w}");
        }
        crate::samplers::build(kind, &model.schedule, self.steps, self.eta)
    }

    /// Whether the unconditional branch runs (diffusers' `do_classifier_free_guidance`).
    pub fn guided(&self, model: &SdModel) -> bool {
        self.guidance_scale > 1.0 && model.unet_config.time_cond_proj_dim.is_none()
    }

    /// Checks what the model can honour before anything heavy is loaded.
    pub fn validate(&self, model: &SdModel) -> Result<()> {
        let f = model.vae_config.scale_factor();
        if self.width == 0 || self.height == 0 || self.width % f != 0 || self.height % f != 0 {
            return Err(RunError::Invalid(format!(
                "size {}x{} must be positive multiples of {f} (the VAE factor)",
                self.width, self.height
            )));
        }
        if self.width > 4096 || self.height > 4096 {
            return Err(RunError::Invalid(format!(
                "size {}x{} is over the 4096-pixel limit per side",
                self.width, self.height
            )));
        }
        if self.steps == 0 || self.steps > 1000 {
            return Err(RunError::Invalid(format!("steps must be 1..=1000, got {}", self.steps)));
        }
        if self.batch == 0 || self.batch > 64 {
            return Err(RunError::Invalid(format!("batch must be 1..=64, got {}", self.batch)));
        }
        check_guidance_eta(self.guidance_scale, self.eta)?;
        Ok(())
    }
}

/// Largest guidance scale accepted: samplers' updates scale with it, and far
/// past the tens people use the latents overflow into a black picture.
pub const MAX_GUIDANCE: f64 = 100.0;

/// Guidance in [0, MAX_GUIDANCE] and eta in [0, 1] (DDIM's noise share: above 1
/// its update takes the square root of a negative number), each error naming
/// the number and its range. Shared by the CLI, recipes and the service.
pub fn check_guidance_eta(guidance_scale: f64, eta: f64) -> Result<()> {
    if !(guidance_scale.is_finite() && (0.0..=MAX_GUIDANCE).contains(&guidance_scale)) {
        return Err(RunError::Invalid(format!(
            "guidance scale {guidance_scale} is out of range: it must be 0..={MAX_GUIDANCE} (values <= 1 turn guidance off)"
        )));
    }
    if !(eta.is_finite() && (0.0..=1.0).contains(&eta)) {
        return Err(RunError::Invalid(format!("eta {eta} is out of range: it must be 0..=1 (0 = deterministic)")));
    }
    Ok(())
}

/// Progress reported while a pipeline runs.
#[derive(Debug, Clone)]
pub enum Progress {
    Loaded(Segment),
    /// After denoising step `index` (1-based) of `total`, with the current latents
    /// (for previews).
    Step { index: usize, total: usize, latents: Tensor },
}

/// What a progress callback tells the pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Stop between steps; the pipeline returns [`RunError::Cancelled`].
    Cancel,
}

/// The progress callback: called between steps, off the caller's thread if it likes.
pub type ProgressFn<'a> = &'a mut dyn FnMut(&Progress) -> Flow;

/// The result: images in [0, 1], NCHW, and the final latents (before the VAE scaling is undone).
pub struct Generated {
    pub image: Tensor,
    pub latents: Tensor,
}
