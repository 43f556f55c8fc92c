//! Latents to pixels with the VAE decoder segment (loaded, run, dropped),
//! whole or in blended tiles as the memory plan says.

use candle_core::{DType, Tensor};

use super::denoise::RunOptions;
use super::model::{AnyVaeDecoder, SdModel};
use super::request::{Flow, Progress, ProgressFn};
use super::tiled_decode::decode_tiled;
use crate::error::{Result, RunError};
use crate::loading::Segment;
use crate::memory::{Checkpoint, VaeDecode};

/// Decodes scaled latents [B, C, h, w] to images in [0, 1], as diffusers'
/// pipelines do (`latents / scaling_factor + shift_factor`, then `x / 2 + 0.5` clamped).
pub fn decode(model: &SdModel, latents: &Tensor, opts: &RunOptions, progress: ProgressFn) -> Result<Tensor> {
    let dec = load_decoder(model, opts, progress)?;
    let out = decode_with(&dec, model, latents, opts);
    drop(dec);
    opts.done_with(model, Segment::VaeDecoder);
    out
}

/// Loads the VAE decoder segment (dropped by the caller when done).
pub fn load_decoder(model: &SdModel, opts: &RunOptions, progress: ProgressFn) -> Result<AnyVaeDecoder> {
    opts.check(Checkpoint::BeforeSegment(Segment::VaeDecoder))?;
    let dec = model.vae_decoder(&opts.device, opts.dtype)?;
    if progress(&Progress::Loaded(Segment::VaeDecoder)) == Flow::Cancel {
        return Err(RunError::Cancelled);
    }
    Ok(dec)
}

/// [`decode`] with a decoder already loaded.
pub fn decode_with(dec: &AnyVaeDecoder, model: &SdModel, latents: &Tensor, opts: &RunOptions) -> Result<Tensor> {
    let z = ((latents / model.vae_config.scaling_factor())? + model.vae_config.shift_factor())?.to_dtype(opts.dtype)?;
    let img = match opts.strategy().vae {
        VaeDecode::Full => dec.decode(&z)?.to_dtype(DType::F32)?,
        VaeDecode::Tiled(spec) => decode_tiled(dec, &z, spec, model.vae_config.scale_factor())?,
    };
    super::denoise::ensure_finite(&img, || {
        "the VAE decoder's pixels are not finite (NaN or infinity): its weights may hold non-finite numbers, or the \
         latents were out of range"
            .to_string()
    })?;
    Ok(((img / 2.0)? + 0.5)?.clamp(0f32, 1f32)?)
}
