//! UniPC, as diffusers' `UniPCMultistepScheduler` with `solver_order` 1 or 2:
//! a multistep predictor (UniP) followed, at the next evaluation, by a
//! corrector (UniC) that reuses the fresh model output to refine the sample
//! the predictor produced, at no extra model cost.

use candle_core::{Result, Tensor};
use serde_json::json;

use super::euler::final_sigmas_is_min;
use super::schedule::{PredictionType, ScheduleConfig};
use super::sigmas::{self, alpha_sigma, axpby, expect_false, lambda, opt_f64};
use super::{NoiseSource, Sampler};
use crate::error::LoadError;

pub struct UniPc {
    cfg: ScheduleConfig,
    timesteps: Vec<f64>,
    sigmas: Vec<f64>,
    order: usize,
    /// `predict_x0`: the solver works on the data prediction (default) or the noise.
    predict_x0: bool,
    /// `solver_type` "bh2" (default): B(h) = e^h - 1; "bh1": B(h) = h.
    bh2: bool,
    lower_order_final: bool,
    disable_corrector: Vec<usize>,
    outputs: Vec<Tensor>,
    lower_order_nums: usize,
    /// The predictor's input, which the corrector restarts from (diffusers' `last_sample`).
    last_sample: Option<Tensor>,
    this_order: usize,
}

impl UniPc {
    /// Reads `solver_order`, `predict_x0`, `solver_type` (bh1, bh2; DPM-Solver's
    /// names map to bh2 as in diffusers), `lower_order_final`,
    /// `disable_corrector`, `use_karras_sigmas`, `sigma_min`, `sigma_max`,
    /// `final_sigmas_type`; `solver_p` and the other sigma schedules are rejected.
    pub fn new(cfg: &ScheduleConfig, steps: usize) -> std::result::Result<Self, LoadError> {
        let c = cfg.options();
        c.expect_one_of("solver_order", &[json!(1), json!(2)])?;
        let order = c.usize("solver_order", Some(2))?;
        c.expect_one_of(
            "solver_type",
            &[json!("bh1"), json!("bh2"), json!("midpoint"), json!("heun"), json!("logrho")],
        )?;
        let bh2 = c.string("solver_type")?.as_deref() != Some("bh1");
        c.expect_unset("solver_p")?;
        c.expect_unset("shift_terminal")?;
        for f in ["use_exponential_sigmas", "use_beta_sigmas", "use_flow_sigmas", "use_dynamic_shifting"] {
            expect_false(&c, f)?;
        }
        let disable_corrector = if c.get("disable_corrector").is_some() { c.usizes("disable_corrector")? } else { vec![] };
        let final_sigma_min = final_sigmas_is_min(&c)?;
        let karras = c.bool("use_karras_sigmas", false)?;

        let table = sigmas::train_sigmas(&cfg.alphas_cumprod());
        let mut timesteps = sigmas::multistep_timesteps(cfg, steps, cfg.num_train_timesteps);
        let mut sig: Vec<f64>;
        if karras {
            let lo = opt_f64(&c, "sigma_min")?.unwrap_or(table[0] as f64);
            let hi = opt_f64(&c, "sigma_max")?.unwrap_or(table[table.len() - 1] as f64);
            sig = sigmas::karras(lo, hi, steps);
            let log = sigmas::log_sigmas(&table);
            timesteps = sig.iter().map(|&s| sigmas::round_half_even(sigmas::sigma_to_t(s, &log))).collect();
            let last = if final_sigma_min { sig[sig.len() - 1] } else { 0.0 };
            sig.push(last);
        } else {
            sig = timesteps.iter().map(|&t| sigmas::interp(t, &table)).collect();
            sig.push(if final_sigma_min { table[0] as f64 } else { 0.0 });
        }
        Ok(Self {
            cfg: cfg.clone(),
            timesteps,
            sigmas: sig.into_iter().map(|s| s as f32 as f64).collect(),
            order,
            predict_x0: c.bool("predict_x0", true)?,
            bh2,
            lower_order_final: c.bool("lower_order_final", true)?,
            disable_corrector,
            outputs: Vec::new(),
            lower_order_nums: 0,
            last_sample: None,
            this_order: 1,
        })
    }

    /// diffusers' `convert_model_output`: the data or the noise prediction.
    fn convert(&self, model_output: &Tensor, sample: &Tensor, index: usize) -> Result<Tensor> {
        let (a, s) = alpha_sigma(self.sigmas[index]);
        let pred = self.cfg.prediction_type;
        if self.predict_x0 {
            match pred {
                PredictionType::Epsilon => (sample - (model_output * s)?)? / a,
                PredictionType::Sample => Ok(model_output.clone()),
                PredictionType::VPrediction => axpby(sample, a, model_output, -s),
            }
        } else {
            match pred {
                PredictionType::Epsilon => Ok(model_output.clone()),
                PredictionType::Sample => (sample - (model_output * a)?)? / s,
                PredictionType::VPrediction => axpby(model_output, a, sample, s),
            }
        }
    }

