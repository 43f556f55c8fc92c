//! One img2img per frame with everything resident: the VAE encoder, the UNet and the
//! VAE decoder are loaded once, the prompt's conditioning (text encoder output and the
//! cross-attention K/V cache) is computed once per prompt, and the noise is the same
//! for every frame, so a frame that did not change gives the same picture.

use std::rc::Rc;
use std::time::Instant;

use brume::models::UNet2DConditionModel;
use brume::pipelines::conditioning::{conditioning, Conditioning, ConditioningCache};
use brume::pipelines::decode::{decode_with, load_decoder};
use brume::pipelines::denoise::{denoise, load_unet, RunOptions};
use brume::pipelines::image_io::{rgb_to_tensor, to_rgb8};
use brume::pipelines::img2img::{load_encoder, schedule, strength_in_range};
use brume::pipelines::{AnyVaeDecoder, AnyVaeEncoder, Flow, GenerationRequest, SdModel};
use brume::samplers::Rng;
use candle_core::Tensor;
use image::RgbImage;

use crate::error::{LiveError, Result};
use crate::pipeline::{Diffuse, Diffused};
use crate::techniques::{signed_pixels, SimilarityFilter, Techniques};

/// What each frame's img2img does.
#[derive(Debug, Clone)]
pub struct DiffuserConfig {
    pub prompt: String,
    pub negative_prompt: Option<String>,
    /// `None`: the model's own (its `sampling_defaults.json`).
    pub guidance: Option<f64>,
    /// Denoising steps (LCM: all of them run, below timestep ~1000 x strength).
    pub steps: usize,
    pub strength: f64,
    /// Seed of the stream's one fixed noise.
    pub seed: u64,
    pub techniques: Techniques,
    /// Share of the previous frame's result latent blended into the next start (0.3 as the Core ML port).
    pub blend: f64,
    /// Similarity filter: cosine threshold and most skips in a row (StreamDiffusion: 0.98, 10).
    pub similarity_threshold: f32,
    pub max_skips: usize,
}

impl DiffuserConfig {
    pub fn new(prompt: impl Into<String>) -> Self {
        Self {
            prompt: prompt.into(),
            negative_prompt: None,
            guidance: None,
            steps: 1,
            strength: 0.5,
            seed: 0,
            techniques: Techniques::NONE,
            blend: 0.3,
            similarity_threshold: 0.98,
            max_skips: 10,
        }
    }

    pub fn check(&self) -> Result<()> {
        if !strength_in_range(self.strength) {
            return Err(LiveError::Invalid(format!("strength must be in (0, 1], got {}", self.strength)));
        }
        if self.steps == 0 || self.steps > 50 {
            return Err(LiveError::Invalid(format!("steps must be 1..=50 for live diffusion, got {}", self.steps)));
        }
        if !(0.0..1.0).contains(&self.blend) {
            return Err(LiveError::Invalid(format!("latent blend must be in [0, 1), got {}", self.blend)));
        }
        if !(self.similarity_threshold > 0.0 && self.similarity_threshold <= 1.0) {
            return Err(LiveError::Invalid(format!("similarity threshold must be in (0, 1], got {}", self.similarity_threshold)));
        }
        Ok(())
    }
}

/// Per-frame img2img with every segment resident. Not `Send` (the conditioning's K/V
/// cache is per thread): build it on the thread that runs it.
pub struct FrameDiffuser {
    model: SdModel,
    opts: RunOptions,
    enc: AnyVaeEncoder,
    unet: UNet2DConditionModel,
    dec: AnyVaeDecoder,
    cache: ConditioningCache,
    cond: Rc<Conditioning>,
    req: GenerationRequest,
    cfg: DiffuserConfig,
    /// The stream's fixed noise, for the current latent shape.
    noise: Option<Tensor>,
    prev_latent: Option<Tensor>,
    last: Option<RgbImage>,
    filter: SimilarityFilter,
    /// Working width when lower than the frames' (a governor's choice).
    width: Option<u32>,
    /// Time the text encoder took for the current prompt.
    pub prompt_ms: f64,
}

