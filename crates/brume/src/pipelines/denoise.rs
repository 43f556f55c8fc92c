//! The denoising loop every pipeline shares: guidance, the sampler's calling
//! convention, inpainting's extra inputs, progress and cancellation.

use candle_core::{DType, Device, Tensor};

use super::conditioning::Conditioning;
use super::model::SdModel;
use crate::loading::Segment;
use super::request::{Flow, Progress, ProgressFn};
use crate::error::{Result, RunError};
use std::rc::Rc;

use crate::memory::{Branches, Checkpoint, Guard, Residency, Strategy};
use crate::models::attention::{CrossContext, KvCache};
use crate::models::UNet2DConditionModel;
use crate::samplers::{NoiseSource, Sampler};

/// How a pipeline runs, independent of what it is asked for.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub device: Device,
    /// Compute dtype of the models.
    pub dtype: DType,
    /// Reuse cross-attention keys/values across steps (the conditioning cache).
    /// Off only to measure what it saves: results are identical either way.
    pub reuse_kv: bool,
    /// How the run trades speed or quality for memory (the plan's strategy).
    pub strategy: Strategy,
    /// Re-checks the budget before each segment and step; its strategy, which
    /// may fall back during the run, overrides `strategy` when present.
    pub guard: Option<Rc<Guard>>,
}

impl RunOptions {
    /// The strategy in force now.
    pub fn strategy(&self) -> Strategy {
        self.guard.as_ref().map(|g| g.strategy()).unwrap_or(self.strategy)
    }

    /// Checks headroom at `at` (a no-op without a guard).
    pub fn check(&self, at: Checkpoint) -> Result<Strategy> {
        match &self.guard {
            Some(g) => Ok(g.check(at)?),
            None => Ok(self.strategy),
        }
    }

    /// Called once a segment's modules are dropped: under sequential residency
    /// its mapped pages go back to the OS.
    pub fn done_with(&self, model: &SdModel, seg: Segment) {
        if self.strategy().residency == Residency::Sequential {
            model.release(seg);
        }
    }
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            device: crate::runtime::default_device(),
            dtype: DType::F32,
            reuse_kv: true,
            strategy: Strategy { residency: Residency::Sequential, ..Strategy::PLAIN },
            guard: None,
        }
    }
}

/// Loads the UNet segment (dropped by the caller when the loop is done).
pub fn load_unet(model: &SdModel, opts: &RunOptions, progress: ProgressFn) -> Result<UNet2DConditionModel> {
    opts.check(Checkpoint::BeforeSegment(Segment::Unet))?;
    let unet = model.unet(&opts.device, opts.dtype)?;
    if progress(&Progress::Loaded(Segment::Unet)) == Flow::Cancel {
        return Err(RunError::Cancelled);
    }
    Ok(unet)
}

/// What inpainting adds to each step.
pub enum Inpainting {
    /// 9-channel UNets: [latents, mask, masked-image latents] as input.
    Concat { mask: Tensor, masked_image_latents: Tensor },
    /// Ordinary UNets: outside the mask, the original re-noised to the next
    /// step's level replaces the sample after every step.
    Blend { image_latents: Tensor, mask: Tensor, noise: Tensor },
}

