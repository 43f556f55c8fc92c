//! Text to image: encode the prompt, denoise with classifier-free guidance,
//! decode. Segments are loaded one after another and dropped when done, so the
//! peak holds one segment's weights, not all of them.

use candle_core::{DType, Device, Tensor};

use super::model::SdModel;
use crate::error::{Result, RunError};
use crate::samplers::{self, Rng, SamplerKind};

/// Everything that determines a txt2img result.
#[derive(Debug, Clone)]
pub struct Txt2ImgRequest {
    pub prompt: String,
    /// `None` is diffusers' default: the empty prompt as the unconditional branch.
    pub negative_prompt: Option<String>,
    pub steps: usize,
    pub guidance_scale: f64,
    pub width: usize,
    pub height: usize,
    pub seed: u64,
    pub eta: f64,
    /// Text-encoder layers to skip at the end (diffusers' `clip_skip`).
    pub clip_skip: usize,
    /// `None`: the sampler the model's scheduler config names.
    pub sampler: Option<SamplerKind>,
}

/// Progress reported between denoising steps.
#[derive(Debug, Clone, Copy)]
pub enum Progress {
    Loaded(crate::loading::Segment),
    Step { index: usize, total: usize },
}

/// The result: the image in [0, 1], NCHW, and the final latents (unscaled by the VAE factor).
pub struct Generated {
    pub image: Tensor,
    pub latents: Tensor,
}

impl Txt2ImgRequest {
    /// Checks what a UNet/VAE pair can honour before anything heavy is loaded.
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
        if !self.guidance_scale.is_finite() {
            return Err(RunError::Invalid("guidance scale must be a finite number".into()));
        }
        if model.unet_config.in_channels != model.vae_config.latent_channels() {
            return Err(RunError::Invalid(
                "this is an inpainting UNet (9 input channels); it needs an image and a mask".into(),
            ));
        }
        Ok(())
    }
}

/// Encodes `prompt` to the text encoder's hidden states [1, 77, hidden].
pub fn encode_prompt(
    model: &SdModel,
    text_encoder: &crate::models::ClipTextModel,
    prompt: &str,
    clip_skip: usize,
    device: &Device,
) -> Result<Tensor> {
    let ids = model.tokenizer.encode_padded(prompt);
    let ids = Tensor::from_vec(ids.clone(), (1, ids.len()), device)?;
    Ok(text_encoder.forward(&ids, clip_skip)?.hidden)
}

/// Runs txt2img. `initial_latents`, when given, replace the seeded noise (parity tests).
pub fn txt2img(
    model: &SdModel,
    req: &Txt2ImgRequest,
    device: &Device,
    dtype: DType,
    initial_latents: Option<&Tensor>,
    progress: &mut dyn FnMut(Progress),
) -> Result<Generated> {
    req.validate(model)?;
    let guided = req.guidance_scale > 1.0 && model.unet_config.time_cond_proj_dim.is_none();

    // Text encoder: load, run, drop.
    let context = {
        let te = model.text_encoder(device, dtype)?;
        progress(Progress::Loaded(crate::loading::Segment::TextEncoder));
        let cond = encode_prompt(model, &te, &req.prompt, req.clip_skip, device)?;
        if guided {
            let neg = req.negative_prompt.as_deref().unwrap_or("");
            let uncond = encode_prompt(model, &te, neg, req.clip_skip, device)?;
            Tensor::cat(&[&uncond, &cond], 0)?
        } else {
            cond
        }
    };

    let kind = match req.sampler {
        Some(k) => k,
        None => SamplerKind::from_config(&model.schedule)?,
    };
    let mut sampler = samplers::build(kind, &model.schedule, req.steps, req.eta)?;
    let f = model.vae_config.scale_factor();
    let shape = [1, model.vae_config.latent_channels(), req.height / f, req.width / f];
    let mut rng = Rng::new(req.seed);
    let mut latents = match initial_latents {
        Some(l) => {
            if l.dims() != shape {
                return Err(RunError::Invalid(format!("initial latents have shape {:?}, expected {shape:?}", l.dims())));
            }
            l.to_dtype(DType::F32)?
        }
        None => (rng.randn(&shape, device)? * sampler.init_noise_sigma())?,
    };

    // UNet: load, denoise, drop.
    {
        let unet = model.unet(device, dtype)?;
        progress(Progress::Loaded(crate::loading::Segment::Unet));
        let cond_embed = match model.unet_config.time_cond_proj_dim {
            Some(d) => Some(crate::models::embeddings::guidance_scale_embedding(
                &[(req.guidance_scale - 1.0) as f32],
                d,
                device,
            )?),
            None => None,
        };
        let timesteps = sampler.timesteps().to_vec();
        let total = timesteps.len();
        for (i, &t) in timesteps.iter().enumerate() {
            let scaled = sampler.scale_model_input(&latents, i)?;
            let input = if guided { Tensor::cat(&[&scaled, &scaled], 0)? } else { scaled };
            let out = unet
                .forward(&input.to_dtype(dtype)?, &[t as f32], &context, cond_embed.as_ref())?
                .to_dtype(DType::F32)?;
            let noise_pred = if guided {
                let uncond = out.get(0)?.unsqueeze(0)?;
                let text = out.get(1)?.unsqueeze(0)?;
                (&uncond + ((text - &uncond)? * req.guidance_scale)?)?
            } else {
                out
            };
            latents = sampler.step(&noise_pred, i, &latents, &mut rng)?;
            progress(Progress::Step { index: i + 1, total });
        }
    }

    // VAE decoder: load, decode, drop.
    let image = {
        let dec = model.vae_decoder(device, dtype)?;
        progress(Progress::Loaded(crate::loading::Segment::VaeDecoder));
        let z = ((&latents / model.vae_config.scaling_factor())? + model.vae_config.shift_factor())?;
        let img = dec.decode(&z.to_dtype(dtype)?)?.to_dtype(DType::F32)?;
        ((img / 2.0)? + 0.5)?.clamp(0f32, 1f32)?
    };
    Ok(Generated { image, latents })
}
