//! Helpers shared by the sigma-based samplers: the sigma table of a schedule,
//! numpy's spacing and interpolation rules, Karras sigmas, sigma -> timestep.
//!
//! diffusers computes these with a mix of float32 torch tensors and float64
//! numpy arrays; the helpers keep the same precision at each stage (f32 where
//! diffusers holds a float32 array) so timesteps agree to float32 rounding.

use candle_core::{Result, Tensor};

use crate::error::LoadError;
use crate::models::config::ConfigReader;

use super::schedule::{PredictionType, ScheduleConfig, TimestepSpacing};

/// `((1 - alphas_cumprod) / alphas_cumprod) ** 0.5` in float32, ascending in
/// training timestep (diffusers' `sigmas` before `set_timesteps` reverses them).
pub fn train_sigmas(alphas_cumprod: &[f32]) -> Vec<f32> {
    alphas_cumprod.iter().map(|&a| ((1.0 - a) / a).sqrt()).collect()
}

/// `np.linspace(start, stop, num)` (endpoint included), in float64.
pub fn np_linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    match num {
        0 => vec![],
        1 => vec![start],
        _ => {
            let step = (stop - start) / (num - 1) as f64;
            let mut v: Vec<f64> = (0..num).map(|i| i as f64 * step + start).collect();
            v[num - 1] = stop;
            v
        }
    }
}

/// `np.arange(start, 0, -step)` for positive `start` and `step`: numpy sizes it
/// as `ceil(start / step)` and computes `start - i * step`.
pub fn np_arange_down(start: f64, step: f64) -> Vec<f64> {
    let len = (start / step).ceil().max(0.0) as usize;
    (0..len).map(|i| start + i as f64 * -step).collect()
}

/// numpy's `round` (half to even).
pub fn round_half_even(v: f64) -> f64 {
    let r = v.round();
    if (v - v.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - v.signum()
    } else {
        r
    }
}

/// `np.interp(x, np.arange(len(table)), table)`: linear interpolation of the
/// table at a (possibly fractional) timestep, clamped at both ends.
pub fn interp(x: f64, table: &[f32]) -> f64 {
    let n = table.len();
    if x <= 0.0 {
        return table[0] as f64;
    }
    if x >= (n - 1) as f64 {
        return table[n - 1] as f64;
    }
    let j = x.floor() as usize;
    let (lo, hi) = (table[j] as f64, table[j + 1] as f64);
    if x == j as f64 {
        return lo;
    }
    (hi - lo) * (x - j as f64) + lo
}

/// Karras et al. (2022) sigmas, rho = 7, from `sigma_max` down to `sigma_min`
/// (diffusers' `_convert_to_karras`), in float64 like its numpy code.
pub fn karras(sigma_min: f64, sigma_max: f64, steps: usize) -> Vec<f64> {
    let rho = 7.0;
    let (min_inv, max_inv) = (sigma_min.powf(1.0 / rho), sigma_max.powf(1.0 / rho));
    np_linspace(0.0, 1.0, steps)
        .into_iter()
        .map(|r| (max_inv + r * (min_inv - max_inv)).powf(rho))
        .collect()
}

/// The fractional training timestep whose sigma is `sigma`, by linear
/// interpolation in log-sigma (diffusers' `_sigma_to_t`). `log_sigmas` is the
/// float32 log of [`train_sigmas`], as numpy computes it.
pub fn sigma_to_t(sigma: f64, log_sigmas: &[f32]) -> f64 {
    let log_sigma = sigma.max(1e-10).ln();
    let n = log_sigmas.len();
    let count = log_sigmas.iter().filter(|&&l| log_sigma - l as f64 >= 0.0).count();
    let low_idx = count.saturating_sub(1).min(n - 2);
    let (low, high) = (log_sigmas[low_idx], log_sigmas[low_idx + 1]);
    let w = ((low as f64 - log_sigma) / (low - high) as f64).clamp(0.0, 1.0);
    (1.0 - w) * low_idx as f64 + w * (low_idx + 1) as f64
}

pub fn log_sigmas(train_sigmas: &[f32]) -> Vec<f32> {
    train_sigmas.iter().map(|s| s.ln()).collect()
}

/// The float timesteps of the Euler-family schedulers (Euler, Euler
/// ancestral, Heun): `linspace` keeps fractional values, `leading` and
/// `trailing` are integers, all rounded to float32 like diffusers.
pub fn float_timesteps(cfg: &ScheduleConfig, steps: usize) -> Vec<f64> {
    let n = cfg.num_train_timesteps;
    let v: Vec<f64> = match cfg.timestep_spacing {
        TimestepSpacing::Linspace => np_linspace(0.0, (n - 1) as f64, steps).into_iter().rev().collect(),
        TimestepSpacing::Leading => {
            let ratio = n / steps;
            (0..steps).rev().map(|i| (i * ratio) as f64 + cfg.steps_offset as f64).collect()
        }
        TimestepSpacing::Trailing => np_arange_down(n as f64, n as f64 / steps as f64)
            .into_iter()
            .map(|t| round_half_even(t) - 1.0)
            .collect(),
    };
    v.into_iter().map(|t| t as f32 as f64).collect()
}

