//! Latents to pixels with the VAE decoder segment (loaded, run, dropped).

use candle_core::{DType, Tensor};

use super::denoise::RunOptions;
use super::model::SdModel;
use super::request::{Flow, Progress, ProgressFn};
use crate::error::{Result, RunError};
use crate::loading::Segment;

/// Decodes scaled latents [B, C, h, w] to images in [0, 1], as diffusers'
/// pipelines do (`latents / scaling_factor + shift_factor`, then `x / 2 + 0.5` clamped).
pub fn decode(model: &SdModel, latents: &Tensor, opts: &RunOptions, progress: ProgressFn) -> Result<Tensor> {
    let dec = model.vae_decoder(&opts.device, opts.dtype)?;
    if progress(&Progress::Loaded(Segment::VaeDecoder)) == Flow::Cancel {
        return Err(RunError::Cancelled);
    }
    let z = ((latents / model.vae_config.scaling_factor())? + model.vae_config.shift_factor())?;
    let img = dec.decode(&z.to_dtype(opts.dtype)?)?.to_dtype(DType::F32)?;
    Ok(((img / 2.0)? + 0.5)?.clamp(0f32, 1f32)?)
}