/// Runs evaluations `start..` of `sampler` from `latents`.
#[allow(clippy::too_many_arguments)]
pub fn denoise(
    unet: &UNet2DConditionModel,
    cond: &Conditioning,
    guidance_scale: f64,
    sampler: &mut dyn Sampler,
    mut latents: Tensor,
    start: usize,
    inpainting: Option<&Inpainting>,
    noise: &mut dyn NoiseSource,
    opts: &RunOptions,
    progress: ProgressFn,
) -> Result<Tensor> {
    let dtype = opts.dtype;
    let batch = latents.dim(0)?;
    let timestep_cond = match unet.config().time_cond_proj_dim {
        Some(d) => Some(
            crate::models::embeddings::guidance_scale_embedding(&vec![(guidance_scale - 1.0) as f32; batch], d, &opts.device)?
                .to_dtype(dtype)?,
        ),
        None => None,
    };
    let mut ctx = CrossContext {
        hidden: &cond.context,
        cache: opts.reuse_kv.then_some(&cond.kv),
        attention: opts.strategy().attention,
    };
    let timesteps = sampler.timesteps().to_vec();
    let total = timesteps.len();
    if start >= total {
        return Err(RunError::Invalid(format!(
            "no denoising step left to run (start {start} of {total}); raise the strength or the steps"
        )));
    }
    let double = |t: &Tensor| -> Result<Tensor> {
        Ok(if cond.guided { Tensor::cat(&[t, t], 0)? } else { t.clone() })
    };
    let (concat_mask, concat_masked) = match inpainting {
        Some(Inpainting::Concat { mask, masked_image_latents }) => (Some(double(mask)?), Some(double(masked_image_latents)?)),
        _ => (None, None),
    };
    // Guidance branches one at a time: each half of the conditioning with its own
    // K/V cache (the conditioning's cache holds both halves' projections as one).
    let halves = if cond.guided {
        Some([cond.context.narrow(0, 0, batch)?, cond.context.narrow(0, batch, batch)?])
    } else {
        None
    };
    let half_kv = [KvCache::new(), KvCache::new()];
    for (i, &t) in timesteps.iter().enumerate().skip(start) {
        let now = opts.check(Checkpoint::BeforeStep(i + 1 - start))?;
        ctx.attention = now.attention;
        let scaled = sampler.scale_model_input(&latents, i)?;
        let mut input = double(&scaled)?;
        if let (Some(m), Some(mi)) = (&concat_mask, &concat_masked) {
            input = Tensor::cat(&[&input, m, mi], 1)?;
        }
        let input = input.to_dtype(dtype)?;
        let out = match &halves {
            Some(halves) if now.branches == Branches::OneAtATime => {
                let mut outs = Vec::with_capacity(2);
                for (b, (hidden, kv)) in halves.iter().zip(&half_kv).enumerate() {
                    let half = CrossContext { hidden, cache: opts.reuse_kv.then_some(kv), attention: ctx.attention };
                    let x = input.narrow(0, b * batch, batch)?;
                    outs.push(unet.forward_with(&x, &[t as f32], &half, timestep_cond.as_ref())?.to_dtype(DType::F32)?);
                }
                Tensor::cat(&outs, 0)?
            }
            _ => unet.forward_with(&input, &[t as f32], &ctx, timestep_cond.as_ref())?.to_dtype(DType::F32)?,
        };
        ensure_finite(&out, || {
            format!(
                "the UNet's output is not finite (NaN or infinity) at step {} of {}: its weights may hold non-finite \
                 numbers, or its inputs overflowed",
                i + 1 - start,
                total - start
            )
        })?;
        let noise_pred = if cond.guided {
            let uncond = out.narrow(0, 0, batch)?;
            let text = out.narrow(0, batch, batch)?;
            (&uncond + ((text - &uncond)? * guidance_scale)?)?
        } else {
            out
        };
        latents = sampler.step(&noise_pred, i, &latents, noise)?;
        if let Some(Inpainting::Blend { image_latents, mask, noise: n }) = inpainting {
            let proper = if i + 1 < total {
                sampler.add_noise(image_latents, n, i + 1)?
            } else {
                image_latents.clone()
            };
            let keep = (mask.ones_like()? - mask)?;
            latents = (proper.broadcast_mul(&keep)? + latents.broadcast_mul(mask)?)?;
        }
        ensure_finite(&latents, || {
            format!(
                "the latents stopped being finite numbers at step {} of {} (guidance scale {guidance_scale}): the \
                 guidance scale, eta or the scheduler config's numbers are out of a workable range",
                i + 1 - start,
                total - start
            )
        })?;
        let p = Progress::Step {
            index: i + 1 - start,
            total: total - start,
            latents: latents.clone(),
        };
        if progress(&p) == Flow::Cancel {
            return Err(RunError::Cancelled);
        }
    }
    Ok(latents)
}

/// Fails with `why()` unless every value of `t` is finite. One reduction (the
/// sum is finite exactly when no value is NaN or infinite, short of an overflow
/// that is itself a failure): cheap next to a UNet evaluation, and it turns a
/// black picture reported as success into an error that names the cause.
pub fn ensure_finite(t: &Tensor, why: impl FnOnce() -> String) -> Result<()> {
    let sum = t.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
    if sum.is_finite() {
        Ok(())
    } else {
        Err(RunError::Invalid(why()))
    }
}
