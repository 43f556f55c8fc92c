//! Euler, as diffusers' `EulerDiscreteScheduler` (k-diffusion's `sample_euler`
//! without churn): one first-order step along the probability-flow ODE per
//! model evaluation, in the sigma (variance exploding) parameterisation.

use candle_core::{Result, Tensor};
use serde_json::json;

use super::schedule::{ScheduleConfig, TimestepSpacing};
use super::sigmas::{self, expect_false, opt_f64};
use super::{NoiseSource, Sampler};
use crate::error::LoadError;

pub struct Euler {
    cfg: ScheduleConfig,
    timesteps: Vec<f64>,
    /// One more than `timesteps`: the last entry is where the final step lands.
    sigmas: Vec<f64>,
    init_noise_sigma: f64,
}

impl Euler {
    /// Reads `use_karras_sigmas` (unless `karras` overrides it), `sigma_min`,
    /// `sigma_max`, `final_sigmas_type`, `interpolation_type` and
    /// `timestep_type`; the variants brume lacks are errors naming the field.
    pub fn new(cfg: &ScheduleConfig, steps: usize, karras: Option<bool>) -> std::result::Result<Self, LoadError> {
        let c = cfg.options();
        c.expect_one_of("interpolation_type", &[json!("linear")])?;
        c.expect_one_of("timestep_type", &[json!("discrete")])?;
        expect_false(&c, "use_exponential_sigmas")?;
        expect_false(&c, "use_beta_sigmas")?;
        let karras = match karras {
            Some(k) => k,
            None => c.bool("use_karras_sigmas", false)?,
        };
        let final_sigma_min = final_sigmas_is_min(&c)?;

        let ac = cfg.alphas_cumprod();
        let table = sigmas::train_sigmas(&ac);
        let mut timesteps = sigmas::float_timesteps(cfg, steps);
        let mut sig: Vec<f64> = timesteps.iter().map(|&t| sigmas::interp(t, &table)).collect();
        if karras {
            let lo = opt_f64(&c, "sigma_min")?.unwrap_or(sig[sig.len() - 1]);
            let hi = opt_f64(&c, "sigma_max")?.unwrap_or(sig[0]);
            sig = sigmas::karras(lo, hi, steps);
            let log = sigmas::log_sigmas(&table);
            timesteps = sig.iter().map(|&s| sigmas::sigma_to_t(s, &log) as f32 as f64).collect();
        }
        sig.push(if final_sigma_min { table[0] as f64 } else { 0.0 });
        let sigmas: Vec<f64> = sig.into_iter().map(|s| s as f32 as f64).collect();
        Ok(Self {
            init_noise_sigma: init_noise_sigma(cfg, &sigmas),
            cfg: cfg.clone(),
            timesteps,
            sigmas,
        })
    }
}

/// `final_sigmas_type`: "zero" (the default) ends on a clean sample, "sigma_min"
/// on the smallest training sigma.
pub(crate) fn final_sigmas_is_min(c: &crate::models::config::ConfigReader) -> std::result::Result<bool, LoadError> {
    c.expect_one_of("final_sigmas_type", &[json!("zero"), json!("sigma_min")])?;
    Ok(c.string("final_sigmas_type")?.as_deref() == Some("sigma_min"))
}

/// diffusers' rule: the noise the loop starts from has the largest sigma, plus
/// the unit variance of the image for `leading` spacing (whose first timestep
/// is below the end of the schedule).
pub(crate) fn init_noise_sigma(cfg: &ScheduleConfig, sigmas: &[f64]) -> f64 {
    let max = sigmas.iter().fold(0f32, |m, &s| m.max(s as f32));
    match cfg.timestep_spacing {
        TimestepSpacing::Linspace | TimestepSpacing::Trailing => max as f64,
        TimestepSpacing::Leading => (max * max + 1.0).sqrt() as f64,
    }
}

/// `sample / sqrt(sigma^2 + 1)`: the model sees unit-variance input.
pub(crate) fn scale_by_sigma(sample: &Tensor, sigma: f64) -> Result<Tensor> {
    let s = sigma as f32;
    sample / ((s * s + 1.0).sqrt() as f64)
}

impl Sampler for Euler {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn init_noise_sigma(&self) -> f64 {
        self.init_noise_sigma
    }

    fn scale_model_input(&self, sample: &Tensor, index: usize) -> Result<Tensor> {
        scale_by_sigma(sample, self.sigmas[index])
    }

    fn step(&mut self, model_output: &Tensor, index: usize, sample: &Tensor, _noise: &mut dyn NoiseSource) -> Result<Tensor> {
        let sigma = self.sigmas[index];
        let x0 = sigmas::ve_denoised(self.cfg.prediction_type, model_output, sample, sigma)?;
        let derivative = ((sample - x0)? / sigma)?;
        let dt = self.sigmas[index + 1] - sigma;
        sample + (derivative * dt)?
    }

    /// Like diffusers after `set_begin_index(index)`: `original + noise * sigma`.
    fn add_noise(&self, original: &Tensor, noise: &Tensor, index: usize) -> Result<Tensor> {
        original + (noise * self.sigmas[index])?
    }
}
