use candle_core::{Result, Tensor};

/// Activation functions by their config names (`act_fn`, `hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// Exact (erf) GELU, as torch's default `gelu`.
    Gelu,
    /// x * sigmoid(1.702 x): OpenAI CLIP's approximation, used by SD 1.x.
    QuickGelu,
    Relu,
}

impl Activation {
    /// Parses a config value; `None` for a name we do not implement.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "silu" | "swish" => Self::Silu,
            "gelu" => Self::Gelu,
            "quick_gelu" => Self::QuickGelu,
            "relu" => Self::Relu,
            _ => return None,
        })
    }

    pub fn forward(self, x: &Tensor) -> Result<Tensor> {
        use crate::kernels::gelu::{activation, Kind};
        match self {
            Self::Gelu if crate::kernels::use_fast(x) => activation(x, Kind::Gelu),
            Self::QuickGelu if crate::kernels::use_fast(x) => activation(x, Kind::QuickGelu),
            Self::Silu => candle_nn::ops::silu(x),
            Self::Gelu => x.gelu_erf(),
            Self::QuickGelu => x * candle_nn::ops::sigmoid(&(x * 1.702)?)?,
            Self::Relu => x.relu(),
        }
    }
}