impl FrameDiffuser {
    /// Loads every segment and encodes the prompt once.
    pub fn new(model: SdModel, cfg: DiffuserConfig) -> Result<Self> {
        cfg.check()?;
        let opts = RunOptions { strategy: brume::memory::Strategy::PLAIN, ..RunOptions::default() };
        let kind = model.sampler_kind(None)?;
        let resolved = model.sampling_settings(kind, Some(cfg.steps), cfg.guidance)?;
        let size = model.default_size();
        let req = GenerationRequest {
            negative_prompt: cfg.negative_prompt.clone(),
            steps: cfg.steps,
            guidance_scale: resolved.guidance_scale,
            seed: cfg.seed,
            ..GenerationRequest::new(cfg.prompt.clone(), size)
        };
        req.validate(&model)?;
        if model.unet_config.in_channels != model.vae_config.latent_channels() {
            return Err(LiveError::Invalid("an inpainting UNet cannot run live img2img; choose an ordinary UNet".into()));
        }
        let mut progress = |_: &brume::pipelines::Progress| Flow::Continue;
        let enc = load_encoder(&model, &opts, &mut progress)?;
        let unet = load_unet(&model, &opts, &mut progress)?;
        let dec = load_decoder(&model, &opts, &mut progress)?;
        let mut cache = ConditioningCache::new(4);
        let t = Instant::now();
        let cond = conditioning(&model, &req, &opts.device, opts.dtype, Some(&mut cache), &mut progress)?;
        let prompt_ms = t.elapsed().as_secs_f64() * 1e3;
        let filter = SimilarityFilter::new(cfg.similarity_threshold, cfg.max_skips, cfg.seed);
        Ok(Self { model, opts, enc, unet, dec, cache, cond, req, cfg, noise: None, prev_latent: None, last: None, filter, width: None, prompt_ms })
    }

    pub fn model(&self) -> &SdModel {
        &self.model
    }

    pub fn config(&self) -> &DiffuserConfig {
        &self.cfg
    }

    /// A new prompt: its conditioning is computed now (or comes from the cache).
    pub fn set_prompt(&mut self, prompt: &str) -> Result<()> {
        if prompt == self.req.prompt {
            return Ok(());
        }
        self.req.prompt = prompt.to_string();
        self.cfg.prompt = prompt.to_string();
        let t = Instant::now();
        self.cond = conditioning(&self.model, &self.req, &self.opts.device, self.opts.dtype, Some(&mut self.cache), &mut |_| Flow::Continue)?;
        self.prompt_ms = t.elapsed().as_secs_f64() * 1e3;
        self.prev_latent = None;
        self.last = None;
        self.filter.reset();
        Ok(())
    }

    pub fn set_steps(&mut self, steps: usize) -> Result<()> {
        let cfg = DiffuserConfig { steps, ..self.cfg.clone() };
        cfg.check()?;
        self.cfg.steps = steps;
        self.req.steps = steps;
        Ok(())
    }

    /// Diffuse at `width` (frames are scaled down to it and results back up); `None`: the frames' own.
    pub fn set_width(&mut self, width: Option<u32>) {
        self.width = width.map(|w| (w / 8 * 8).max(8));
    }

    pub fn set_techniques(&mut self, t: Techniques) {
        self.cfg.techniques = t;
        self.filter.reset();
        self.prev_latent = None;
    }

