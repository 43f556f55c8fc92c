//! Timestep embeddings (diffusers `embeddings.py`: `Timesteps`, `TimestepEmbedding`).

use candle_core::{DType, Device, Result, Tensor};

use crate::error::LoadError;
use crate::layers::{Activation, Linear};
use crate::loading::Weights;

/// Sinusoidal embedding of timesteps, computed in f32 in the same order of
/// operations as diffusers' `get_timestep_embedding`, so rounding matches.
pub fn timestep_embedding(
    timesteps: &[f32],
    dim: usize,
    flip_sin_to_cos: bool,
    freq_shift: f64,
    device: &Device,
) -> Result<Tensor> {
    let half = dim / 2;
    // diffusers multiplies an f32 arange by the f64 constant -ln(10000), rounded to f32.
    let log_period = (-(10000f64).ln()) as f32;
    let denom = (half as f64 - freq_shift) as f32;
    let freqs: Vec<f32> = (0..half).map(|i| ((log_period * i as f32) / denom).exp()).collect();
    let mut out = Vec::with_capacity(timesteps.len() * dim);
    for &t in timesteps {
        let args: Vec<f32> = freqs.iter().map(|f| t * f).collect();
        let (first, second): (Vec<f32>, Vec<f32>) = if flip_sin_to_cos {
            (args.iter().map(|a| a.cos()).collect(), args.iter().map(|a| a.sin()).collect())
        } else {
            (args.iter().map(|a| a.sin()).collect(), args.iter().map(|a| a.cos()).collect())
        };
        out.extend(first);
        out.extend(second);
        if dim % 2 == 1 {
            out.push(0.0);
        }
    }
    Tensor::from_vec(out, (timesteps.len(), dim), device)
}

/// `TimestepEmbedding`: linear_1 -> act -> linear_2, with the optional LCM
/// `cond_proj` (guidance-scale embedding added to the input).
pub struct TimestepEmbedding {
    linear_1: Linear,
    linear_2: Linear,
    cond_proj: Option<Linear>,
    act: Activation,
}

impl TimestepEmbedding {
    pub fn load(
        w: &Weights,
        in_dim: usize,
        embed_dim: usize,
        act: Activation,
        cond_proj_dim: Option<usize>,
    ) -> std::result::Result<Self, LoadError> {
        Ok(Self {
            linear_1: Linear::load(&w.pp("linear_1"), in_dim, embed_dim, true)?,
            linear_2: Linear::load(&w.pp("linear_2"), embed_dim, embed_dim, true)?,
            cond_proj: cond_proj_dim
                .map(|d| Linear::load(&w.pp("cond_proj"), d, in_dim, false))
                .transpose()?,
            act,
        })
    }

    pub fn forward(&self, sample: &Tensor, cond: Option<&Tensor>) -> Result<Tensor> {
        let sample = match (&self.cond_proj, cond) {
            (Some(proj), Some(c)) => (sample + proj.forward(&c.to_dtype(sample.dtype())?)?)?,
            _ => sample.clone(),
        };
        self.linear_2.forward(&self.act.forward(&self.linear_1.forward(&sample)?)?)
    }
}

/// The LCM guidance-scale embedding `w -> sinusoid(w * 1000)` (diffusers'
/// `get_guidance_scale_embedding`), fed to `time_cond_proj_dim` UNets.
pub fn guidance_scale_embedding(w: &[f32], dim: usize, device: &Device) -> Result<Tensor> {
    let half = dim / 2;
    let step = (10000f32).ln() / (half as f32 - 1.0);
    let freqs: Vec<f32> = (0..half).map(|i| (i as f32 * -step).exp()).collect();
    let mut out = Vec::with_capacity(w.len() * dim);
    for &g in w {
        let g = g * 1000.0;
        let args: Vec<f32> = freqs.iter().map(|f| g * f).collect();
        out.extend(args.iter().map(|a| a.sin()));
        out.extend(args.iter().map(|a| a.cos()));
        if dim % 2 == 1 {
            out.push(0.0);
        }
    }
    Tensor::from_vec(out, (w.len(), dim), device)?.to_dtype(DType::F32)
}
