use candle_core::{Result, Tensor};

use super::mapped;
use super::Param;
use crate::error::LoadError;
use crate::loading::Weights;

/// `y = x W^T + b` over the last dimension, any number of leading dimensions.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Param,
    bias: Option<Tensor>,
    in_features: usize,
    out_features: usize,
    /// f32 products even under bf16 compute ([`super::f32_products`]).
    exact: bool,
}

impl Linear {
    /// Loads `weight` [out, in] and, when `bias`, `bias` [out].
    pub fn load(w: &Weights, in_features: usize, out_features: usize, bias: bool) -> std::result::Result<Self, LoadError> {
        let weight = Param::load(w, "weight", &[out_features, in_features])?;
        let exact = super::f32_products(&w.name("weight"));
        let bias = if bias {
            Some(w.tensor("bias", &[out_features])?)
        } else {
            None
        };
        Ok(Self {
            weight,
            bias,
            in_features,
            out_features,
            exact,
        })
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let x2 = x.reshape((rows, self.in_features))?;
        let mut out = dims;
        if let Some(last) = out.last_mut() {
            *last = self.out_features;
        }
        // Our kernels add the bias in place (`--kernels reference`: the separate op).
        if crate::kernels::mode() == crate::kernels::KernelMode::Fast {
            let held = super::epilogue::Held::new(self.bias.as_ref());
            if let Ok(bias) = held.f32() {
                if let Some(y) = mapped::linear_param(&x2, &self.weight, !self.exact, bias)? {
                    return y.reshape(out);
                }
            }
        }
        let y = match mapped::linear_param(&x2, &self.weight, !self.exact, None)? {
            Some(y) => y,
            None => match &self.weight {
                Param::Mapped(m) => x2.matmul(&m.to_tensor(x2.device())?.t()?)?,
                Param::Packed(p) => x2.matmul(&p.to_tensor(x2.device())?.to_dtype(x2.dtype())?.t()?)?,
                Param::Dense(t) => x2.matmul(&t.t()?)?,
            },
        };
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        y.reshape(out)
    }

    /// diffusers' GEGLU over this projection: `a * gelu_erf(gate)` where `a` and `gate`
    /// are the first and second halves of [`Self::forward`]'s output. Under bf16
    /// compute with an in-place weight the product is made and consumed a block of rows
    /// at a time, so its full [.., out] output never exists (same values to the bit);
    /// elsewhere the two ops run one after the other.
    pub fn forward_geglu(&self, x: &Tensor) -> Result<Tensor> {
        if self.out_features % 2 != 0 {
            candle_core::bail!("GEGLU needs an even projection width, this one has {}", self.out_features);
        }
        let inner = self.out_features / 2;
        let dims = x.dims().to_vec();
        let mut out = dims.clone();
        if let Some(last) = out.last_mut() {
            *last = inner;
        }
        if crate::kernels::mode() == crate::kernels::KernelMode::Fast && !self.exact {
            let held = super::epilogue::Held::new(self.bias.as_ref());
            if let Ok(bias) = held.f32() {
                let rows: usize = dims[..dims.len() - 1].iter().product();
                if let Some(y) = mapped::linear_geglu_param(&x.reshape((rows, self.in_features))?, &self.weight, bias)? {
                    return y.reshape(out);
                }
            }
        }
        let h = self.forward(x)?;
        if crate::kernels::use_fast(&h) {
            return crate::kernels::geglu::geglu(&h);
        }
        let last = h.rank() - 1;
        let a = h.narrow(last, 0, inner)?;
        let gate = h.narrow(last, inner, inner)?;
        a * gate.gelu_erf()?
    }
}