    /// LCM UNets run every step below timestep ~1000 x strength (diffusers'
    /// `LCMScheduler.set_timesteps(strength=)`, as StreamDiffusion's `t_index_list`):
    /// one step at strength 0.5 denoises from the middle of the schedule. The full-schedule
    /// rule (`steps x strength` steps from the end) would leave 1 step nothing to do
    /// below strength 1. Other samplers take the model's own img2img rule.
    fn sampler(&self) -> Result<(Box<dyn brume::samplers::Sampler>, usize)> {
        if self.req.sampler_kind(&self.model)? == brume::samplers::SamplerKind::Lcm {
            let lcm = brume::samplers::Lcm::within(&self.model.schedule, self.req.steps, self.cfg.strength)?;
            return Ok((Box::new(lcm), 0));
        }
        Ok(schedule(&self.model, &self.req, self.cfg.strength)?)
    }

    fn fixed_noise(&mut self, dims: &[usize]) -> Result<Tensor> {
        match &self.noise {
            Some(n) if n.dims() == dims => Ok(n.clone()),
            _ => {
                let n = Rng::new(self.cfg.seed).randn(dims, &self.opts.device)?;
                self.noise = Some(n.clone());
                Ok(n)
            }
        }
    }

    /// One frame through VAE encode, the UNet and VAE decode.
    pub fn process(&mut self, frame: &RgbImage) -> Result<Diffused> {
        if self.cfg.techniques.similarity_skip {
            if let Some(last) = &self.last {
                if last.dimensions() == frame.dimensions() && self.filter.should_skip(&signed_pixels(frame)) {
                    return Ok(Diffused { image: last.clone(), encode_ms: 0.0, unet_ms: 0.0, decode_ms: 0.0, skipped: true });
                }
            } else {
                self.filter.should_skip(&signed_pixels(frame));
            }
        }
        let small;
        let input = match self.width {
            Some(w) if w < frame.width() => {
                small = crate::source::fit(frame, w);
                &small
            }
            _ => frame,
        };
        let t0 = Instant::now();
        let image = rgb_to_tensor(input)?;
        let vae = &self.model.vae_config;
        // The latent distribution's mean, not a draw from it: a fresh draw per frame
        // would add flicker; the stream's randomness is its one fixed noise.
        let z = self.enc.encode(&image.to_dtype(self.opts.dtype)?)?.mean.to_dtype(candle_core::DType::F32)?;
        let mut z = ((z - vae.shift_factor())? * vae.scaling_factor())?;
        let t1 = Instant::now();
        if self.cfg.techniques.latent_blend {
            if let Some(prev) = self.prev_latent.as_ref().filter(|p| p.dims() == z.dims()) {
                z = ((z * (1.0 - self.cfg.blend))? + (prev * self.cfg.blend)?)?;
            }
        }
        let (mut sampler, start) = self.sampler()?;
        let noise = self.fixed_noise(z.dims())?;
        let latents = sampler.add_noise(&z, &noise, start)?;
        // Fresh noise between steps (multi-step LCM) is the same every frame too.
        let mut step_noise = Rng::new(self.cfg.seed.wrapping_add(1));
        let latents = denoise(
            &self.unet,
            &self.cond,
            self.req.guidance_scale,
            sampler.as_mut(),
            latents,
            start,
            None,
            &mut step_noise,
            &self.opts,
            &mut |_| Flow::Continue,
        )?;
        let t2 = Instant::now();
        let img = decode_with(&self.dec, &self.model, &latents, &self.opts)?;
        let mut out = to_rgb8(&img)?;
        if out.dimensions() != frame.dimensions() {
            out = image::imageops::resize(&out, frame.width(), frame.height(), image::imageops::FilterType::Triangle);
        }
        let t3 = Instant::now();
        self.prev_latent = Some(latents);
        self.last = Some(out.clone());
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        Ok(Diffused { image: out, encode_ms: ms(t0, t1), unet_ms: ms(t1, t2), decode_ms: ms(t2, t3), skipped: false })
    }
}

impl Diffuse for FrameDiffuser {
    fn diffuse(&mut self, frame: &RgbImage) -> Result<Diffused> {
        self.process(frame)
    }
}