/// The integer timesteps of the multistep solvers (DPM-Solver++, UniPC): they
/// space `steps + 1` points and drop the last, so the final step lands on
/// sigma 0 rather than on a training timestep. `last` is the exclusive upper
/// bound (diffusers' `last_timestep`, below `num_train_timesteps` only when
/// DPM-Solver's `lambda_min_clipped` cuts the schedule).
pub fn multistep_timesteps(cfg: &ScheduleConfig, steps: usize, last: usize) -> Vec<f64> {
    let n = cfg.num_train_timesteps;
    match cfg.timestep_spacing {
        TimestepSpacing::Linspace => {
            let mut v: Vec<f64> = np_linspace(0.0, last as f64 - 1.0, steps + 1)
                .into_iter()
                .map(round_half_even)
                .rev()
                .collect();
            v.pop();
            v
        }
        TimestepSpacing::Leading => {
            let ratio = last / (steps + 1);
            (1..=steps).rev().map(|i| (i * ratio + cfg.steps_offset) as f64).collect()
        }
        TimestepSpacing::Trailing => np_arange_down(last as f64, n as f64 / steps as f64)
            .into_iter()
            .map(|t| round_half_even(t) - 1.0)
            .collect(),
    }
}

/// What an optional float field holds (`sigma_min`, `sigma_max`); null is unset.
pub fn opt_f64(c: &ConfigReader, field: &str) -> std::result::Result<Option<f64>, LoadError> {
    match c.get(field) {
        Some(_) => c.f64(field, 0.0).map(Some),
        None => Ok(None),
    }
}

/// Fails unless the boolean option is absent or false: the option selects a
/// variant brume does not implement.
pub fn expect_false(c: &ConfigReader, field: &str) -> std::result::Result<(), LoadError> {
    if c.bool(field, false)? {
        return Err(c.error(field, "true is not supported by brume (supported: false)"));
    }
    Ok(())
}

/// `a * ca + b * cb`.
pub fn axpby(a: &Tensor, ca: f64, b: &Tensor, cb: f64) -> Result<Tensor> {
    (a * ca)? + (b * cb)?
}

/// The denoised estimate of the Karras-style (variance exploding) samplers,
/// where the sample is `x0 + sigma * eps` (Euler, Euler ancestral, Heun).
pub fn ve_denoised(pred: PredictionType, model_output: &Tensor, sample: &Tensor, sigma: f64) -> Result<Tensor> {
    match pred {
        PredictionType::Epsilon => sample - (model_output * sigma)?,
        PredictionType::VPrediction => {
            let s2 = sigma * sigma + 1.0;
            axpby(model_output, -sigma / s2.sqrt(), sample, 1.0 / s2)
        }
        PredictionType::Sample => Ok(model_output.clone()),
    }
}

/// `alpha_t, sigma_t` of the variance-preserving sample at sigma (diffusers'
/// `_sigma_to_alpha_sigma_t`), computed in float32 like its tensors.
pub fn alpha_sigma(sigma: f64) -> (f64, f64) {
    let s = sigma as f32;
    let alpha = 1.0 / (s * s + 1.0).sqrt();
    (alpha as f64, (s * alpha) as f64)
}

/// `log(alpha_t) - log(sigma_t)`: the half log-SNR the multistep solvers step in.
pub fn lambda(sigma: f64) -> f64 {
    let (a, s) = alpha_sigma(sigma);
    a.ln() - s.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numpy_helpers() {
        assert_eq!(np_linspace(0.0, 1.0, 1), vec![0.0]);
        assert_eq!(np_linspace(0.0, 999.0, 4), vec![0.0, 333.0, 666.0, 999.0]);
        assert_eq!(np_arange_down(1000.0, 250.0), vec![1000.0, 750.0, 500.0, 250.0]);
        assert_eq!(interp(1.5, &[0.0, 1.0, 3.0]), 2.0);
        assert_eq!(interp(7.0, &[0.0, 1.0, 3.0]), 3.0);
    }

    #[test]
    fn sigma_to_t_inverts_the_table() {
        let ac = ScheduleConfig::default().alphas_cumprod();
        let s = train_sigmas(&ac);
        let ls = log_sigmas(&s);
        for t in [0usize, 1, 400, 998, 999] {
            assert!((sigma_to_t(s[t] as f64, &ls) - t as f64).abs() < 1e-3, "{t}");
        }
    }
}
