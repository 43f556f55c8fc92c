//! The noise schedule shared by every sampler: betas, cumulative alphas and
//! timestep spacing, read from a diffusers `scheduler_config.json`.

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use super::sigmas::round_half_even;
use crate::error::LoadError;
use crate::models::config::ConfigReader;

/// Largest `num_train_timesteps` accepted (trained models use 1000).
pub const MAX_TRAIN_TIMESTEPS: usize = 100_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BetaSchedule {
    Linear,
    ScaledLinear,
    SquaredCosCapV2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PredictionType {
    Epsilon,
    VPrediction,
    Sample,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimestepSpacing {
    Leading,
    Linspace,
    Trailing,
}

/// The training-time noise schedule and the options every sampler reads.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleConfig {
    /// The scheduler class the model ships with; it picks the default sampler.
    pub class_name: Option<String>,
    /// Where the config came from (for error messages).
    pub path: PathBuf,
    /// Every field of the file, for the sampler-specific options
    /// (`use_karras_sigmas`, `solver_order`, `original_inference_steps`, ...).
    pub raw: Map<String, Value>,
    pub num_train_timesteps: usize,
    pub beta_start: f64,
    pub beta_end: f64,
    pub beta_schedule: BetaSchedule,
    pub prediction_type: PredictionType,
    pub timestep_spacing: TimestepSpacing,
    pub steps_offset: usize,
    pub set_alpha_to_one: bool,
    pub clip_sample: bool,
    pub clip_sample_range: f64,
}

impl Default for ScheduleConfig {
    /// Stable Diffusion 1.x / 2.x-base training schedule.
    fn default() -> Self {
        Self {
            class_name: None,
            path: PathBuf::from("<default schedule>"),
            raw: Map::new(),
            num_train_timesteps: 1000,
            beta_start: 0.00085,
            beta_end: 0.012,
            beta_schedule: BetaSchedule::ScaledLinear,
            prediction_type: PredictionType::Epsilon,
            timestep_spacing: TimestepSpacing::Leading,
            steps_offset: 1,
            set_alpha_to_one: false,
            clip_sample: false,
            clip_sample_range: 1.0,
        }
    }
}

impl ScheduleConfig {
    pub fn from_file(path: &Path) -> Result<Self, LoadError> {
        Self::from_reader(&ConfigReader::open(path)?)
    }

    pub fn from_reader(c: &ConfigReader) -> Result<Self, LoadError> {
        c.expect_unset("trained_betas")?;
        c.expect_one_of("thresholding", &[json!(false)])?;
        c.expect_one_of("rescale_betas_zero_snr", &[json!(false)])?;
        let class_name = c.string("_class_name")?;
        // Absent fields take the default of the class the file names, as
        // diffusers' `from_config` does (saved configs list every field, so
        // this matters for hand-written files only).
        let class = class_name.as_deref().unwrap_or("");
        let linspace_default = matches!(
            class,
            "EulerDiscreteScheduler"
                | "EulerAncestralDiscreteScheduler"
                | "HeunDiscreteScheduler"
                | "DPMSolverMultistepScheduler"
                | "UniPCMultistepScheduler"
        );
        // LCM and TCD default to SD's schedule; Heun to SD's beta range.
        let sd_betas = matches!(class, "LCMScheduler" | "TCDScheduler" | "HeunDiscreteScheduler");
        let beta_schedule = match c.string("beta_schedule")?.as_deref() {
            None if matches!(class, "LCMScheduler" | "TCDScheduler") => BetaSchedule::ScaledLinear,
            None | Some("linear") => BetaSchedule::Linear,
            Some("scaled_linear") => BetaSchedule::ScaledLinear,
            Some("squaredcos_cap_v2") => BetaSchedule::SquaredCosCapV2,
            Some(o) => return Err(c.error("beta_schedule", format!("`{o}` is not supported"))),
        };
        let prediction_type = match c.string("prediction_type")?.as_deref() {
            None | Some("epsilon") => PredictionType::Epsilon,
            Some("v_prediction") => PredictionType::VPrediction,
            Some("sample") => PredictionType::Sample,
            Some(o) => return Err(c.error("prediction_type", format!("`{o}` is not supported"))),
        };
        let timestep_spacing = match c.string("timestep_spacing")?.as_deref() {
            None if linspace_default => TimestepSpacing::Linspace,
            None | Some("leading") => TimestepSpacing::Leading,
            Some("linspace") => TimestepSpacing::Linspace,
            Some("trailing") => TimestepSpacing::Trailing,
            Some(o) => return Err(c.error("timestep_spacing", format!("`{o}` is not supported"))),
        };
        let num_train_timesteps = c.usize("num_train_timesteps", Some(1000))?;
        // Every schedule array is sized by it: a huge value must be an error,
        // not an allocation abort. Trained models use 1000 (a few use 2000).
        // At least two: samplers interpolate between neighbouring training
        // timesteps (found by fuzzing: 1 indexed past the sigma table).
        if !(2..=MAX_TRAIN_TIMESTEPS).contains(&num_train_timesteps) {
            return Err(c.error(
                "num_train_timesteps",
                format!("must be 2..={MAX_TRAIN_TIMESTEPS}, found {num_train_timesteps}"),
            ));
        }
        let cfg = Self {
            class_name,
            path: c.path().to_path_buf(),
            raw: c.raw().clone(),
            num_train_timesteps,
            beta_start: c.f64("beta_start", if sd_betas { 0.00085 } else { 0.0001 })?,
            beta_end: c.f64("beta_end", if sd_betas { 0.012 } else { 0.02 })?,
            beta_schedule,
            prediction_type,
            timestep_spacing,
            steps_offset: c.usize("steps_offset", Some(0))?,
            set_alpha_to_one: c.bool("set_alpha_to_one", true)?,
            clip_sample: c.bool("clip_sample", true)?,
            clip_sample_range: c.f64("clip_sample_range", 1.0)?,
        };
        cfg.validate(c)?;
        Ok(cfg)
    }

    /// The numbers must describe a noise schedule: betas in (0, 1) rising, so
    /// every cumulative alpha is in (0, 1). Out of range, samplers divide by
    /// zero or take square roots of negatives and the picture comes out black
    /// with no error.
    fn validate(&self, c: &ConfigReader) -> Result<(), LoadError> {
        let (b0, b1) = (self.beta_start, self.beta_end);
        if self.beta_schedule != BetaSchedule::SquaredCosCapV2 {
            if !(b0.is_finite() && b0 > 0.0 && b0 < 1.0) {
                return Err(c.error("beta_start", format!("must be in (0, 1), found {b0}")));
            }
            if !(b1.is_finite() && b1 >= b0 && b1 < 1.0) {
                return Err(c.error("beta_end", format!("must be in [beta_start, 1) = [{b0}, 1), found {b1}")));
            }
        }
        if self.steps_offset >= self.num_train_timesteps {
            return Err(c.error(
                "steps_offset",
                format!("must be below num_train_timesteps ({}), found {}", self.num_train_timesteps, self.steps_offset),
            ));
        }
        if !(self.clip_sample_range.is_finite() && self.clip_sample_range > 0.0) {
            return Err(c.error("clip_sample_range", format!("must be a positive number, found {}", self.clip_sample_range)));
        }
        let ac = self.alphas_cumprod();
        if let Some((i, a)) = ac.iter().enumerate().find(|(_, a)| !(a.is_finite() && **a > 0.0 && **a <= 1.0)) {
            return Err(c.error(
                "beta_end",
                format!("the schedule's cumulative alpha at timestep {i} is {a}; it must stay in (0, 1] (betas too large)"),
            ));
        }
        Ok(())
    }

    /// A reader over the raw fields, for sampler-specific options.
    pub fn options(&self) -> ConfigReader {
        ConfigReader::from_map(&self.path, self.raw.clone())
    }

    /// Cumulative products of alphas, in f32 like diffusers' torch tensors.
    pub fn alphas_cumprod(&self) -> Vec<f32> {
        let n = self.num_train_timesteps;
        let betas: Vec<f32> = match self.beta_schedule {
            BetaSchedule::Linear => linspace_f32(self.beta_start as f32, self.beta_end as f32, n),
            BetaSchedule::ScaledLinear => linspace_f32(self.beta_start.sqrt() as f32, self.beta_end.sqrt() as f32, n)
                .into_iter()
                .map(|b| b * b)
                .collect(),
            BetaSchedule::SquaredCosCapV2 => {
                let f = |t: f64| ((t + 0.008) / 1.008 * std::f64::consts::FRAC_PI_2).cos().powi(2);
                (0..n)
                    .map(|i| {
                        let (t1, t2) = (i as f64 / n as f64, (i + 1) as f64 / n as f64);
                        (1.0 - f(t2) / f(t1)).min(0.999) as f32
                    })
                    .collect()
            }
        };
        // torch's CPU cumprod accumulates float32 in double and rounds each
        // prefix once; a float32 running product drifts by up to 1e-6, which
        // small-t sigmas (sqrt((1 - a) / a), 1 - a small) amplify tenfold.
        let mut acc = 1f64;
        betas
            .iter()
            .map(|b| {
                acc *= (1.0 - b) as f64;
                acc as f32
            })
            .collect()
    }

    /// The inference timesteps, highest first, for `steps` steps.
    pub fn timesteps(&self, steps: usize) -> Vec<usize> {
        let n = self.num_train_timesteps;
        let steps = steps.clamp(1, n);
        match self.timestep_spacing {
            TimestepSpacing::Linspace => {
                let last = (n - 1) as f64;
                (0..steps)
                    .rev()
                    .map(|i| {
                        let v = if steps == 1 { 0.0 } else { last * i as f64 / (steps - 1) as f64 };
                        round_half_even(v) as usize
                    })
                    .collect()
            }
            TimestepSpacing::Leading => {
                let ratio = n / steps;
                (0..steps).rev().map(|i| i * ratio + self.steps_offset).collect()
            }
            TimestepSpacing::Trailing => {
                let ratio = n as f64 / steps as f64;
                let mut out = Vec::with_capacity(steps);
                let mut t = n as f64;
                while t > 0.0 && out.len() < steps {
                    out.push((round_half_even(t) as usize).saturating_sub(1));
                    t -= ratio;
                }
                out
            }
        }
    }
}

/// torch.linspace in f32: the first half counts up from `start`, the second
/// half down from `end`, which is how torch keeps both ends exact.
fn linspace_f32(start: f32, end: f32, n: usize) -> Vec<f32> {
    if n == 1 {
        return vec![start];
    }
    let step = (end - start) / (n - 1) as f32;
    let half = n / 2;
    (0..n)
        .map(|i| {
            if i < half {
                start + step * i as f32
            } else {
                end - step * (n - 1 - i) as f32
            }
        })
        .collect()
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leading_spacing_matches_diffusers() {
        let c = ScheduleConfig::default();
        assert_eq!(c.timesteps(5), vec![801, 601, 401, 201, 1]);
    }

    #[test]
    fn trailing_and_linspace() {
        let c = ScheduleConfig {
            timestep_spacing: TimestepSpacing::Trailing,
            ..Default::default()
        };
        assert_eq!(c.timesteps(4), vec![999, 749, 499, 249]);
        assert_eq!(c.timesteps(1), vec![999]);
        let c = ScheduleConfig {
            timestep_spacing: TimestepSpacing::Linspace,
            ..Default::default()
        };
        assert_eq!(c.timesteps(3), vec![999, 500, 0]);
    }

    #[test]
    fn round_half_even_is_numpy_round() {
        assert_eq!(round_half_even(0.5), 0.0);
        assert_eq!(round_half_even(1.5), 2.0);
        assert_eq!(round_half_even(2.5), 2.0);
        assert_eq!(round_half_even(2.6), 3.0);
    }
}
