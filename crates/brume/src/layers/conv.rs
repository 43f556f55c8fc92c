use candle_core::{Result, Tensor};

use super::mapped;
use super::Param;
use crate::error::LoadError;
use crate::loading::Weights;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2dConfig {
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
}

impl Conv2dConfig {
    pub const K3: Self = Self {
        kernel: 3,
        stride: 1,
        padding: 1,
    };
    pub const K1: Self = Self {
        kernel: 1,
        stride: 1,
        padding: 0,
    };
}

/// 2-D convolution over NCHW tensors.
#[derive(Debug, Clone)]
pub struct Conv2d {
    weight: Param,
    bias: Option<Tensor>,
    cfg: Conv2dConfig,
    /// f32 products even under bf16 compute ([`super::f32_products`]).
    exact: bool,
}

impl Conv2d {
    pub fn load(w: &Weights, in_ch: usize, out_ch: usize, cfg: Conv2dConfig, bias: bool) -> std::result::Result<Self, LoadError> {
        let weight = Param::load(w, "weight", &[out_ch, in_ch, cfg.kernel, cfg.kernel])?;
        let bias = if bias { Some(w.tensor("bias", &[out_ch])?) } else { None };
        let exact = super::f32_products(&w.name("weight"));
        Ok(Self { weight, bias, cfg, exact })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match &self.weight {
            Param::Mapped(m) if x.dtype() == candle_core::DType::F32 => mapped::conv2d(x, m, self.cfg.stride, self.cfg.padding, !self.exact)?,
            Param::Mapped(m) => x.conv2d(&m.to_tensor(x.device())?, self.cfg.padding, self.cfg.stride, 1, 1)?,
            Param::Packed(p) if x.dtype() == candle_core::DType::F32 => mapped::conv2d_packed(x, p, self.cfg.stride, self.cfg.padding, !self.exact)?,
            Param::Packed(p) => x.conv2d(&p.to_tensor(x.device())?.to_dtype(x.dtype())?, self.cfg.padding, self.cfg.stride, 1, 1)?,
            Param::Dense(t) if crate::kernels::use_fast(x) && t.dtype() == x.dtype() && matches!(t.device(), candle_core::Device::Cpu) => {
                mapped::conv2d_dense(x, t, self.cfg.stride, self.cfg.padding, !self.exact)?
            }
            Param::Dense(t) => x.conv2d(t, self.cfg.padding, self.cfg.stride, 1, 1)?,
        };
        match &self.bias {
            Some(b) => y.broadcast_add(&b.reshape((1, b.dim(0)?, 1, 1))?),
            None => Ok(y),
        }
    }
}
