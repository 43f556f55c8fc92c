//! DPM-Solver++ (2M) and its SDE variant, as diffusers'
//! `DPMSolverMultistepScheduler` with `algorithm_type` "dpmsolver++" or
//! "sde-dpmsolver++" and `solver_order` 1 or 2: an exponential integrator in
//! the half log-SNR lambda on the data prediction, reusing the previous
//! step's prediction for the second order.

use candle_core::{Result, Tensor};
use serde_json::json;

use super::euler::final_sigmas_is_min;
use super::schedule::{BetaSchedule, PredictionType, ScheduleConfig};
use super::sigmas::{self, alpha_sigma, axpby, expect_false, lambda};
use super::{NoiseSource, Sampler};
use crate::error::LoadError;

/// diffusers' `algorithm_type`, the ones brume implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DpmAlgorithm {
    /// "dpmsolver++": deterministic.
    DpmSolverPP,
    /// "sde-dpmsolver++": fresh noise every step.
    SdeDpmSolverPP,
}

/// What `build` forces, whatever the config says (the CLI name decides).
#[derive(Debug, Clone, Copy)]
pub struct DpmVariant {
    pub algorithm: DpmAlgorithm,
    pub karras: bool,
}

pub struct DpmSolver {
    cfg: ScheduleConfig,
    variant: DpmVariant,
    timesteps: Vec<f64>,
    sigmas: Vec<f64>,
    order: usize,
    heun: bool,
    lower_order_final: bool,
    euler_at_final: bool,
    final_zero: bool,
    /// Data predictions of the previous and the current step (diffusers' `model_outputs`).
    outputs: Vec<Tensor>,
    lower_order_nums: usize,
}

impl DpmSolver {
    /// Reads `solver_order` (1, 2), `solver_type` (midpoint, heun; the UniPC /
    /// DEIS names map to midpoint as in diffusers), `lower_order_final`,
    /// `euler_at_final`, `final_sigmas_type`, `lambda_min_clipped`; the sigma
    /// schedules other than Karras, flow sigmas, dynamic shifting and learned
    /// variances are rejected.
    pub fn new(cfg: &ScheduleConfig, steps: usize, variant: DpmVariant) -> std::result::Result<Self, LoadError> {
        let c = cfg.options();
        c.expect_one_of("solver_order", &[json!(1), json!(2)])?;
        let order = c.usize("solver_order", Some(2))?;
        c.expect_one_of(
            "solver_type",
            &[json!("midpoint"), json!("heun"), json!("logrho"), json!("bh1"), json!("bh2")],
        )?;
        let heun = c.string("solver_type")?.as_deref() == Some("heun");
        c.expect_unset("variance_type")?;
        for f in ["use_lu_lambdas", "use_exponential_sigmas", "use_beta_sigmas", "use_flow_sigmas", "use_dynamic_shifting"] {
            expect_false(&c, f)?;
        }
        let final_zero = !final_sigmas_is_min(&c)?;
        let lower_order_final = c.bool("lower_order_final", true)?;
        let euler_at_final = c.bool("euler_at_final", false)?;
        let lambda_min_clipped = c.f64("lambda_min_clipped", f64::NEG_INFINITY)?;

        let ac = cfg.alphas_cumprod();
        let table = sigmas::train_sigmas(&ac);
        // searchsorted(flip(lambda_t), lambda_min_clipped): how many lambdas lie below the clip.
        let clipped = ac
            .iter()
            .map(|&a| a.sqrt().ln() - (1.0 - a).sqrt().ln())
            .filter(|&l| (l as f64) < lambda_min_clipped)
            .count();
        let last = cfg.num_train_timesteps - clipped;
        let mut timesteps = sigmas::multistep_timesteps(cfg, steps, last);
        let mut sig: Vec<f64> = if variant.karras {
            let s = sigmas::karras(table[0] as f64, table[table.len() - 1] as f64, steps);
            let log = sigmas::log_sigmas(&table);
            let round = cfg.beta_schedule != BetaSchedule::SquaredCosCapV2;
            timesteps = s
                .iter()
                .map(|&x| {
                    let t = sigmas::sigma_to_t(x, &log);
                    if round { sigmas::round_half_even(t) } else { t.trunc() }
                })
                .collect();
            s
        } else {
            timesteps.iter().map(|&t| sigmas::interp(t, &table)).collect()
        };
        sig.push(if final_zero { 0.0 } else { table[0] as f64 });
        Ok(Self {
            cfg: cfg.clone(),
            variant,
            timesteps,
            sigmas: sig.into_iter().map(|s| s as f32 as f64).collect(),
            order,
            heun,
            lower_order_final,
            euler_at_final,
            final_zero,
            outputs: Vec::new(),
            lower_order_nums: 0,
        })
    }

