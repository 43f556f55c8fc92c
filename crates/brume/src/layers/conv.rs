use candle_core::{Result, Tensor};

use super::epilogue::{Epilogue, Fuse, FusedAct, Held};
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

    /// Keeps this conv's products in f32 under bf16 compute, for a network's first or
    /// last convolution whose weight name does not say so (TAESD's are
    /// `layers.N`, not `conv_in` / `conv_out`): see [`super::f32_products`].
    pub fn with_f32_products(mut self) -> Self {
        self.exact = true;
        self
    }

    /// Whether this conv multiplies in f32 under bf16 compute.
    pub fn keeps_f32_products(&self) -> bool {
        self.exact
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, Fuse::default())
    }

    /// The conv of `x`'s nearest-neighbour 2x upsampling (`Upsample2D`), with `fuse`.
    /// Where the direct f32 kernel runs, the upsampled map is never formed: the conv
    /// reads each value of `x` twice over, in rows and columns.
    pub fn forward_upsampled(&self, x: &Tensor, fuse: Fuse) -> Result<Tensor> {
        self.run(x, fuse, true)
    }

    /// Whether `fuse`'s offset is [b, o] and its residual the output's shape.
    fn fits(&self, x: &Tensor, fuse: &Fuse, upsample: bool) -> Result<bool> {
        let (b, _, h, w) = x.dims4()?;
        let (h, w) = if upsample { (2 * h, 2 * w) } else { (h, w) };
        let o = match &self.weight {
            Param::Dense(t) => t.dim(0)?,
            Param::Mapped(m) => m.shape()[0],
            Param::Packed(p) => p.shape()[0],
        };
        let Conv2dConfig { kernel: k, stride: s, padding: p } = self.cfg;
        if s == 0 || h + 2 * p < k || w + 2 * p < k {
            return Ok(false);
        }
        let out = [b, o, (h + 2 * p - k) / s + 1, (w + 2 * p - k) / s + 1];
        Ok(fuse.offset.is_none_or(|t| t.dims() == [b, o]) && fuse.residual.is_none_or(|t| t.dims() == out))
    }

    /// The conv, then `fuse`'s per-image offset, residual and activation. Where our
    /// CPU kernels run the conv, the bias and these are applied in place to its
    /// output ([`super::epilogue`]): no intermediate maps, the same values.
    pub fn forward_with(&self, x: &Tensor, fuse: Fuse) -> Result<Tensor> {
        self.run(x, fuse, false)
    }

    fn run(&self, x: &Tensor, fuse: Fuse, upsample: bool) -> Result<Tensor> {
        let (bias, offset, residual) = (Held::new(self.bias.as_ref()), Held::new(fuse.offset), Held::new(fuse.residual));
        let act = match fuse.act {
            Some(a) => FusedAct::of(a).map(Some).ok_or(()),
            None => Ok(None),
        };
        // `--kernels reference` keeps the plain ops, one after another; so do an offset
        // or residual that would broadcast (the epilogue takes exact shapes only).
        let fused = crate::kernels::mode() == crate::kernels::KernelMode::Fast && self.fits(x, &fuse, upsample)?;
        if let (true, Ok(bias), Ok(offset), Ok(residual), Ok(act)) = (fused, bias.f32(), offset.f32(), residual.f32(), act) {
            let epilogue = Epilogue { bias, offset, residual, act };
            if let Some(y) = mapped::conv2d_param(x, &self.weight, self.cfg.stride, self.cfg.padding, !self.exact, epilogue, upsample)? {
                return Ok(y);
            }
        }
        drop((bias, offset, residual));
        let upsampled;
        let x = if upsample {
            let (_, _, h, w) = x.dims4()?;
            upsampled = x.upsample_nearest2d(2 * h, 2 * w)?;
            &upsampled
        } else {
            x
        };
        // Our kernels without the epilogue (a bias or residual that is not a contiguous
        // f32 CPU tensor, an activation it does not compute), or candle's (other dtypes
        // and devices, `--kernels reference`).
        let (stride, padding) = (self.cfg.stride, self.cfg.padding);
        let y = match mapped::conv2d_param(x, &self.weight, stride, padding, !self.exact, Epilogue::default(), false)? {
            Some(y) => y,
            None => match &self.weight {
                Param::Mapped(m) => x.conv2d(&m.to_tensor(x.device())?, padding, stride, 1, 1)?,
                Param::Packed(p) => x.conv2d(&p.to_tensor(x.device())?.to_dtype(x.dtype())?, padding, stride, 1, 1)?,
                Param::Dense(t) => x.conv2d(t, padding, stride, 1, 1)?,
            },
        };
        let y = match &self.bias {
            Some(b) => y.broadcast_add(&b.reshape((1, b.dim(0)?, 1, 1))?)?,
            None => y,
        };
        fuse.apply_unfused(y)
    }
}
