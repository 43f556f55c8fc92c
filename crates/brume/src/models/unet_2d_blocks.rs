//! diffusers `unet_2d_blocks.py`: the down, mid and up blocks of the SD UNets.

use candle_core::{Result, Tensor};

use super::attention::{CrossContext, Transformer2DModel, TransformerConfig};
use super::resnet::{Downsample2D, ResnetBlock2D, ResnetConfig, Upsample2D};
use crate::error::LoadError;
use crate::loading::Weights;

/// Per-block attention settings; `None` for blocks without attention.
#[derive(Debug, Clone, Copy)]
pub struct BlockAttention {
    pub heads: usize,
    pub layers: usize,
    pub cross_attention_dim: usize,
    pub use_linear_projection: bool,
    pub only_cross_attention: bool,
}

impl BlockAttention {
    fn transformer(&self, channels: usize, groups: usize) -> TransformerConfig {
        TransformerConfig {
            channels,
            heads: self.heads,
            dim_head: channels / self.heads,
            layers: self.layers,
            cross_attention_dim: self.cross_attention_dim,
            groups,
            use_linear_projection: self.use_linear_projection,
            only_cross_attention: self.only_cross_attention,
        }
    }
}

/// `CrossAttnDownBlock2D` (with attention) or `DownBlock2D` (without).
pub struct DownBlock {
    resnets: Vec<ResnetBlock2D>,
    attentions: Vec<Transformer2DModel>,
    downsampler: Option<Downsample2D>,
}

impl DownBlock {
    pub fn load(
        w: &Weights,
        resnet: ResnetConfig,
        num_layers: usize,
        attention: Option<BlockAttention>,
        add_downsample: bool,
        downsample_padding: usize,
    ) -> std::result::Result<Self, LoadError> {
        let mut resnets = Vec::new();
        let mut attentions = Vec::new();
        for i in 0..num_layers {
            let cfg = ResnetConfig {
                in_channels: if i == 0 { resnet.in_channels } else { resnet.out_channels },
                ..resnet
            };
            resnets.push(ResnetBlock2D::load(&w.pp("resnets").pp(i), cfg)?);
            if let Some(a) = &attention {
                let tc = a.transformer(resnet.out_channels, resnet.groups);
                attentions.push(Transformer2DModel::load(&w.pp("attentions").pp(i), &tc)?);
            }
        }
        let downsampler = add_downsample
            .then(|| Downsample2D::load(&w.pp("downsamplers").pp(0), resnet.out_channels, downsample_padding))
            .transpose()?;
        Ok(Self {
            resnets,
            attentions,
            downsampler,
        })
    }

    /// Returns the block output and the skip connections it produced.
    pub fn forward(&self, x: &Tensor, temb: Option<&Tensor>, context: Option<&CrossContext>) -> Result<(Tensor, Vec<Tensor>)> {
        let mut h = x.clone();
        let mut skips = Vec::with_capacity(self.resnets.len() + 1);
        for (i, resnet) in self.resnets.iter().enumerate() {
            h = resnet.forward(&h, temb)?;
            if let Some(attn) = self.attentions.get(i) {
                h = attn.forward(&h, require_context(context)?)?;
            }
            skips.push(h.clone());
        }
        if let Some(d) = &self.downsampler {
            h = d.forward(&h)?;
            skips.push(h.clone());
        }
        Ok((h, skips))
    }
}

/// `CrossAttnUpBlock2D` (with attention) or `UpBlock2D` (without).
pub struct UpBlock {
    resnets: Vec<ResnetBlock2D>,
    attentions: Vec<Transformer2DModel>,
    upsampler: Option<Upsample2D>,
}

/// Channel bookkeeping of an up block, as diffusers computes it.
#[derive(Debug, Clone, Copy)]
pub struct UpChannels {
    /// Channels of the matching down block's input (skip width of the last layer).
    pub in_channels: usize,
    pub out_channels: usize,
    /// Channels coming from the previous up block (or the mid block).
    pub prev_output_channels: usize,
}