    /// The data prediction x_0 (diffusers' `convert_model_output` for the ++ algorithms).
    fn data_prediction(&self, model_output: &Tensor, sample: &Tensor, index: usize) -> Result<Tensor> {
        let (a, s) = alpha_sigma(self.sigmas[index]);
        match self.cfg.prediction_type {
            PredictionType::Epsilon => (sample - (model_output * s)?)? / a,
            PredictionType::Sample => Ok(model_output.clone()),
            PredictionType::VPrediction => axpby(sample, a, model_output, -s),
        }
    }
}

impl Sampler for DpmSolver {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn step(&mut self, model_output: &Tensor, index: usize, sample: &Tensor, noise: &mut dyn NoiseSource) -> Result<Tensor> {
        let n = self.timesteps.len();
        let final_first_order =
            index == n - 1 && (self.euler_at_final || (self.lower_order_final && n < 15) || self.final_zero);
        let x0 = self.data_prediction(model_output, sample, index)?;
        if self.outputs.len() == self.order {
            self.outputs.remove(0);
        }
        self.outputs.push(x0);
        let z = match self.variant.algorithm {
            DpmAlgorithm::SdeDpmSolverPP => Some(noise.randn(model_output.dims(), model_output.device())?.to_dtype(sample.dtype())?),
            DpmAlgorithm::DpmSolverPP => None,
        };
        let sde = z.is_some();

        let (alpha_t, sigma_t) = alpha_sigma(self.sigmas[index + 1]);
        let (_, sigma_s0) = alpha_sigma(self.sigmas[index]);
        let h = lambda(self.sigmas[index + 1]) - lambda(self.sigmas[index]);
        let m0 = &self.outputs[self.outputs.len() - 1];
        let first_order = self.order == 1 || self.lower_order_nums < 1 || final_first_order;
        // x_t = c_x * sample + c_d0 * D0 (+ c_d1 * D1) (+ c_z * z)
        let (c_x, c_d) = if sde {
            ((sigma_t / sigma_s0) * (-h).exp(), alpha_t * (1.0 - (-2.0 * h).exp()))
        } else {
            (sigma_t / sigma_s0, -(alpha_t * ((-h).exp() - 1.0)))
        };
        let mut x = axpby(sample, c_x, m0, c_d)?;
        if !first_order {
            let m1 = &self.outputs[self.outputs.len() - 2];
            let h0 = lambda(self.sigmas[index]) - lambda(self.sigmas[index - 1]);
            let r0 = h0 / h;
            let d1 = ((m0 - m1)? * (1.0 / r0))?;
            let c_d1 = match (sde, self.heun) {
                (false, false) => -0.5 * (alpha_t * ((-h).exp() - 1.0)),
                (false, true) => alpha_t * (((-h).exp() - 1.0) / h + 1.0),
                (true, false) => 0.5 * (alpha_t * (1.0 - (-2.0 * h).exp())),
                (true, true) => alpha_t * ((1.0 - (-2.0 * h).exp()) / (-2.0 * h) + 1.0),
            };
            x = (x + (d1 * c_d1)?)?;
        }
        if let Some(z) = z {
            x = (x + (z * (sigma_t * (1.0 - (-2.0 * h).exp()).sqrt()))?)?;
        }
        if self.lower_order_nums < self.order {
            self.lower_order_nums += 1;
        }
        Ok(x)
    }

    /// `alpha_t * original + sigma_t * noise` at `sigmas[index]`, as diffusers.
    fn add_noise(&self, original: &Tensor, noise: &Tensor, index: usize) -> Result<Tensor> {
        let (a, s) = alpha_sigma(self.sigmas[index]);
        axpby(original, a, noise, s)
    }
}
