//! `AutoencoderKL`: the SD VAE, split into its encoder and decoder so each is a
//! segment that loads and drops on its own.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::json;

use super::attention::Attention;
use super::config::ConfigReader;
use super::resnet::{Downsample2D, ResnetBlock2D, ResnetConfig, Upsample2D};
use crate::error::LoadError;
use crate::layers::{Activation, Conv2d, Conv2dConfig, GroupNorm};
use crate::loading::{Loader, Segment, WeightStore, Weights};

#[derive(Debug, Clone, PartialEq)]
pub struct AutoencoderKLConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    pub block_out_channels: Vec<usize>,
    pub layers_per_block: usize,
    pub latent_channels: usize,
    pub norm_num_groups: usize,
    pub act_fn: Activation,
    pub scaling_factor: f64,
    pub shift_factor: f64,
    pub use_quant_conv: bool,
    pub use_post_quant_conv: bool,
    pub mid_block_add_attention: bool,
}

impl AutoencoderKLConfig {
    pub fn from_file(path: &Path) -> Result<Self, LoadError> {
        Self::from_reader(&ConfigReader::open(path)?)
    }

    pub fn from_reader(c: &ConfigReader) -> Result<Self, LoadError> {
        if let Some(name) = c.string("_class_name")? {
            if name != "AutoencoderKL" {
                return Err(c.error("_class_name", format!("`{name}` is not an AutoencoderKL")));
            }
        }
        let block_out_channels = match c.get("block_out_channels") {
            None => vec![64],
            Some(_) => c.usizes("block_out_channels")?,
        };
        let n = block_out_channels.len();
        if n == 0 || n > 8 {
            // The pixel factor is 2^(n - 1): bounded so it cannot overflow.
            return Err(c.error("block_out_channels", format!("must have 1..=8 entries, found {n}")));
        }
        for (field, want) in [("down_block_types", "DownEncoderBlock2D"), ("up_block_types", "UpDecoderBlock2D")] {
            if c.get(field).is_some() {
                let types = c.strings(field)?;
                if types.len() != n {
                    return Err(c.error(field, format!("has {} entries but block_out_channels has {n}", types.len())));
                }
                if let Some(bad) = types.iter().find(|t| *t != want) {
                    return Err(c.error(field, format!("`{bad}` is not supported (expected {want})")));
                }
            }
        }
        c.expect_unset("latents_mean")?;
        c.expect_unset("latents_std")?;
        let act_name = c.string("act_fn")?.unwrap_or_else(|| "silu".into());
        let act_fn = match Activation::parse(&act_name) {
            Some(Activation::Silu) => Activation::Silu,
            _ => return Err(c.error("act_fn", format!("`{act_name}` is not supported (silu)"))),
        };
        let norm_num_groups = c.usize("norm_num_groups", Some(32))?;
        if let Some(bad) = block_out_channels.iter().find(|&&ch| norm_num_groups == 0 || ch % norm_num_groups != 0) {
            return Err(c.error("norm_num_groups", format!("{norm_num_groups} does not divide {bad} channels")));
        }
        c.expect_one_of("in_channels", &[json!(3)])?;
        check_latent_scaling(c, c.f64("scaling_factor", 0.18215)?, c.f64("shift_factor", 0.0)?)?;
        Ok(Self {
            in_channels: c.usize("in_channels", Some(3))?,
            out_channels: c.usize("out_channels", Some(3))?,
            block_out_channels,
            layers_per_block: c.usize("layers_per_block", Some(1))?,
            latent_channels: c.usize("latent_channels", Some(4))?,
            norm_num_groups,
            act_fn,
            scaling_factor: c.f64("scaling_factor", 0.18215)?,
            shift_factor: c.f64("shift_factor", 0.0)?,
            use_quant_conv: c.bool("use_quant_conv", true)?,
            use_post_quant_conv: c.bool("use_post_quant_conv", true)?,
            mid_block_add_attention: c.bool("mid_block_add_attention", true)?,
        })
    }

    /// Pixels per latent along each axis.
    pub fn scale_factor(&self) -> usize {
        1 << (self.block_out_channels.len() - 1)
    }

    fn resnet(&self, in_channels: usize, out_channels: usize) -> ResnetConfig {
        ResnetConfig {
            in_channels,
            out_channels,
            temb_channels: None,
            groups: self.norm_num_groups,
            eps: 1e-6,
            act: self.act_fn,
            output_scale_factor: 1.0,
        }
    }
}

/// The VAE mid block: resnet, single-head spatial self-attention, resnet.
struct VaeMidBlock {
    resnet0: ResnetBlock2D,
    attention: Option<(GroupNorm, Attention)>,
    resnet1: ResnetBlock2D,
}

