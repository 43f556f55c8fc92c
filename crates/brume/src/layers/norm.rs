use candle_core::{DType, Result, Tensor, D};

use super::Activation;
use crate::error::LoadError;
use crate::loading::Weights;

/// Group normalisation over NCHW (or N, C, ...) tensors, statistics in f32.
#[derive(Debug, Clone)]
pub struct GroupNorm {
    weight: Tensor,
    bias: Tensor,
    groups: usize,
    channels: usize,
    eps: f64,
}

impl GroupNorm {
    pub fn load(w: &Weights, groups: usize, channels: usize, eps: f64) -> std::result::Result<Self, LoadError> {
        Ok(Self {
            weight: w.tensor("weight", &[channels])?,
            bias: w.tensor("bias", &[channels])?,
            groups,
            channels,
            eps,
        })
    }

    /// A group norm from its parameters (`weight` and `bias` of shape `[channels]`).
    pub fn from_tensors(weight: Tensor, bias: Tensor, groups: usize, eps: f64) -> Result<Self> {
        let channels = weight.dims1()?;
        if bias.dims1()? != channels || groups == 0 || channels % groups != 0 {
            candle_core::bail!("group norm: weight {:?}, bias {:?}, {groups} groups", weight.dims(), bias.dims());
        }
        Ok(Self { weight, bias, groups, channels, eps })
    }

    /// On the CPU in fast mode, one fused pass ([`crate::kernels::group_norm`]);
    /// otherwise [`GroupNorm::forward_reference`].
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.fused(x) {
            return crate::kernels::group_norm::group_norm(x, &self.weight, &self.bias, self.groups, self.eps, false);
        }
        self.forward_reference(x)
    }

    /// Group norm then `act`, as every resnet block and `conv_norm_out` does: with
    /// SiLU on the CPU in fast mode, both in one pass, saving two full-size temporaries.
    pub fn forward_then(&self, x: &Tensor, act: Activation) -> Result<Tensor> {
        if act == Activation::Silu && self.fused(x) {
            return crate::kernels::group_norm::group_norm(x, &self.weight, &self.bias, self.groups, self.eps, true);
        }
        act.forward(&self.forward(x)?)
    }

    fn fused(&self, x: &Tensor) -> bool {
        crate::kernels::use_fast(x) && self.weight.dtype() == DType::F32 && self.bias.dtype() == DType::F32
    }

    /// The plain candle path the kernel is proven against.
    pub fn forward_reference(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let b = dims[0];
        let dtype = x.dtype();
        let xg = x.to_dtype(DType::F32)?.reshape((b, self.groups, ()))?;
        let mean = xg.mean_keepdim(D::Minus1)?;
        let centered = xg.broadcast_sub(&mean)?;
        let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centered.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        let mut affine_shape = vec![1, self.channels];
        affine_shape.extend(std::iter::repeat_n(1, dims.len() - 2));
        let normed = normed.reshape(dims)?.to_dtype(dtype)?;
        normed
            .broadcast_mul(&self.weight.reshape(affine_shape.clone())?)?
            .broadcast_add(&self.bias.reshape(affine_shape)?)
    }
}

/// Layer normalisation over the last dimension.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f32,
}

impl LayerNorm {
    pub fn load(w: &Weights, dim: usize, eps: f64) -> std::result::Result<Self, LoadError> {
        Ok(Self {
            weight: w.tensor("weight", &[dim])?,
            bias: w.tensor("bias", &[dim])?,
            eps: eps as f32,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        candle_nn::ops::layer_norm(&x.contiguous()?, &self.weight, &self.bias, self.eps)
    }
}
