//! DDPM ancestral sampling, as diffusers' `DDPMScheduler`: the posterior mean
//! of x_{t-1} given the predicted x_0, plus fresh noise of the posterior
//! variance whenever the current timestep is above 0.

use candle_core::{Result, Tensor};
use serde_json::json;

use super::schedule::{PredictionType, ScheduleConfig};
use super::sigmas::axpby;
use super::{NoiseSource, Sampler};
use crate::error::LoadError;

/// diffusers' `variance_type`, the ones brume implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variance {
    /// The posterior variance beta~_t (the default).
    FixedSmall,
    /// The same, computed through its log (identical up to rounding).
    FixedSmallLog,
    /// beta_t, the forward-process variance.
    FixedLarge,
}

pub struct Ddpm {
    cfg: ScheduleConfig,
    alphas_cumprod: Vec<f32>,
    timesteps: Vec<f64>,
    variance: Variance,
    clip: Option<f64>,
}

impl Ddpm {
    /// Reads `variance_type`, `clip_sample` (default true for this class) and
    /// `clip_sample_range`; the learned variances need a model with twice the
    /// output channels and are rejected.
    pub fn new(cfg: &ScheduleConfig, steps: usize) -> std::result::Result<Self, LoadError> {
        let c = cfg.options();
        c.expect_one_of(
            "variance_type",
            &[json!("fixed_small"), json!("fixed_small_log"), json!("fixed_large")],
        )?;
        let variance = match c.string("variance_type")?.as_deref() {
            Some("fixed_small_log") => Variance::FixedSmallLog,
            Some("fixed_large") => Variance::FixedLarge,
            _ => Variance::FixedSmall,
        };
        if steps > cfg.num_train_timesteps {
            return Err(c.error(
                "num_train_timesteps",
                format!("{steps} steps exceed the {} training timesteps", cfg.num_train_timesteps),
            ));
        }
        let clip = if c.bool("clip_sample", true)? { Some(c.f64("clip_sample_range", 1.0)?) } else { None };
        Ok(Self {
            alphas_cumprod: cfg.alphas_cumprod(),
            timesteps: cfg.timesteps(steps).into_iter().map(|t| t as f64).collect(),
            cfg: cfg.clone(),
            variance,
            clip,
        })
    }

    fn alpha(&self, t: f64) -> f32 {
        self.alphas_cumprod[(t as usize).min(self.alphas_cumprod.len() - 1)]
    }
}

impl Sampler for Ddpm {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn step(&mut self, model_output: &Tensor, index: usize, sample: &Tensor, noise: &mut dyn NoiseSource) -> Result<Tensor> {
        let t = self.timesteps[index];
        // diffusers' `previous_timestep`: the next one in the list, or "before 0" (alpha 1).
        let a_t = self.alpha(t);
        let a_prev = self.timesteps.get(index + 1).map_or(1.0, |&p| self.alpha(p));
        let (b_t, b_prev) = (1.0 - a_t, 1.0 - a_prev);
        let cur_alpha = a_t / a_prev;
        let cur_beta = 1.0 - cur_alpha;
        let (sa, sb) = (a_t.sqrt() as f64, b_t.sqrt() as f64);
        let x0 = match self.cfg.prediction_type {
            PredictionType::Epsilon => ((sample - (model_output * sb)?)? / sa)?,
            PredictionType::Sample => model_output.clone(),
            PredictionType::VPrediction => axpby(sample, sa, model_output, -sb)?,
        };
        let x0 = match self.clip {
            Some(r) => x0.clamp(-r as f32, r as f32)?,
            None => x0,
        };
        let x0_coeff = (a_prev.sqrt() * cur_beta) / b_t;
        let sample_coeff = cur_alpha.sqrt() * b_prev / b_t;
        let mean = axpby(&x0, x0_coeff as f64, sample, sample_coeff as f64)?;
        if t > 0.0 {
            let var = ((b_prev / b_t) * cur_beta).max(1e-20);
            let std = match self.variance {
                Variance::FixedSmall => var.sqrt(),
                Variance::FixedSmallLog => (0.5 * var.ln()).exp(),
                Variance::FixedLarge => cur_beta.sqrt(),
            };
            let z = noise.randn(model_output.dims(), model_output.device())?.to_dtype(mean.dtype())?;
            mean + (z * std as f64)?
        } else {
            Ok(mean)
        }
    }

    fn add_noise(&self, original: &Tensor, noise: &Tensor, index: usize) -> Result<Tensor> {
        let a = self.alpha(self.timesteps[index]);
        axpby(original, a.sqrt() as f64, noise, (1.0 - a).sqrt() as f64)
    }
}