    /// The shared part of UniP and UniC from sigma `s0` to sigma `t`:
    /// (the first-order update, its B(h) weight, hh, h).
    fn base(&self, x: &Tensor, m0: &Tensor, sigma_s0: f64, sigma_t: f64) -> Result<(Tensor, f64, f64, f64)> {
        let (alpha_t, sig_t) = alpha_sigma(sigma_t);
        let (alpha_s0, sig_s0) = alpha_sigma(sigma_s0);
        let h = lambda(sigma_t) - lambda(sigma_s0);
        let hh = if self.predict_x0 { -h } else { h };
        let h_phi_1 = hh.exp_m1();
        let b_h = if self.bh2 { hh.exp_m1() } else { hh };
        let (x_t, w) = if self.predict_x0 {
            (axpby(x, sig_t / sig_s0, m0, -alpha_t * h_phi_1)?, alpha_t * b_h)
        } else {
            (axpby(x, alpha_t / alpha_s0, m0, -sig_t * h_phi_1)?, sig_t * b_h)
        };
        Ok((x_t, w, hh, h))
    }

    /// The b vector of the UniC linear system for `order` (diffusers' loop over h_phi_k).
    fn b_vector(hh: f64, b_h: f64, order: usize) -> Vec<f64> {
        let mut h_phi_k = hh.exp_m1() / hh - 1.0;
        let mut factorial = 1.0;
        let mut b = Vec::with_capacity(order);
        for i in 1..=order {
            b.push(h_phi_k * factorial / b_h);
            factorial *= (i + 1) as f64;
            h_phi_k = h_phi_k / hh - 1.0 / factorial;
        }
        b
    }

    /// UniP from `sigmas[index]` to `sigmas[index + 1]`.
    fn predictor(&self, x: &Tensor, index: usize, order: usize) -> Result<Tensor> {
        let k = self.outputs.len();
        let m0 = &self.outputs[k - 1];
        let (x_t, w, _, h) = self.base(x, m0, self.sigmas[index], self.sigmas[index + 1])?;
        if order < 2 {
            return Ok(x_t);
        }
        let rk = (lambda(self.sigmas[index - 1]) - lambda(self.sigmas[index])) / h;
        let d1 = ((&self.outputs[k - 2] - m0)? / rk)?;
        // Order 2: rho_p = 0.5, as diffusers fixes it.
        x_t - (d1 * (w * 0.5))?
    }

    /// UniC of the previous step's prediction, from `sigmas[index - 1]` to `sigmas[index]`.
    fn corrector(&self, model_t: &Tensor, last: &Tensor, index: usize, order: usize) -> Result<Tensor> {
        let k = self.outputs.len();
        let m0 = &self.outputs[k - 1];
        let (x_t, w, hh, h) = self.base(last, m0, self.sigmas[index - 1], self.sigmas[index])?;
        let b_h = if self.bh2 { hh.exp_m1() } else { hh };
        let d1_t = (model_t - m0)?;
        if order < 2 {
            return x_t - (d1_t * (w * 0.5))?;
        }
        let rk = (lambda(self.sigmas[index - 2]) - lambda(self.sigmas[index - 1])) / h;
        let d1 = ((&self.outputs[k - 2] - m0)? / rk)?;
        // Solve [[1, 1], [rk, 1]] rho = b.
        let b = Self::b_vector(hh, b_h, 2);
        let det = 1.0 - rk;
        let rho0 = (b[0] - b[1]) / det;
        let rho1 = (b[1] - rk * b[0]) / det;
        x_t - (axpby(&d1, rho0, &d1_t, rho1)? * w)?
    }
}

impl Sampler for UniPc {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn step(&mut self, model_output: &Tensor, index: usize, sample: &Tensor, _noise: &mut dyn NoiseSource) -> Result<Tensor> {
        let converted = self.convert(model_output, sample, index)?;
        let use_corrector = index > 0 && !self.disable_corrector.contains(&(index - 1));
        let sample = match (&self.last_sample, use_corrector) {
            (Some(last), true) => self.corrector(&converted, last, index, self.this_order)?,
            _ => sample.clone(),
        };
        if self.outputs.len() == self.order {
            self.outputs.remove(0);
        }
        self.outputs.push(converted);
        let n = self.timesteps.len();
        let order = if self.lower_order_final { self.order.min(n - index) } else { self.order };
        self.this_order = order.min(self.lower_order_nums + 1);
        let prev = self.predictor(&sample, index, self.this_order)?;
        self.last_sample = Some(sample);
        if self.lower_order_nums < self.order {
            self.lower_order_nums += 1;
        }
        Ok(prev)
    }

    fn add_noise(&self, original: &Tensor, noise: &Tensor, index: usize) -> Result<Tensor> {
        let (a, s) = alpha_sigma(self.sigmas[index]);
        axpby(original, a, noise, s)
    }
}
