//! One img2img per frame with everything resident: the VAE encoder, the UNet and the
//! VAE decoder are loaded once, the prompt's conditioning (text encoder output and the
//! cross-attention K/V cache) is computed once per prompt, and the noise is the same
//! for every frame, so a frame that did not change gives the same picture.

use std::rc::Rc;
use std::time::Instant;

use brume::models::UNet2DConditionModel;
use brume::pipelines::conditioning::{conditioning, Conditioning, ConditioningCache};
use brume::pipelines::decode::load_decoder;
use brume::pipelines::denoise::{denoise, load_unet, RunOptions};
use brume::pipelines::image_io::{rgb_to_tensor, to_rgb8};
use brume::pipelines::img2img::{load_encoder, schedule, strength_in_range};
use brume::pipelines::{AnyVaeDecoder, AnyVaeEncoder, Flow, GenerationRequest, SdModel, VaeConfig};
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
            return Err(LiveError::Invalid(format!(
                "strength must be in (0, 1], got {}",
                self.strength
            )));
        }
        if self.steps == 0 || self.steps > 50 {
            return Err(LiveError::Invalid(format!(
                "steps must be 1..=50 for live diffusion, got {}",
                self.steps
            )));
        }
        if !(0.0..1.0).contains(&self.blend) {
            return Err(LiveError::Invalid(format!(
                "latent blend must be in [0, 1), got {}",
                self.blend
            )));
        }
        if !(self.similarity_threshold > 0.0 && self.similarity_threshold <= 1.0) {
            return Err(LiveError::Invalid(format!(
                "similarity threshold must be in (0, 1], got {}",
                self.similarity_threshold
            )));
        }
        Ok(())
    }
}

/// Stage 1 of a frame: the similarity filter and the VAE encoder (the latent
/// distribution's mean: a fresh draw per frame would add flicker; the stream's
/// randomness is its one fixed noise).
pub struct EncodeStage {
    vae: VaeConfig,
    enc: AnyVaeEncoder,
    opts: RunOptions,
    filter: SimilarityFilter,
    techniques: Techniques,
    /// Working width when lower than the frames' (a governor's choice).
    width: Option<u32>,
    /// Whether a result exists that a skip could show again.
    primed: bool,
}

/// What the encoder stage hands on: scaled latents, or a skip.
pub enum Encoded {
    Latents { z: Tensor, ms: f64 },
    Skip,
}

impl EncodeStage {
    pub fn new(model: &SdModel, cfg: &DiffuserConfig) -> Result<Self> {
        cfg.check()?;
        let opts = live_options();
        let enc = load_encoder(model, &opts, &mut |_| Flow::Continue)?;
        let filter = SimilarityFilter::new(cfg.similarity_threshold, cfg.max_skips, cfg.seed);
        Ok(Self {
            vae: model.vae_config.clone(),
            enc,
            opts,
            filter,
            techniques: cfg.techniques,
            width: None,
            primed: false,
        })
    }

    pub fn run(&mut self, frame: &RgbImage) -> Result<Encoded> {
        if self.techniques.similarity_skip {
            let skip = self.filter.should_skip(&signed_pixels(frame));
            if skip && self.primed {
                return Ok(Encoded::Skip);
            }
        }
        self.primed = true;
        let t0 = Instant::now();
        let small;
        let input = match self.width {
            Some(w) if w < frame.width() => {
                small = crate::source::fit(frame, w);
                &small
            }
            _ => frame,
        };
        let image = rgb_to_tensor(input)?;
        let z = self
            .enc
            .encode(&image.to_dtype(self.opts.dtype)?)?
            .mean
            .to_dtype(candle_core::DType::F32)?;
        let z = ((z - self.vae.shift_factor())? * self.vae.scaling_factor())?;
        Ok(Encoded::Latents {
            z,
            ms: t0.elapsed().as_secs_f64() * 1e3,
        })
    }
}

/// Stage 2: the UNet over the prompt's conditioning, from the frame's latents
/// noised with the stream's fixed noise (and blended with the previous result).
pub struct DenoiseStage {
    model: SdModel,
    opts: RunOptions,
    unet: UNet2DConditionModel,
    cache: ConditioningCache,
    cond: Rc<Conditioning>,
    req: GenerationRequest,
    cfg: DiffuserConfig,
    noise: Option<Tensor>,
    prev_latent: Option<Tensor>,
    /// Time the text encoder took for the current prompt.
    pub prompt_ms: f64,
}

