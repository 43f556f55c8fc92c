//! Latent consistency sampling, as diffusers' `LCMScheduler`: each evaluation
//! maps the sample straight to a clean estimate through the consistency
//! boundary condition (c_skip, c_out), then re-noises it to the next timestep
//! with fresh noise. One step is a valid schedule.

use candle_core::{Result, Tensor};

use super::schedule::{PredictionType, ScheduleConfig};
use super::sigmas::{axpby, np_linspace};
use super::{NoiseSource, Sampler};
use crate::error::LoadError;
use crate::models::config::ConfigReader;

pub struct Lcm {
    cfg: ScheduleConfig,
    alphas_cumprod: Vec<f32>,
    timesteps: Vec<f64>,
    timestep_scaling: f64,
    clip: Option<f64>,
}

/// The timesteps LCM and TCD share: `steps` picks from the distilled model's
/// `original_inference_steps` grid (k = num_train // original, t = j*k - 1),
/// evenly by index from the top; `timestep_spacing` plays no part.
pub(crate) fn consistency_timesteps(cfg: &ScheduleConfig, c: &ConfigReader, steps: usize) -> std::result::Result<Vec<f64>, LoadError> {
    consistency_timesteps_within(cfg, c, steps, 1.0)
}

/// [`consistency_timesteps`] on the grid's lowest `original * strength` points (diffusers'
/// `LCMScheduler.set_timesteps(strength=)`, which its LCM img2img pipeline uses): every step
/// runs, below timestep ~1000 x strength.
pub(crate) fn consistency_timesteps_within(
    cfg: &ScheduleConfig,
    c: &ConfigReader,
    steps: usize,
    strength: f64,
) -> std::result::Result<Vec<f64>, LoadError> {
    let n = cfg.num_train_timesteps;
    let original = c.usize("original_inference_steps", Some(50))?;
    if original == 0 || original > n {
        return Err(c.error(
            "original_inference_steps",
            format!("must be 1..={n} (num_train_timesteps), found {original}"),
        ));
    }
    if steps > original {
        return Err(c.error(
            "original_inference_steps",
            format!("{steps} steps exceed the {original} steps the model was distilled with"),
        ));
    }
    let k = n / original;
    // Python's int(original_steps * strength): truncation of the f64 product.
    let kept = (original as f64 * strength) as usize;
    if steps > kept {
        return Err(c.error(
            "original_inference_steps",
            format!("strength {strength} keeps {kept} of the {original} distilled timesteps, fewer than the {steps} steps asked for; raise the strength or lower the steps"),
        ));
    }
    let grid: Vec<usize> = (1..=kept).rev().map(|j| j * k - 1).collect();
    let len = grid.len();
    // np.linspace(0, len, steps, endpoint=False), floored.
    let idx = np_linspace(0.0, len as f64, steps + 1);
    Ok(idx[..steps].iter().map(|&i| grid[i.floor() as usize] as f64).collect())
}

/// x_0 from the model output, as the DDIM family computes it.
pub(crate) fn predict_x0(pred: PredictionType, model_output: &Tensor, sample: &Tensor, a_t: f32) -> Result<Tensor> {
    let (sa, sb) = (a_t.sqrt() as f64, (1.0 - a_t).sqrt() as f64);
    match pred {
        PredictionType::Epsilon => (sample - (model_output * sb)?)? / sa,
        PredictionType::Sample => Ok(model_output.clone()),
        PredictionType::VPrediction => axpby(sample, sa, model_output, -sb),
    }
}

impl Lcm {
    /// Reads `original_inference_steps`, `timestep_scaling`, `clip_sample`
    /// (default false for this class) and `clip_sample_range`.
    pub fn new(cfg: &ScheduleConfig, steps: usize) -> std::result::Result<Self, LoadError> {
        Self::within(cfg, steps, 1.0)
    }

    /// All `steps` below timestep ~1000 x `strength` (see [`consistency_timesteps_within`]).
    pub fn within(cfg: &ScheduleConfig, steps: usize, strength: f64) -> std::result::Result<Self, LoadError> {
        let c = cfg.options();
        let timesteps = consistency_timesteps_within(cfg, &c, steps, strength)?;
        let clip = if c.bool("clip_sample", false)? { Some(c.f64("clip_sample_range", 1.0)?) } else { None };
        Ok(Self {
            alphas_cumprod: cfg.alphas_cumprod(),
            timesteps,
            timestep_scaling: c.f64("timestep_scaling", 10.0)?,
            clip,
            cfg: cfg.clone(),
        })
    }

    fn alpha(&self, t: f64) -> f32 {
        self.alphas_cumprod[t as usize]
    }
}

impl Sampler for Lcm {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    /// Noise is drawn between steps only: the last evaluation returns the
    /// denoised estimate itself.
    fn step(&mut self, model_output: &Tensor, index: usize, sample: &Tensor, noise: &mut dyn NoiseSource) -> Result<Tensor> {
        let t = self.timesteps[index];
        let prev_t = self.timesteps.get(index + 1).copied().unwrap_or(t);
        let a_t = self.alpha(t);
        let a_prev = self.alpha(prev_t);
        // get_scalings_for_boundary_condition_discrete, sigma_data = 0.5, in f32.
        let scaled = (t * self.timestep_scaling) as f32;
        let c_skip = 0.25 / (scaled * scaled + 0.25);
        let c_out = scaled / (scaled * scaled + 0.25).sqrt();
        let x0 = predict_x0(self.cfg.prediction_type, model_output, sample, a_t)?;
        let x0 = match self.clip {
            Some(r) => x0.clamp(-r as f32, r as f32)?,
            None => x0,
        };
        let denoised = axpby(&x0, c_out as f64, sample, c_skip as f64)?;
        if index + 1 != self.timesteps.len() {
            let z = noise.randn(model_output.dims(), model_output.device())?.to_dtype(denoised.dtype())?;
            axpby(&denoised, a_prev.sqrt() as f64, &z, (1.0 - a_prev).sqrt() as f64)
        } else {
            Ok(denoised)
        }
    }

    fn add_noise(&self, original: &Tensor, noise: &Tensor, index: usize) -> Result<Tensor> {
        let a = self.alpha(self.timesteps[index]);
        axpby(original, a.sqrt() as f64, noise, (1.0 - a).sqrt() as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strength_spreads_every_step_below_it_as_diffusers() {
        // LCMScheduler(original_inference_steps=50).set_timesteps(4[, strength=s]).timesteps
        let cfg = ScheduleConfig::default();
        let at = |steps, strength| Lcm::within(&cfg, steps, strength).map(|l| l.timesteps);
        assert_eq!(at(4, 1.0).unwrap(), vec![999.0, 759.0, 499.0, 259.0]);
        assert_eq!(at(4, 0.6).unwrap(), vec![599.0, 459.0, 299.0, 159.0]);
        assert_eq!(at(1, 0.5).unwrap(), vec![499.0]);
        // int(50 * 0.06) = 3 timesteps kept, fewer than 4 steps: diffusers raises too.
        let e = at(4, 0.06).unwrap_err().to_string();
        assert!(e.contains("strength 0.06 keeps 3 of the 50"), "{e}");
    }
}