impl UpBlock {
    pub fn load(
        w: &Weights,
        resnet: ResnetConfig,
        ch: UpChannels,
        num_layers: usize,
        attention: Option<BlockAttention>,
        add_upsample: bool,
    ) -> std::result::Result<Self, LoadError> {
        let mut resnets = Vec::new();
        let mut attentions = Vec::new();
        for i in 0..num_layers {
            let skip = if i == num_layers - 1 { ch.in_channels } else { ch.out_channels };
            let input = if i == 0 { ch.prev_output_channels } else { ch.out_channels };
            let cfg = ResnetConfig {
                in_channels: input + skip,
                out_channels: ch.out_channels,
                ..resnet
            };
            resnets.push(ResnetBlock2D::load(&w.pp("resnets").pp(i), cfg)?);
            if let Some(a) = &attention {
                let tc = a.transformer(ch.out_channels, resnet.groups);
                attentions.push(Transformer2DModel::load(&w.pp("attentions").pp(i), &tc)?);
            }
        }
        let upsampler = add_upsample
            .then(|| Upsample2D::load(&w.pp("upsamplers").pp(0), ch.out_channels))
            .transpose()?;
        Ok(Self {
            resnets,
            attentions,
            upsampler,
        })
    }

    pub fn num_layers(&self) -> usize {
        self.resnets.len()
    }

    /// `skips` are consumed from the end, one per layer. `x` is taken by value
    /// so that it is freed once concatenated with the first skip, not held
    /// through the whole block (at 64x64 a 640-channel map).
    pub fn forward(
        &self,
        x: Tensor,
        skips: &mut Vec<Tensor>,
        temb: Option<&Tensor>,
        context: Option<&CrossContext>,
        upsample_size: Option<(usize, usize)>,
    ) -> Result<Tensor> {
        let mut h = x;
        for (i, resnet) in self.resnets.iter().enumerate() {
            let Some(skip) = skips.pop() else {
                candle_core::bail!("UNet up block ran out of skip connections");
            };
            h = Tensor::cat(&[&h, &skip], 1)?;
            // The concatenation holds a copy: the skip need not live through the
            // resnet and the attention (at 64x64 that is a 320-channel map).
            drop(skip);
            h = resnet.forward(&h, temb)?;
            if let Some(attn) = self.attentions.get(i) {
                h = attn.forward(&h, require_context(context)?)?;
            }
        }
        match &self.upsampler {
            Some(u) => u.forward(&h, upsample_size),
            None => Ok(h),
        }
    }
}

/// `UNetMidBlock2DCrossAttn` (resnet, then attention + resnet per layer) or,
/// without attention, `UNetMidBlock2D` as the UNet builds it (a single resnet).
pub struct MidBlock {
    first: ResnetBlock2D,
    layers: Vec<(Option<Transformer2DModel>, ResnetBlock2D)>,
}

impl MidBlock {
    pub fn load(
        w: &Weights,
        resnet: ResnetConfig,
        attention: Option<BlockAttention>,
        num_layers: usize,
    ) -> std::result::Result<Self, LoadError> {
        let first = ResnetBlock2D::load(&w.pp("resnets").pp(0), resnet)?;
        let mut layers = Vec::new();
        for i in 0..num_layers {
            let attn = attention
                .map(|a| Transformer2DModel::load(&w.pp("attentions").pp(i), &a.transformer(resnet.in_channels, resnet.groups)))
                .transpose()?;
            layers.push((attn, ResnetBlock2D::load(&w.pp("resnets").pp(i + 1), resnet)?));
        }
        Ok(Self { first, layers })
    }

    pub fn forward(&self, x: &Tensor, temb: Option<&Tensor>, context: Option<&CrossContext>) -> Result<Tensor> {
        let mut h = self.first.forward(x, temb)?;
        for (attn, resnet) in &self.layers {
            if let Some(a) = attn {
                h = a.forward(&h, require_context(context)?)?;
            }
            h = resnet.forward(&h, temb)?;
        }
        Ok(h)
    }
}

fn require_context<'a, 'b>(context: Option<&'a CrossContext<'b>>) -> Result<&'a CrossContext<'b>> {
    context.ok_or_else(|| candle_core::Error::Msg("cross-attention block called without encoder_hidden_states".into()))
}