impl DenoiseStage {
    /// Loads the UNet and encodes the prompt once.
    pub fn new(model: SdModel, cfg: &DiffuserConfig) -> Result<Self> {
        cfg.check()?;
        let opts = live_options();
        let kind = model.sampler_kind(None)?;
        let resolved = model.sampling_settings(kind, Some(cfg.steps), cfg.guidance)?;
        let req = GenerationRequest {
            negative_prompt: cfg.negative_prompt.clone(),
            steps: cfg.steps,
            guidance_scale: resolved.guidance_scale,
            seed: cfg.seed,
            ..GenerationRequest::new(cfg.prompt.clone(), model.default_size())
        };
        req.validate(&model)?;
        if model.unet_config.in_channels != model.vae_config.latent_channels() {
            return Err(LiveError::Invalid(
                "an inpainting UNet cannot run live img2img; choose an ordinary UNet".into(),
            ));
        }
        let unet = load_unet(&model, &opts, &mut |_| Flow::Continue)?;
        let mut cache = ConditioningCache::new(4);
        let t = Instant::now();
        let cond = conditioning(
            &model,
            &req,
            &opts.device,
            opts.dtype,
            Some(&mut cache),
            &mut |_| Flow::Continue,
        )?;
        let prompt_ms = t.elapsed().as_secs_f64() * 1e3;
        Ok(Self {
            model,
            opts,
            unet,
            cache,
            cond,
            req,
            cfg: cfg.clone(),
            noise: None,
            prev_latent: None,
            prompt_ms,
        })
    }

    /// A new prompt: its conditioning is computed now (or comes from the cache).
    pub fn set_prompt(&mut self, prompt: &str) -> Result<()> {
        if prompt == self.req.prompt {
            return Ok(());
        }
        self.req.prompt = prompt.to_string();
        self.cfg.prompt = prompt.to_string();
        let t = Instant::now();
        self.cond = conditioning(
            &self.model,
            &self.req,
            &self.opts.device,
            self.opts.dtype,
            Some(&mut self.cache),
            &mut |_| Flow::Continue,
        )?;
        self.prompt_ms = t.elapsed().as_secs_f64() * 1e3;
        self.prev_latent = None;
        Ok(())
    }

