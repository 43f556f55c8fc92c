//! Heun, as diffusers' `HeunDiscreteScheduler` (k-diffusion's `sample_heun`
//! without churn): a second-order step from an Euler predictor and a
//! trapezoidal corrector, so two model evaluations per step.
//!
//! Like diffusers, `timesteps()` lists every interior timestep twice: the
//! first evaluation of a pair is the Euler predictor, the second the
//! corrector, which reuses the state kept between the two calls. The final
//! step, down to sigma 0, is a single Euler step.

use candle_core::{Result, Tensor};

use super::euler::{init_noise_sigma, scale_by_sigma};
use super::schedule::ScheduleConfig;
use super::sigmas::{self, expect_false};
use super::{NoiseSource, Sampler};
use crate::error::LoadError;

/// What the predictor leaves for the corrector (diffusers' `prev_derivative`,
/// `dt` and `sample`).
struct Pending {
    derivative: Tensor,
    dt: f64,
    sample: Tensor,
}

pub struct Heun {
    cfg: ScheduleConfig,
    timesteps: Vec<f64>,
    /// Per evaluation, doubled like the timesteps, plus the final 0.
    sigmas: Vec<f64>,
    init_noise_sigma: f64,
    clip: Option<f64>,
    pending: Option<Pending>,
}

impl Heun {
    /// Reads `use_karras_sigmas`, `clip_sample` (default false for this class)
    /// and `clip_sample_range`.
    pub fn new(cfg: &ScheduleConfig, steps: usize) -> std::result::Result<Self, LoadError> {
        let c = cfg.options();
        expect_false(&c, "use_exponential_sigmas")?;
        expect_false(&c, "use_beta_sigmas")?;
        let karras = c.bool("use_karras_sigmas", false)?;
        let clip = if c.bool("clip_sample", false)? { Some(c.f64("clip_sample_range", 1.0)?) } else { None };

        let table = sigmas::train_sigmas(&cfg.alphas_cumprod());
        let mut ts = sigmas::float_timesteps(cfg, steps);
        let mut sig: Vec<f64> = ts.iter().map(|&t| sigmas::interp(t, &table)).collect();
        if karras {
            // This class takes the Karras range from the interpolated sigmas only.
            sig = sigmas::karras(sig[sig.len() - 1], sig[0], steps);
            let log = sigmas::log_sigmas(&table);
            ts = sig.iter().map(|&s| sigmas::sigma_to_t(s, &log)).collect();
        }
        sig.push(0.0);
        let sig: Vec<f64> = sig.into_iter().map(|s| s as f32 as f64).collect();
        let n = sig.len();
        let mut sigmas = vec![sig[0]];
        for &s in &sig[1..n - 1] {
            sigmas.extend([s, s]);
        }
        sigmas.push(sig[n - 1]);
        let mut timesteps = vec![ts[0] as f32 as f64];
        for &t in &ts[1..] {
            timesteps.extend([t as f32 as f64; 2]);
        }
        Ok(Self {
            init_noise_sigma: init_noise_sigma(cfg, &sigmas),
            cfg: cfg.clone(),
            timesteps,
            sigmas,
            clip,
            pending: None,
        })
    }

    fn denoised(&self, model_output: &Tensor, sample: &Tensor, sigma: f64) -> Result<Tensor> {
        let x0 = sigmas::ve_denoised(self.cfg.prediction_type, model_output, sample, sigma)?;
        match self.clip {
            Some(r) => x0.clamp(-r as f32, r as f32),
            None => Ok(x0),
        }
    }
}

impl Sampler for Heun {
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
        match self.pending.take() {
            None => {
                // Predictor: an Euler step from sigmas[index] to sigmas[index + 1].
                let (sigma, next) = (self.sigmas[index], self.sigmas[index + 1]);
                let x0 = self.denoised(model_output, sample, sigma)?;
                let derivative = ((sample - x0)? / sigma)?;
                let dt = next - sigma;
                let prev = (sample + (&derivative * dt)?)?;
                self.pending = Some(Pending {
                    derivative,
                    dt,
                    sample: sample.clone(),
                });
                Ok(prev)
            }
            Some(p) => {
                // Corrector: the model was evaluated at the predicted point, sigma `next`.
                let next = self.sigmas[index];
                let x0 = self.denoised(model_output, sample, next)?;
                let derivative = ((sample - x0)? / next)?;
                let derivative = ((p.derivative + derivative)? / 2.0)?;
                p.sample + (derivative * p.dt)?
            }
        }
    }

    fn add_noise(&self, original: &Tensor, noise: &Tensor, index: usize) -> Result<Tensor> {
        original + (noise * self.sigmas[index])?
    }

    fn order(&self) -> usize {
        2
    }
}