impl VaeMidBlock {
    fn load(w: &Weights, cfg: &AutoencoderKLConfig, ch: usize) -> Result<Self, LoadError> {
        let attention = if cfg.mid_block_add_attention {
            let a = w.pp("attentions").pp(0);
            Some((
                GroupNorm::load(&a.pp("group_norm"), cfg.norm_num_groups, ch, 1e-6)?,
                Attention::load(&a, ch, ch, 1, ch, true)?,
            ))
        } else {
            None
        };
        Ok(Self {
            resnet0: ResnetBlock2D::load(&w.pp("resnets").pp(0), cfg.resnet(ch, ch))?,
            attention,
            resnet1: ResnetBlock2D::load(&w.pp("resnets").pp(1), cfg.resnet(ch, ch))?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = self.resnet0.forward(x, None)?;
        if let Some((norm, attn)) = &self.attention {
            let (b, c, hh, ww) = h.dims4()?;
            let tokens = norm.forward(&h)?.reshape((b, c, hh * ww))?.transpose(1, 2)?;
            let out = attn.forward(&tokens, None)?.transpose(1, 2)?.reshape((b, c, hh, ww))?;
            h = (out + h)?;
        }
        self.resnet1.forward(&h, None)
    }
}

/// The diagonal Gaussian the encoder predicts.
pub struct LatentDistribution {
    pub mean: Tensor,
    /// Clamped to [-30, 20] as diffusers does.
    pub logvar: Tensor,
}

impl LatentDistribution {
    /// `mean + std * noise`.
    pub fn sample(&self, noise: &Tensor) -> candle_core::Result<Tensor> {
        &self.mean + (self.logvar.clone() * 0.5)?.exp()?.mul(noise)?
    }
}

/// The encoder half (`encoder.*` and `quant_conv.*`).
pub struct VaeEncoder {
    conv_in: Conv2d,
    down: Vec<(Vec<ResnetBlock2D>, Option<Downsample2D>)>,
    mid: VaeMidBlock,
    conv_norm_out: GroupNorm,
    conv_out: Conv2d,
    quant_conv: Option<Conv2d>,
    cfg: AutoencoderKLConfig,
}

impl VaeEncoder {
    pub fn load(store: &WeightStore, cfg: &AutoencoderKLConfig, device: &Device, dtype: DType) -> Result<Self, LoadError> {
        let loader = store.loader("vae encoder (AutoencoderKL)", device, dtype);
        let model = Self::from_loader(&loader, cfg)?;
        loader.finish(Segment::VaeEncoder.weights().1)?;
        Ok(model)
    }

    /// Builds the module from any loader (a file-backed one, or a recorder).
    pub fn from_loader(loader: &Loader, cfg: &AutoencoderKLConfig) -> Result<Self, LoadError> {
        let root = loader.root();
        let w = root.pp("encoder");
        let ch = &cfg.block_out_channels;
        let n = ch.len();
        let conv_in = Conv2d::load(&w.pp("conv_in"), cfg.in_channels, ch[0], Conv2dConfig::K3, true)?;
        let mut down = Vec::with_capacity(n);
        let mut out_ch = ch[0];
        for (i, &block_ch) in ch.iter().enumerate() {
            let in_ch = out_ch;
            out_ch = block_ch;
            let b = w.pp("down_blocks").pp(i);
            let resnets = (0..cfg.layers_per_block)
                .map(|j| ResnetBlock2D::load(&b.pp("resnets").pp(j), cfg.resnet(if j == 0 { in_ch } else { out_ch }, out_ch)))
                .collect::<Result<Vec<_>, _>>()?;
            let ds = (i + 1 < n).then(|| Downsample2D::load(&b.pp("downsamplers").pp(0), out_ch, 0)).transpose()?;
            down.push((resnets, ds));
        }
        let mid = VaeMidBlock::load(&w.pp("mid_block"), cfg, ch[n - 1])?;
        let conv_norm_out = GroupNorm::load(&w.pp("conv_norm_out"), cfg.norm_num_groups, ch[n - 1], 1e-6)?;
        let conv_out = Conv2d::load(&w.pp("conv_out"), ch[n - 1], 2 * cfg.latent_channels, Conv2dConfig::K3, true)?;
        let quant_conv = cfg
            .use_quant_conv
            .then(|| {
                let l2 = 2 * cfg.latent_channels;
                Conv2d::load(&root.pp("quant_conv"), l2, l2, Conv2dConfig::K1, true)
            })
            .transpose()?;
        Ok(Self {
            conv_in,
            down,
            mid,
            conv_norm_out,
            conv_out,
            quant_conv,
            cfg: cfg.clone(),
        })
    }

    pub fn config(&self) -> &AutoencoderKLConfig {
        &self.cfg
    }

    /// Encodes images in [-1, 1], NCHW, to the latent distribution (unscaled).
    pub fn encode(&self, image: &Tensor) -> candle_core::Result<LatentDistribution> {
        let mut h = self.conv_in.forward(image)?;
        for (resnets, ds) in &self.down {
            for r in resnets {
                h = r.forward(&h, None)?;
            }
            if let Some(d) = ds {
                h = d.forward(&h)?;
            }
        }
        h = self.mid.forward(&h)?;
        h = self.conv_out.forward(&self.conv_norm_out.forward_then(&h, self.cfg.act_fn)?)?;
        if let Some(q) = &self.quant_conv {
            h = q.forward(&h)?;
        }
        let l = self.cfg.latent_channels;
        let mean = h.narrow(1, 0, l)?;
        let logvar = h.narrow(1, l, l)?.clamp(-30f32, 20f32)?;
        Ok(LatentDistribution { mean, logvar })
    }
}

/// The decoder half (`post_quant_conv.*` and `decoder.*`).
pub struct VaeDecoder {
    post_quant_conv: Option<Conv2d>,
    conv_in: Conv2d,
    mid: VaeMidBlock,
    up: Vec<(Vec<ResnetBlock2D>, Option<Upsample2D>)>,
    conv_norm_out: GroupNorm,
    conv_out: Conv2d,
    cfg: AutoencoderKLConfig,
}

impl VaeDecoder {
    pub fn load(store: &WeightStore, cfg: &AutoencoderKLConfig, device: &Device, dtype: DType) -> Result<Self, LoadError> {
        let loader = store.loader("vae decoder (AutoencoderKL)", device, dtype);
        let model = Self::from_loader(&loader, cfg)?;
        loader.finish(Segment::VaeDecoder.weights().1)?;
        Ok(model)
    }

    /// Builds the module from any loader (a file-backed one, or a recorder).
    pub fn from_loader(loader: &Loader, cfg: &AutoencoderKLConfig) -> Result<Self, LoadError> {
        let root = loader.root();
        let w = root.pp("decoder");
        let ch = &cfg.block_out_channels;
        let n = ch.len();
        let l = cfg.latent_channels;
        let post_quant_conv = cfg
            .use_post_quant_conv
            .then(|| Conv2d::load(&root.pp("post_quant_conv"), l, l, Conv2dConfig::K1, true))
            .transpose()?;
        let conv_in = Conv2d::load(&w.pp("conv_in"), l, ch[n - 1], Conv2dConfig::K3, true)?;
        let mid = VaeMidBlock::load(&w.pp("mid_block"), cfg, ch[n - 1])?;
        let rev: Vec<usize> = ch.iter().rev().copied().collect();
        let mut up = Vec::with_capacity(n);
        let mut out_ch = rev[0];
        for (i, &block_ch) in rev.iter().enumerate() {
            let prev = out_ch;
            out_ch = block_ch;
            let b = w.pp("up_blocks").pp(i);
            let resnets = (0..cfg.layers_per_block + 1)
                .map(|j| ResnetBlock2D::load(&b.pp("resnets").pp(j), cfg.resnet(if j == 0 { prev } else { out_ch }, out_ch)))
                .collect::<Result<Vec<_>, _>>()?;
            let us = (i + 1 < n).then(|| Upsample2D::load(&b.pp("upsamplers").pp(0), out_ch)).transpose()?;
            up.push((resnets, us));
        }
        let conv_norm_out = GroupNorm::load(&w.pp("conv_norm_out"), cfg.norm_num_groups, ch[0], 1e-6)?;
        let conv_out = Conv2d::load(&w.pp("conv_out"), ch[0], cfg.out_channels, Conv2dConfig::K3, true)?;
        Ok(Self {
            post_quant_conv,
            conv_in,
            mid,
            up,
            conv_norm_out,
            conv_out,
            cfg: cfg.clone(),
        })
    }

    pub fn config(&self) -> &AutoencoderKLConfig {
        &self.cfg
    }

    /// Decodes unscaled latents to images in (roughly) [-1, 1].
    pub fn decode(&self, latents: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = match &self.post_quant_conv {
            Some(p) => p.forward(latents)?,
            None => latents.clone(),
        };
        h = self.conv_in.forward(&h)?;
        h = self.mid.forward(&h)?;
        for (resnets, us) in &self.up {
            for r in resnets {
                h = r.forward(&h, None)?;
            }
            if let Some(u) = us {
                h = u.forward(&h, None)?;
            }
        }
        self.conv_out.forward(&self.conv_norm_out.forward_then(&h, self.cfg.act_fn)?)
    }
}

/// Latents are divided by `scaling_factor` before decoding: 0 (or a non-finite
/// value) turns every picture into NaN, written out as black with no error.
pub(crate) fn check_latent_scaling(c: &ConfigReader, scaling: f64, shift: f64) -> Result<(), LoadError> {
    if !(scaling.is_finite() && scaling.abs() >= 1e-6 && scaling.abs() <= 1e6) {
        return Err(c.error("scaling_factor", format!("must be a finite number away from 0 (1e-6..1e6 in size), found {scaling}")));
    }
    if !shift.is_finite() {
        return Err(c.error("shift_factor", format!("must be a finite number, found {shift}")));
    }
    Ok(())
}