    /// LCM UNets run every step below timestep ~1000 x strength (diffusers'
    /// `LCMScheduler.set_timesteps(strength=)`, as StreamDiffusion's `t_index_list`):
    /// one step at strength 0.5 denoises from the middle of the schedule. The full-schedule
    /// rule (`steps x strength` steps from the end) would leave 1 step nothing to do
    /// below strength 1. Other samplers take the model's own img2img rule.
    fn sampler(&self) -> Result<(Box<dyn brume::samplers::Sampler>, usize)> {
        if self.req.sampler_kind(&self.model)? == brume::samplers::SamplerKind::Lcm {
            let lcm = brume::samplers::Lcm::within(
                &self.model.schedule,
                self.req.steps,
                self.cfg.strength,
            )?;
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

    /// The frame's result latents and the milliseconds they took.
    pub fn run(&mut self, z: Tensor) -> Result<(Tensor, f64)> {
        let t0 = Instant::now();
        let mut z = z;
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
        self.prev_latent = Some(latents.clone());
        Ok((latents, t0.elapsed().as_secs_f64() * 1e3))
    }
}

/// Stage 3: the VAE decoder, back to the frame's size; a skip shows the last result.
pub struct DecodeStage {
    vae: VaeConfig,
    dec: AnyVaeDecoder,
    opts: RunOptions,
    last: Option<RgbImage>,
}

impl DecodeStage {
    pub fn new(model: &SdModel) -> Result<Self> {
        let opts = live_options();
        let dec = load_decoder(model, &opts, &mut |_| Flow::Continue)?;
        Ok(Self {
            vae: model.vae_config.clone(),
            dec,
            opts,
            last: None,
        })
    }

    /// The picture of `latents` at `width` x `height`, and the milliseconds it took.
    pub fn run(&mut self, latents: &Tensor, width: u32, height: u32) -> Result<(RgbImage, f64)> {
        let t0 = Instant::now();
        // As the engine's decode_with (full decode: live sizes are small).
        let z = ((latents / self.vae.scaling_factor())? + self.vae.shift_factor())?
            .to_dtype(self.opts.dtype)?;
        let img = self.dec.decode(&z)?.to_dtype(candle_core::DType::F32)?;
        let img = ((img / 2.0)? + 0.5)?.clamp(0f32, 1f32)?;
        let mut out = to_rgb8(&img)?;
        if out.dimensions() != (width, height) {
            out =
                image::imageops::resize(&out, width, height, image::imageops::FilterType::Triangle);
        }
        self.last = Some(out.clone());
        Ok((out, t0.elapsed().as_secs_f64() * 1e3))
    }

    /// The last result again (a skipped frame).
    pub fn last(&self) -> Option<&RgbImage> {
        self.last.as_ref()
    }
}

/// Everything resident, kept for the whole stream, nothing per frame but the work.
fn live_options() -> RunOptions {
    RunOptions {
        strategy: brume::memory::Strategy::PLAIN,
        ..RunOptions::default()
    }
}

/// Per-frame img2img with every segment resident, the three stages on one thread.
/// Not `Send` (the conditioning's K/V cache is per thread): build it on the thread that runs it.
pub struct FrameDiffuser {
    pub encode: EncodeStage,
    pub denoise: DenoiseStage,
    pub decode: DecodeStage,
    /// Time the text encoder took for the current prompt.
    pub prompt_ms: f64,
}

impl FrameDiffuser {
    /// Loads every segment and encodes the prompt once.
    pub fn new(model: SdModel, cfg: DiffuserConfig) -> Result<Self> {
        cfg.check()?;
        let encode = EncodeStage::new(&model, &cfg)?;
        let decode = DecodeStage::new(&model)?;
        let denoise = DenoiseStage::new(model, &cfg)?;
        let prompt_ms = denoise.prompt_ms;
        Ok(Self {
            encode,
            denoise,
            decode,
            prompt_ms,
        })
    }

    pub fn set_prompt(&mut self, prompt: &str) -> Result<()> {
        self.denoise.set_prompt(prompt)?;
        self.prompt_ms = self.denoise.prompt_ms;
        self.encode.filter.reset();
        self.encode.primed = false;
        Ok(())
    }

    pub fn set_steps(&mut self, steps: usize) -> Result<()> {
        let cfg = DiffuserConfig {
            steps,
            ..self.denoise.cfg.clone()
        };
        cfg.check()?;
        self.denoise.cfg.steps = steps;
        self.denoise.req.steps = steps;
        Ok(())
    }

    /// Diffuse at `width` (frames are scaled down to it and results back up); `None`: the frames' own.
    pub fn set_width(&mut self, width: Option<u32>) {
        self.encode.width = width.map(|w| (w / 8 * 8).max(8));
    }

    pub fn set_techniques(&mut self, t: Techniques) {
        self.encode.techniques = t;
        self.encode.filter.reset();
        self.denoise.cfg.techniques = t;
        self.denoise.prev_latent = None;
    }

    /// One frame through VAE encode, the UNet and VAE decode.
    pub fn process(&mut self, frame: &RgbImage) -> Result<Diffused> {
        let (z, encode_ms) = match self.encode.run(frame)? {
            Encoded::Latents { z, ms } => (z, ms),
            Encoded::Skip => match self.decode.last() {
                Some(last) if last.dimensions() == frame.dimensions() => {
                    return Ok(Diffused {
                        image: last.clone(),
                        encode_ms: 0.0,
                        unet_ms: 0.0,
                        decode_ms: 0.0,
                        skipped: true,
                    })
                }
                _ => {
                    self.encode.primed = false;
                    match self.encode.run(frame)? {
                        Encoded::Latents { z, ms } => (z, ms),
                        Encoded::Skip => {
                            return Err(LiveError::Invalid(
                                "the similarity filter skipped a first frame".into(),
                            ))
                        }
                    }
                }
            },
        };
        let (latents, unet_ms) = self.denoise.run(z)?;
        let (image, decode_ms) = self.decode.run(&latents, frame.width(), frame.height())?;
        Ok(Diffused {
            image,
            encode_ms,
            unet_ms,
            decode_ms,
            skipped: false,
        })
    }
}

impl Diffuse for FrameDiffuser {
    fn diffuse(&mut self, frame: &RgbImage) -> Result<Diffused> {
        self.process(frame)
    }
}
