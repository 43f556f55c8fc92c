//! diffusers `resnet.py` / `downsampling.py` / `upsampling.py`: the residual
//! block and the 2x resamplers shared by the UNet and the VAE.

use candle_core::{Result, Tensor};

use crate::error::LoadError;
use crate::layers::{Activation, Conv2d, Conv2dConfig, Fuse, GroupNorm, Linear};
use crate::loading::Weights;

/// `ResnetBlock2D` with `resnet_time_scale_shift="default"`.
pub struct ResnetBlock2D {
    norm1: GroupNorm,
    conv1: Conv2d,
    time_emb_proj: Option<Linear>,
    norm2: GroupNorm,
    conv2: Conv2d,
    conv_shortcut: Option<Conv2d>,
    act: Activation,
    output_scale_factor: f64,
}

/// Shape parameters of a [`ResnetBlock2D`].
#[derive(Debug, Clone, Copy)]
pub struct ResnetConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    /// `None` for the VAE, whose blocks take no time embedding.
    pub temb_channels: Option<usize>,
    pub groups: usize,
    pub eps: f64,
    pub act: Activation,
    pub output_scale_factor: f64,
}

impl ResnetBlock2D {
    pub fn load(w: &Weights, c: ResnetConfig) -> std::result::Result<Self, LoadError> {
        let conv_shortcut = if c.in_channels != c.out_channels {
            Some(Conv2d::load(&w.pp("conv_shortcut"), c.in_channels, c.out_channels, Conv2dConfig::K1, true)?)
        } else {
            None
        };
        Ok(Self {
            norm1: GroupNorm::load(&w.pp("norm1"), c.groups, c.in_channels, c.eps)?,
            conv1: Conv2d::load(&w.pp("conv1"), c.in_channels, c.out_channels, Conv2dConfig::K3, true)?,
            time_emb_proj: c
                .temb_channels
                .map(|t| Linear::load(&w.pp("time_emb_proj"), t, c.out_channels, true))
                .transpose()?,
            norm2: GroupNorm::load(&w.pp("norm2"), c.groups, c.out_channels, c.eps)?,
            conv2: Conv2d::load(&w.pp("conv2"), c.out_channels, c.out_channels, Conv2dConfig::K3, true)?,
            conv_shortcut,
            act: c.act,
            output_scale_factor: c.output_scale_factor,
        })
    }

    /// Each intermediate map is dropped once the next exists (shadowed bindings
    /// would all live to the end), as `memory::sim::resnet` assumes.
    pub fn forward(&self, x: &Tensor, temb: Option<&Tensor>) -> Result<Tensor> {
        // The timestep's projection is a per-image channel offset of conv1's output, and
        // the skip is conv2's residual: both applied inside the convs ([`Fuse`]).
        let t = match (&self.time_emb_proj, temb) {
            (Some(proj), Some(t)) => Some(proj.forward(&self.act.forward(t)?)?),
            _ => None,
        };
        let h = self.conv1.forward_with(&self.norm1.forward_then(x, self.act)?, Fuse { offset: t.as_ref(), ..Fuse::default() })?;
        let skip = match &self.conv_shortcut {
            Some(c) => c.forward(x)?,
            None => x.clone(),
        };
        let out = self.conv2.forward_with(&self.norm2.forward_then(&h, self.act)?, Fuse::residual(&skip))?;
        if self.output_scale_factor == 1.0 {
            Ok(out)
        } else {
            out / self.output_scale_factor
        }
    }
}

/// `Downsample2D` with a conv: stride 2, padding 1 (the UNet), or padding 0 after
/// an asymmetric (0, 1, 0, 1) zero pad (the VAE encoder).
pub struct Downsample2D {
    conv: Conv2d,
    pad_asymmetric: bool,
}

impl Downsample2D {
    pub fn load(w: &Weights, channels: usize, padding: usize) -> std::result::Result<Self, LoadError> {
        let cfg = Conv2dConfig {
            kernel: 3,
            stride: 2,
            padding,
        };
        Ok(Self {
            conv: Conv2d::load(&w.pp("conv"), channels, channels, cfg, true)?,
            pad_asymmetric: padding == 0,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.pad_asymmetric {
            let x = x.pad_with_zeros(3, 0, 1)?.pad_with_zeros(2, 0, 1)?;
            self.conv.forward(&x)
        } else {
            self.conv.forward(x)
        }
    }
}

/// `Upsample2D`: nearest-neighbour 2x (or to an explicit size) then a 3x3 conv.
pub struct Upsample2D {
    conv: Conv2d,
}

impl Upsample2D {
    pub fn load(w: &Weights, channels: usize) -> std::result::Result<Self, LoadError> {
        Ok(Self {
            conv: Conv2d::load(&w.pp("conv"), channels, channels, Conv2dConfig::K3, true)?,
        })
    }

    /// `size` is the (h, w) to reach when the input is not an exact half of it.
    pub fn forward(&self, x: &Tensor, size: Option<(usize, usize)>) -> Result<Tensor> {
        let (_, _, h, w) = x.dims4()?;
        let (th, tw) = size.unwrap_or((2 * h, 2 * w));
        if (th, tw) == (2 * h, 2 * w) {
            // The conv reads the half-size map in place where it can.
            return self.conv.forward_upsampled(x, Fuse::default());
        }
        self.conv.forward(&x.upsample_nearest2d(th, tw)?)
    }
}
