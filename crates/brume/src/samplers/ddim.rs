//! DDIM (deterministic at eta = 0), as diffusers' `DDIMScheduler`.

use candle_core::{Result, Tensor};

use super::schedule::{PredictionType, ScheduleConfig};
use super::{NoiseSource, Sampler};

pub struct Ddim {
    cfg: ScheduleConfig,
    alphas_cumprod: Vec<f32>,
    final_alpha_cumprod: f32,
    timesteps: Vec<f64>,
    step_ratio: usize,
    eta: f64,
}

impl Ddim {
    pub fn new(cfg: &ScheduleConfig, steps: usize, eta: f64) -> Self {
        let alphas_cumprod = cfg.alphas_cumprod();
        let final_alpha_cumprod = if cfg.set_alpha_to_one { 1.0 } else { alphas_cumprod[0] };
        let steps = steps.clamp(1, cfg.num_train_timesteps);
        Self {
            timesteps: cfg.timesteps(steps).into_iter().map(|t| t as f64).collect(),
            step_ratio: cfg.num_train_timesteps / steps,
            alphas_cumprod,
            final_alpha_cumprod,
            cfg: cfg.clone(),
            eta,
        }
    }

    fn alpha(&self, t: usize) -> f32 {
        self.alphas_cumprod[t.min(self.alphas_cumprod.len() - 1)]
    }

    fn alpha_prev(&self, t: usize) -> f32 {
        match t.checked_sub(self.step_ratio) {
            Some(p) => self.alpha(p),
            None => self.final_alpha_cumprod,
        }
    }
}

impl Sampler for Ddim {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn step(&mut self, model_output: &Tensor, index: usize, sample: &Tensor, noise: &mut dyn NoiseSource) -> Result<Tensor> {
        let t = self.timesteps[index] as usize;
        let a_t = self.alpha(t);
        let a_prev = self.alpha_prev(t);
        let b_t = 1.0 - a_t;
        let (sa, sb) = (a_t.sqrt() as f64, b_t.sqrt() as f64);
        let (x0, eps) = match self.cfg.prediction_type {
            PredictionType::Epsilon => (((sample - (model_output * sb)?)? / sa)?, model_output.clone()),
            PredictionType::Sample => {
                let x0 = model_output.clone();
                let eps = ((sample - (&x0 * sa)?)? / sb)?;
                (x0, eps)
            }
            PredictionType::VPrediction => (
                ((sample * sa)? - (model_output * sb)?)?,
                ((model_output * sa)? + (sample * sb)?)?,
            ),
        };
        let x0 = if self.cfg.clip_sample {
            let r = self.cfg.clip_sample_range as f32;
            x0.clamp(-r, r)?
        } else {
            x0
        };
        let b_prev = 1.0 - a_prev;
        let variance = (b_prev / b_t) * (1.0 - a_t / a_prev);
        let std = self.eta * (variance as f64).sqrt();
        let dir = (eps * ((1.0 - a_prev as f64 - std * std).max(0.0)).sqrt())?;
        let prev = ((x0 * (a_prev.sqrt() as f64))? + dir)?;
        if self.eta > 0.0 {
            let z = noise.randn(prev.dims(), prev.device())?.to_dtype(prev.dtype())?;
            prev + (z * std)?
        } else {
            Ok(prev)
        }
    }

    fn add_noise(&self, original: &Tensor, noise: &Tensor, index: usize) -> Result<Tensor> {
        let a = self.alpha(self.timesteps[index] as usize);
        (original * (a.sqrt() as f64))? + (noise * ((1.0 - a).sqrt() as f64))?
    }
}
