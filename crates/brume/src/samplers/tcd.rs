//! Trajectory consistency distillation sampling, as diffusers' `TCDScheduler`:
//! like LCM, but each step lands on an intermediate timestep
//! s = floor((1 - gamma) * t_prev) and re-noises from there, gamma (diffusers'
//! `eta`) trading detail for stability; gamma 0 is deterministic.

use candle_core::{Result, Tensor};

use super::lcm::{consistency_timesteps, predict_x0};
use super::schedule::{PredictionType, ScheduleConfig};
use super::sigmas::axpby;
use super::{NoiseSource, Sampler};
use crate::error::{LoadError, RunError};

/// The gamma TCD's authors recommend and diffusers' `step` defaults to.
pub const DEFAULT_GAMMA: f64 = 0.3;

pub struct Tcd {
    cfg: ScheduleConfig,
    alphas_cumprod: Vec<f32>,
    timesteps: Vec<f64>,
    gamma: f64,
}

impl Tcd {
    /// `gamma` is what diffusers passes as `eta` to `step`; it must lie in [0, 1].
    pub fn new(cfg: &ScheduleConfig, steps: usize, gamma: f64) -> std::result::Result<Self, RunError> {
        if !(0.0..=1.0).contains(&gamma) {
            return Err(RunError::Invalid(format!("TCD gamma (eta) must be in [0, 1], got {gamma}")));
        }
        let c = cfg.options();
        let timesteps = consistency_timesteps(cfg, &c, steps).map_err(|e: LoadError| RunError::from(e))?;
        Ok(Self {
            alphas_cumprod: cfg.alphas_cumprod(),
            timesteps,
            gamma,
            cfg: cfg.clone(),
        })
    }
}

impl Sampler for Tcd {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn step(&mut self, model_output: &Tensor, index: usize, sample: &Tensor, noise: &mut dyn NoiseSource) -> Result<Tensor> {
        let ac = &self.alphas_cumprod;
        let t = self.timesteps[index] as usize;
        let prev_t = self.timesteps.get(index + 1).map_or(0, |&p| p as usize);
        // torch: float32 product, floored, cast to long.
        let s = ((1.0 - self.gamma) as f32 * prev_t as f32).floor() as usize;
        let (a_t, a_prev, a_s) = (ac[t], ac[prev_t], ac[s]);
        let x0 = predict_x0(self.cfg.prediction_type, model_output, sample, a_t)?;
        let eps = match self.cfg.prediction_type {
            PredictionType::Epsilon => model_output.clone(),
            PredictionType::Sample => ((sample - (&x0 * a_t.sqrt() as f64)?)? / (1.0 - a_t).sqrt() as f64)?,
            PredictionType::VPrediction => axpby(model_output, a_t.sqrt() as f64, sample, (1.0 - a_t).sqrt() as f64)?,
        };
        let noised = axpby(&x0, a_s.sqrt() as f64, &eps, (1.0 - a_s).sqrt() as f64)?;
        if self.gamma > 0.0 && index + 1 != self.timesteps.len() {
            let z = noise.randn(model_output.dims(), model_output.device())?.to_dtype(noised.dtype())?;
            let r = a_prev / a_s;
            axpby(&noised, r.sqrt() as f64, &z, (1.0 - r).sqrt() as f64)
        } else {
            Ok(noised)
        }
    }

    fn add_noise(&self, original: &Tensor, noise: &Tensor, index: usize) -> Result<Tensor> {
        let a = self.alphas_cumprod[self.timesteps[index] as usize];
        axpby(original, a.sqrt() as f64, noise, (1.0 - a).sqrt() as f64)
    }
}
