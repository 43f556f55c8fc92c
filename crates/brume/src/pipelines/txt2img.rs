//! Text to image: encode the prompt, denoise from noise, decode. Under the
//! sequential residency (the default) segments load one after another and drop
//! when done, so the peak holds one segment's weights; all-resident loads the
//! UNet and VAE decoder first and keeps every page until the end.

use candle_core::Tensor;

use super::conditioning::{conditioning, ConditioningCache};
use super::decode::{decode, decode_with, load_decoder};
use super::denoise::{denoise, load_unet, RunOptions};
use super::model::SdModel;
use super::request::{GenerationRequest, Generated, ProgressFn};
use crate::error::{Result, RunError};
use crate::loading::Segment;
use crate::memory::{Checkpoint, Residency};
use crate::samplers::NoiseSource;

/// Runs txt2img, drawing every random number from `noise` in diffusers' order
/// (initial latents first, then whatever the sampler draws).
pub fn txt2img(
    model: &SdModel,
    req: &GenerationRequest,
    opts: &RunOptions,
    noise: &mut dyn NoiseSource,
    cache: Option<&mut ConditioningCache>,
    progress: ProgressFn,
) -> Result<Generated> {
    req.validate(model)?;
    if model.unet_config.in_channels != model.vae_config.latent_channels() {
        return Err(RunError::Invalid(
            "this is an inpainting UNet (9 input channels): use `brume edit` with an image and a mask".into(),
        ));
    }
    let resident = match opts.strategy().residency {
        Residency::AllResident => Some((load_unet(model, opts, progress)?, load_decoder(model, opts, progress)?)),
        Residency::Sequential => None,
    };
    opts.check(Checkpoint::BeforeSegment(Segment::TextEncoder))?;
    let cond = conditioning(model, req, &opts.device, opts.dtype, cache, progress)?;
    opts.done_with(model, Segment::TextEncoder);
    let mut sampler = req.build_sampler(model)?;
    let f = model.vae_config.scale_factor();
    let shape = [req.batch, model.vae_config.latent_channels(), req.height / f, req.width / f];
    let latents: Tensor = (noise.randn(&shape, &opts.device)? * sampler.init_noise_sigma())?;
    if let Some((unet, dec)) = &resident {
        let latents = denoise(unet, &cond, req.guidance_scale, sampler.as_mut(), latents, 0, None, noise, opts, progress)?;
        let image = decode_with(dec, model, &latents, opts)?;
        return Ok(Generated { image, latents });
    }
    let latents = {
        let unet = load_unet(model, opts, progress)?;
        denoise(&unet, &cond, req.guidance_scale, sampler.as_mut(), latents, 0, None, noise, opts, progress)?
    };
    opts.done_with(model, Segment::Unet);
    let image = decode(model, &latents, opts, progress)?;
    Ok(Generated { image, latents })
}

