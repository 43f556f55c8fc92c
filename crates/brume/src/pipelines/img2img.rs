//! Image to image (style transfer): the input image's latents, noised to the
//! level `strength` picks, are denoised under the prompt.

use candle_core::Tensor;

use super::conditioning::{conditioning, ConditioningCache};
use super::decode::decode;
use super::denoise::{denoise, load_unet, RunOptions};
use super::model::{AnyVaeEncoder, SdModel};
use super::request::{Flow, GenerationRequest, Generated, Progress, ProgressFn};
use crate::error::{Result, RunError};
use crate::loading::Segment;
use crate::samplers::{Lcm, NoiseSource, Sampler, SamplerKind};

/// The first evaluation index for `strength`, as diffusers' `get_timesteps`:
/// `steps * strength` steps run (rounded down), ending at the last timestep.
pub fn start_index(steps: usize, strength: f64, order: usize) -> Result<usize> {
    check_strength(strength)?;
    let init = ((steps as f64 * strength) as usize).min(steps);
    if init == 0 {
        return Err(RunError::Invalid(format!(
            "strength {strength} with {steps} steps runs no denoising step; raise one of them"
        )));
    }
    Ok((steps - init) * order)
}

/// Whether `strength` is one img2img and inpainting take: in (0, 1]. One rule for the
/// pipelines, a model's `sampling_defaults.json` and the CLI's flags (each names its own
/// source in its error); NaN is refused.
pub fn strength_in_range(strength: f64) -> bool {
    strength > 0.0 && strength <= 1.0
}

fn check_strength(strength: f64) -> Result<()> {
    if strength_in_range(strength) {
        Ok(())
    } else {
        Err(RunError::Invalid(format!("strength must be in (0, 1], got {strength}")))
    }
}

/// The sampler and the first step to run for `strength`, as diffusers' pipeline for this
/// folder does it. Stable Diffusion's img2img pipelines build the full schedule and skip its
/// first steps ([`start_index`]); a `LatentConsistencyModelPipeline` folder's img2img
/// (`LatentConsistencyModelImg2ImgPipeline`) instead hands strength to `LCMScheduler`, which
/// spreads all the steps below timestep ~1000 x strength. The same UNet and strength start
/// from different noise levels under the two (4 steps at 0.6: 2 steps from 499, or 4 from
/// 599), so a folder gets its own pipeline's rule.
pub fn schedule(model: &SdModel, req: &GenerationRequest, strength: f64) -> Result<(Box<dyn Sampler>, usize)> {
    let kind = req.sampler_kind(model)?;
    if kind == SamplerKind::Lcm && model.is_lcm_pipeline() {
        check_strength(strength)?;
        if req.steps == 0 {
            return Err(RunError::Invalid("steps must be at least 1".into()));
        }
        return Ok((Box::new(Lcm::within(&model.schedule, req.steps, strength)?), 0));
    }
    let sampler = req.build_sampler(model)?;
    let start = start_index(req.steps, strength, sampler.order())?;
    Ok((sampler, start))
}

/// Loads the VAE encoder segment (it is dropped by the caller when done).
pub fn load_encoder(model: &SdModel, opts: &RunOptions, progress: ProgressFn) -> Result<AnyVaeEncoder> {
    opts.check(crate::memory::Checkpoint::BeforeSegment(Segment::VaeEncoder))?;
    let enc = model.vae_encoder(&opts.device, opts.dtype)?;
    if progress(&Progress::Loaded(Segment::VaeEncoder)) == Flow::Cancel {
        return Err(RunError::Cancelled);
    }
    Ok(enc)
}

/// Scaled latents of `image` ([1, 3, H, W] in [-1, 1]), repeated for the batch,
/// drawing the KL VAE's sample from `noise` as diffusers does.
pub fn encode_image(
    model: &SdModel,
    enc: &AnyVaeEncoder,
    image: &Tensor,
    batch: usize,
    opts: &RunOptions,
    noise: &mut dyn NoiseSource,
) -> Result<Tensor> {
    let z = enc.sample_latents(&image.to_dtype(opts.dtype)?, noise)?.to_dtype(candle_core::DType::F32)?;
    let z = ((z - model.vae_config.shift_factor())? * model.vae_config.scaling_factor())?;
    super::denoise::ensure_finite(&z, || {
        "the VAE encoder's latents are not finite (NaN or infinity): its weights may hold non-finite numbers".to_string()
    })?;
    Ok(Tensor::cat(&vec![&z; batch], 0)?)
}

/// Runs img2img on `image` ([1, 3, H, W] in [-1, 1], H and W multiples of the VAE factor).
/// Random draws, in diffusers' order: the VAE latent sample, the added noise, then the sampler's.
#[allow(clippy::too_many_arguments)]
pub fn img2img(
    model: &SdModel,
    req: &GenerationRequest,
    image: &Tensor,
    strength: f64,
    opts: &RunOptions,
    noise: &mut dyn NoiseSource,
    cache: Option<&mut ConditioningCache>,
    progress: ProgressFn,
) -> Result<Generated> {
    let (_, _, h, w) = image.dims4()?;
    let req = GenerationRequest {
        width: w,
        height: h,
        ..req.clone()
    };
    req.validate(model)?;
    if model.unet_config.in_channels != model.vae_config.latent_channels() {
        return Err(RunError::Invalid("an inpainting UNet needs a mask: use inpainting".into()));
    }
    opts.check(crate::memory::Checkpoint::BeforeSegment(crate::loading::Segment::TextEncoder))?;
    let cond = conditioning(model, &req, &opts.device, opts.dtype, cache, progress)?;
    opts.done_with(model, crate::loading::Segment::TextEncoder);
    let (mut sampler, start) = schedule(model, &req, strength)?;
    let init_latents = {
        let enc = load_encoder(model, opts, progress)?;
        encode_image(model, &enc, image, req.batch, opts, noise)?
    };
    opts.done_with(model, Segment::VaeEncoder);
    let n = noise.randn(init_latents.dims(), &opts.device)?;
    let latents = sampler.add_noise(&init_latents, &n, start)?;
    let latents = {
        let unet = load_unet(model, opts, progress)?;
        denoise(&unet, &cond, req.guidance_scale, sampler.as_mut(), latents, start, None, noise, opts, progress)?
    };
    opts.done_with(model, crate::loading::Segment::Unet);
    let image = decode(model, &latents, opts, progress)?;
    Ok(Generated { image, latents })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strength_to_start_index_matches_diffusers() {
        assert_eq!(start_index(10, 0.6, 1).unwrap(), 4);
        assert_eq!(start_index(2, 0.5, 1).unwrap(), 1);
        assert_eq!(start_index(50, 1.0, 1).unwrap(), 0);
        assert_eq!(start_index(10, 0.6, 2).unwrap(), 8);
        assert!(start_index(3, 0.2, 1).is_err());
        assert!(start_index(3, 1.5, 1).is_err());
        assert!(start_index(3, 0.0, 1).is_err());
    }
}
