//! Euler ancestral, as diffusers' `EulerAncestralDiscreteScheduler`
//! (k-diffusion's `sample_euler_ancestral`, eta 1): each step goes down to a
//! lower sigma deterministically and adds back fresh noise up to the target.

use candle_core::{Result, Tensor};

use super::euler::{init_noise_sigma, scale_by_sigma};
use super::schedule::{PredictionType, ScheduleConfig};
use super::sigmas;
use super::{NoiseSource, Sampler};
use crate::error::LoadError;

pub struct EulerAncestral {
    cfg: ScheduleConfig,
    timesteps: Vec<f64>,
    sigmas: Vec<f64>,
    init_noise_sigma: f64,
}

impl EulerAncestral {
    pub fn new(cfg: &ScheduleConfig, steps: usize) -> std::result::Result<Self, LoadError> {
        if cfg.prediction_type == PredictionType::Sample {
            // diffusers raises NotImplementedError for it in this class.
            return Err(cfg.options().error("prediction_type", "`sample` is not supported by Euler ancestral"));
        }
        let table = sigmas::train_sigmas(&cfg.alphas_cumprod());
        let timesteps = sigmas::float_timesteps(cfg, steps);
        let mut sigmas: Vec<f64> = timesteps.iter().map(|&t| sigmas::interp(t, &table) as f32 as f64).collect();
        sigmas.push(0.0);
        Ok(Self {
            init_noise_sigma: init_noise_sigma(cfg, &sigmas),
            cfg: cfg.clone(),
            timesteps,
            sigmas,
        })
    }
}

impl Sampler for EulerAncestral {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn init_noise_sigma(&self) -> f64 {
        self.init_noise_sigma
    }

    fn scale_model_input(&self, sample: &Tensor, index: usize) -> Result<Tensor> {
        scale_by_sigma(sample, self.sigmas[index])
    }

    /// Draws noise at every step, the last included (where its weight is 0),
    /// like diffusers, so a seeded run consumes the same random stream.
    fn step(&mut self, model_output: &Tensor, index: usize, sample: &Tensor, noise: &mut dyn NoiseSource) -> Result<Tensor> {
        let sigma = self.sigmas[index];
        let x0 = sigmas::ve_denoised(self.cfg.prediction_type, model_output, sample, sigma)?;
        // The split of the target sigma into a deterministic and a noise part, in f32 like diffusers.
        let (from, to) = (sigma as f32, self.sigmas[index + 1] as f32);
        let sigma_up = (to * to * (from * from - to * to) / (from * from)).sqrt();
        let sigma_down = (to * to - sigma_up * sigma_up).sqrt();
        let derivative = ((sample - x0)? / sigma)?;
        let prev = (sample + (derivative * (sigma_down - from) as f64)?)?;
        let z = noise.randn(model_output.dims(), model_output.device())?.to_dtype(prev.dtype())?;
        prev + (z * sigma_up as f64)?
    }

    fn add_noise(&self, original: &Tensor, noise: &Tensor, index: usize) -> Result<Tensor> {
        original + (noise * self.sigmas[index])?
    }
}
