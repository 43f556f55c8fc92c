//! `UNet2DConditionModel`, configured from its diffusers `config.json`.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use super::attention::CrossContext;
use super::config::ConfigReader;
use super::embeddings::{timestep_embedding, TimestepEmbedding};
use super::resnet::ResnetConfig;
use super::unet_2d_blocks::{BlockAttention, DownBlock, MidBlock, UpBlock, UpChannels};
use crate::error::LoadError;
use crate::layers::{Activation, Conv2d, Conv2dConfig, GroupNorm};
use crate::loading::{Loader, WeightStore};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DownBlockType {
    CrossAttnDownBlock2D,
    DownBlock2D,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpBlockType {
    CrossAttnUpBlock2D,
    UpBlock2D,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MidBlockType {
    /// resnet, (attention, resnet) x 1
    CrossAttn,
    /// a single resnet
    Plain,
    /// no mid block at all (SDXS)
    None,
}

/// Every `UNet2DConditionModel` field that SD 1.x / 2.x / Turbo / SDXS / LCM /
/// inpainting UNets use, resolved to per-block values.
#[derive(Debug, Clone, PartialEq)]
pub struct UNetConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    pub center_input_sample: bool,
    pub flip_sin_to_cos: bool,
    pub freq_shift: f64,
    pub down_block_types: Vec<DownBlockType>,
    pub up_block_types: Vec<UpBlockType>,
    pub mid_block_type: MidBlockType,
    pub block_out_channels: Vec<usize>,
    pub layers_per_block: Vec<usize>,
    pub downsample_padding: usize,
    pub mid_block_scale_factor: f64,
    pub resnet_out_scale_factor: f64,
    pub act_fn: Activation,
    pub norm_num_groups: usize,
    pub norm_eps: f64,
    pub cross_attention_dim: Vec<usize>,
    pub transformer_layers_per_block: Vec<usize>,
    pub reverse_transformer_layers_per_block: Vec<usize>,
    /// Heads per down block (diffusers' `attention_head_dim`, which is a head count).
    pub num_heads: Vec<usize>,
    pub use_linear_projection: bool,
    pub only_cross_attention: Vec<bool>,
    /// No effect on the result here: scores and softmax always run in f32.
    pub upcast_attention: bool,
    pub time_cond_proj_dim: Option<usize>,
    pub sample_size: Option<usize>,
}

impl UNetConfig {
    pub fn from_file(path: &Path) -> Result<Self, LoadError> {
        Self::from_reader(&ConfigReader::open(path)?)
    }

    pub fn from_reader(c: &ConfigReader) -> Result<Self, LoadError> {
        if let Some(name) = c.string("_class_name")? {
            if name != "UNet2DConditionModel" {
                return Err(c.error("_class_name", format!("`{name}` is not supported (expected UNet2DConditionModel)")));
            }
        }
        // Features no SD 1.x/2.x-family UNet uses: refuse rather than compute something else.
        for f in [
            "class_embed_type",
            "addition_embed_type",
            "addition_time_embed_dim",
            "num_class_embeds",
            "encoder_hid_dim",
            "encoder_hid_dim_type",
            "time_embedding_dim",
            "time_embedding_act_fn",
            "timestep_post_act",
            "projection_class_embeddings_input_dim",
            "cross_attention_norm",
        ] {
            c.expect_unset(f)?;
        }
        c.expect_one_of("dual_cross_attention", &[json!(false)])?;
        c.expect_one_of("class_embeddings_concat", &[json!(false)])?;
        c.expect_one_of("resnet_time_scale_shift", &[json!("default")])?;
        c.expect_one_of("resnet_skip_time_act", &[json!(false)])?;
        c.expect_one_of("time_embedding_type", &[json!("positional")])?;
        c.expect_one_of("attention_type", &[json!("default")])?;
        c.expect_one_of("conv_in_kernel", &[json!(3)])?;
        c.expect_one_of("conv_out_kernel", &[json!(3)])?;

        let block_out_channels = match c.get("block_out_channels") {
            None => vec![320, 640, 1280, 1280],
            Some(_) => c.usizes("block_out_channels")?,
        };
        let n = block_out_channels.len();
        if n == 0 {
            return Err(c.error("block_out_channels", "must not be empty"));
        }
        let down_block_types = match c.get("down_block_types") {
            None => vec![
                DownBlockType::CrossAttnDownBlock2D,
                DownBlockType::CrossAttnDownBlock2D,
                DownBlockType::CrossAttnDownBlock2D,
                DownBlockType::DownBlock2D,
            ],
            Some(_) => c
                .strings("down_block_types")?
                .iter()
                .map(|s| match s.as_str() {
                    "CrossAttnDownBlock2D" => Ok(DownBlockType::CrossAttnDownBlock2D),
                    "DownBlock2D" => Ok(DownBlockType::DownBlock2D),
                    _ => Err(c.error("down_block_types", format!("`{s}` is not supported"))),
                })
                .collect::<Result<Vec<_>, _>>()?,
        };
        let up_block_types = match c.get("up_block_types") {
            None => vec![
                UpBlockType::UpBlock2D,
                UpBlockType::CrossAttnUpBlock2D,
                UpBlockType::CrossAttnUpBlock2D,
                UpBlockType::CrossAttnUpBlock2D,
            ],
            Some(_) => c
                .strings("up_block_types")?
                .iter()
                .map(|s| match s.as_str() {
                    "CrossAttnUpBlock2D" => Ok(UpBlockType::CrossAttnUpBlock2D),
                    "UpBlock2D" => Ok(UpBlockType::UpBlock2D),
                    _ => Err(c.error("up_block_types", format!("`{s}` is not supported"))),
                })
                .collect::<Result<Vec<_>, _>>()?,
        };
        if down_block_types.len() != n {
            return Err(c.error("down_block_types", format!("has {} entries but block_out_channels has {n}", down_block_types.len())));
        }
        if up_block_types.len() != n {
            return Err(c.error("up_block_types", format!("has {} entries but block_out_channels has {n}", up_block_types.len())));
        }
        let mid_block_type = match c.raw_has("mid_block_type") {
            // Absent: diffusers' default. Present but null: no mid block.
            false => MidBlockType::CrossAttn,
            true => match c.string("mid_block_type")?.as_deref() {
                None => MidBlockType::None,
                Some("UNetMidBlock2DCrossAttn") => MidBlockType::CrossAttn,
                Some("UNetMidBlock2D") => MidBlockType::Plain,
                Some(other) => return Err(c.error("mid_block_type", format!("`{other}` is not supported"))),
            },
        };
        let act_name = c.string("act_fn")?.unwrap_or_else(|| "silu".into());
        let act_fn = match Activation::parse(&act_name) {
            Some(Activation::Silu) => Activation::Silu,
            _ => return Err(c.error("act_fn", format!("`{act_name}` is not supported (silu)"))),
        };
        let norm_num_groups = c.usize("norm_num_groups", Some(32))?;
        if c.raw_has("norm_num_groups") && c.get("norm_num_groups").is_none() {
            return Err(c.error("norm_num_groups", "null (no output norm) is not supported"));
        }
        for (i, &ch) in block_out_channels.iter().enumerate() {
            if norm_num_groups == 0 || ch % norm_num_groups != 0 {
                return Err(c.error(
                    "norm_num_groups",
                    format!("{norm_num_groups} does not divide block_out_channels[{i}] = {ch}"),
                ));
            }
        }
        let cross_attention_dim = c.per_block_usize("cross_attention_dim", n, Some(1280))?;
        let transformer_layers_per_block = match c.get("transformer_layers_per_block") {
            Some(Value::Array(a)) if a.iter().any(Value::is_array) => {
                return Err(c.error("transformer_layers_per_block", "nested per-layer lists are not supported"))
            }
            _ => c.per_block_usize("transformer_layers_per_block", n, Some(1))?,
        };
        let reverse_transformer_layers_per_block = match c.get("reverse_transformer_layers_per_block") {
            None => transformer_layers_per_block.iter().rev().copied().collect(),
            Some(Value::Array(a)) if a.iter().any(Value::is_array) => {
                return Err(c.error("reverse_transformer_layers_per_block", "nested per-layer lists are not supported"))
            }
            Some(_) => c.per_block_usize("reverse_transformer_layers_per_block", n, None)?,
        };
        // diffusers' long-standing naming quirk: `attention_head_dim` holds the number
        // of heads; `num_attention_heads`, when given, means the same thing.
        let num_heads = if c.get("num_attention_heads").is_some() {
            c.per_block_usize("num_attention_heads", n, None)?
        } else {
            c.per_block_usize("attention_head_dim", n, Some(8))?
        };
        let layers_per_block = c.per_block_usize("layers_per_block", n, Some(2))?;
        let only_cross_attention = c.per_block_bool("only_cross_attention", n, false)?;

        let cfg = Self {
            in_channels: c.usize("in_channels", Some(4))?,
            out_channels: c.usize("out_channels", Some(4))?,
            center_input_sample: c.bool("center_input_sample", false)?,
            flip_sin_to_cos: c.bool("flip_sin_to_cos", true)?,
            freq_shift: c.f64("freq_shift", 0.0)?,
            down_block_types,
            up_block_types,
            mid_block_type,
            block_out_channels,
            layers_per_block,
            downsample_padding: c.usize("downsample_padding", Some(1))?,
            mid_block_scale_factor: c.f64("mid_block_scale_factor", 1.0)?,
            resnet_out_scale_factor: c.f64("resnet_out_scale_factor", 1.0)?,
            act_fn,
            norm_num_groups,
            norm_eps: c.f64("norm_eps", 1e-5)?,
            cross_attention_dim,
            transformer_layers_per_block,
            reverse_transformer_layers_per_block,
            num_heads,
            use_linear_projection: c.bool("use_linear_projection", false)?,
            only_cross_attention,
            upcast_attention: c.bool("upcast_attention", false)?,
            time_cond_proj_dim: c.opt_usize("time_cond_proj_dim")?,
            sample_size: c.opt_usize("sample_size")?,
        };
        for (i, (&ch, &h)) in cfg.block_out_channels.iter().zip(&cfg.num_heads).enumerate() {
            let has_attn = cfg.down_block_types[i] == DownBlockType::CrossAttnDownBlock2D
                || cfg.up_block_types[n - 1 - i] == UpBlockType::CrossAttnUpBlock2D;
            if has_attn && (h == 0 || ch % h != 0) {
                return Err(c.error("attention_head_dim", format!("{h} heads do not divide block {i}'s {ch} channels")));
            }
        }
        Ok(cfg)
    }

    /// Latent downsampling factor between the input and the deepest block.
    pub fn overall_up_factor(&self) -> usize {
        1 << (self.block_out_channels.len() - 1)
    }

    fn resnet(&self, in_channels: usize, out_channels: usize, scale: f64) -> ResnetConfig {
        ResnetConfig {
            in_channels,
            out_channels,
            temb_channels: Some(self.block_out_channels[0] * 4),
            groups: self.norm_num_groups,
            eps: self.norm_eps,
            act: self.act_fn,
            output_scale_factor: scale,
        }
    }
}

/// diffusers' `UNet2DConditionModel`.
pub struct UNet2DConditionModel {
    conv_in: Conv2d,
    time_embedding: TimestepEmbedding,
    down_blocks: Vec<DownBlock>,
    mid_block: Option<MidBlock>,
    up_blocks: Vec<UpBlock>,
    conv_norm_out: GroupNorm,
    conv_out: Conv2d,
    cfg: UNetConfig,
    device: Device,
}

impl UNet2DConditionModel {
    pub fn load(store: &WeightStore, cfg: &UNetConfig, device: &Device, dtype: DType) -> Result<Self, LoadError> {
        let loader = store.loader("unet (UNet2DConditionModel)", device, dtype);
        let model = Self::from_loader(&loader, cfg)?;
        loader.finish(&[])?;
        Ok(model)
    }

    /// Builds the module from any loader (a file-backed one, or a recorder).
    pub fn from_loader(loader: &Loader, cfg: &UNetConfig) -> Result<Self, LoadError> {
        let w = loader.root();
        let ch = &cfg.block_out_channels;
        let n = ch.len();
        let time_embed_dim = ch[0] * 4;
        let conv_in = Conv2d::load(&w.pp("conv_in"), cfg.in_channels, ch[0], Conv2dConfig::K3, true)?;
        let time_embedding =
            TimestepEmbedding::load(&w.pp("time_embedding"), ch[0], time_embed_dim, cfg.act_fn, cfg.time_cond_proj_dim)?;
        let attention = |i: usize, layers: usize, heads: usize, only_cross: bool| BlockAttention {
            heads,
            layers,
            cross_attention_dim: cfg.cross_attention_dim[i],
            use_linear_projection: cfg.use_linear_projection,
            only_cross_attention: only_cross,
        };

        let mut down_blocks = Vec::with_capacity(n);
        let mut out_ch = ch[0];
        for i in 0..n {
            let in_ch = out_ch;
            out_ch = ch[i];
            let attn = (cfg.down_block_types[i] == DownBlockType::CrossAttnDownBlock2D).then(|| {
                attention(i, cfg.transformer_layers_per_block[i], cfg.num_heads[i], cfg.only_cross_attention[i])
            });
            down_blocks.push(DownBlock::load(
                &w.pp("down_blocks").pp(i),
                cfg.resnet(in_ch, out_ch, cfg.resnet_out_scale_factor),
                cfg.layers_per_block[i],
                attn,
                i + 1 < n,
                cfg.downsample_padding,
            )?);
        }

        let last = ch[n - 1];
        let mid_block = match cfg.mid_block_type {
            MidBlockType::None => None,
            MidBlockType::CrossAttn => Some(MidBlock::load(
                &w.pp("mid_block"),
                cfg.resnet(last, last, cfg.mid_block_scale_factor),
                Some(attention(n - 1, cfg.transformer_layers_per_block[n - 1], cfg.num_heads[n - 1], false)),
                1,
            )?),
            MidBlockType::Plain => Some(MidBlock::load(
                &w.pp("mid_block"),
                cfg.resnet(last, last, cfg.mid_block_scale_factor),
                None,
                0,
            )?),
        };

        let rev_ch: Vec<usize> = ch.iter().rev().copied().collect();
        let mut up_blocks = Vec::with_capacity(n);
        let mut out_ch = rev_ch[0];
        for i in 0..n {
            let prev = out_ch;
            out_ch = rev_ch[i];
            let in_ch = rev_ch[(i + 1).min(n - 1)];
            let down_index = n - 1 - i;
            let attn = (cfg.up_block_types[i] == UpBlockType::CrossAttnUpBlock2D).then(|| {
                let mut a = attention(
                    down_index,
                    cfg.reverse_transformer_layers_per_block[i],
                    cfg.num_heads[down_index],
                    cfg.only_cross_attention[down_index],
                );
                a.cross_attention_dim = cfg.cross_attention_dim[down_index];
                a
            });
            up_blocks.push(UpBlock::load(
                &w.pp("up_blocks").pp(i),
                cfg.resnet(0, 0, cfg.resnet_out_scale_factor),
                UpChannels {
                    in_channels: in_ch,
                    out_channels: out_ch,
                    prev_output_channels: prev,
                },
                cfg.layers_per_block[down_index] + 1,
                attn,
                i + 1 < n,
            )?);
        }
        let conv_norm_out = GroupNorm::load(&w.pp("conv_norm_out"), cfg.norm_num_groups, ch[0], cfg.norm_eps)?;
        let conv_out = Conv2d::load(&w.pp("conv_out"), ch[0], cfg.out_channels, Conv2dConfig::K3, true)?;
        Ok(Self {
            conv_in,
            time_embedding,
            down_blocks,
            mid_block,
            up_blocks,
            conv_norm_out,
            conv_out,
            cfg: cfg.clone(),
            device: loader.device().clone(),
        })
    }

    pub fn config(&self) -> &UNetConfig {
        &self.cfg
    }

    /// Predicts noise (or v) for `sample` [batch, in_channels, h, w] at `timesteps`
    /// (one per batch item), conditioned on `context` [batch, tokens, cross_dim];
    /// `timestep_cond` [batch, time_cond_proj_dim] for LCM-distilled UNets.
    pub fn forward(
        &self,
        sample: &Tensor,
        timesteps: &[f32],
        context: &Tensor,
        timestep_cond: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        self.forward_with(sample, timesteps, &CrossContext::uncached(context), timestep_cond)
    }

    /// As [`forward`](Self::forward), with the text conditioning's cross-attention
    /// keys/values taken from (and stored in) a cache when `context.cache` is set.
    pub fn forward_with(
        &self,
        sample: &Tensor,
        timesteps: &[f32],
        context: &CrossContext,
        timestep_cond: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let (b, c, h, w) = sample.dims4()?;
        if c != self.cfg.in_channels {
            candle_core::bail!("UNet expects {} input channels, got {c}", self.cfg.in_channels);
        }
        let ts: Vec<f32> = match timesteps.len() {
            1 => vec![timesteps[0]; b],
            n if n == b => timesteps.to_vec(),
            n => candle_core::bail!("{n} timesteps for a batch of {b}"),
        };
        if self.cfg.time_cond_proj_dim.is_some() != timestep_cond.is_some() {
            candle_core::bail!("timestep_cond must be given exactly when the UNet has time_cond_proj_dim");
        }
        let factor = self.cfg.overall_up_factor();
        let forward_upsample_size = h % factor != 0 || w % factor != 0;
        let dtype = sample.dtype();
        let sample = if self.cfg.center_input_sample {
            ((sample * 2.0)? - 1.0)?
        } else {
            sample.clone()
        };

        let t_emb = timestep_embedding(
            &ts,
            self.cfg.block_out_channels[0],
            self.cfg.flip_sin_to_cos,
            self.cfg.freq_shift,
            &self.device,
        )?
        .to_dtype(dtype)?;
        let emb = self.time_embedding.forward(&t_emb, timestep_cond)?;
        let hidden = context.hidden.to_dtype(dtype)?;
        let context = CrossContext {
            hidden: &hidden,
            cache: context.cache,
            attention: context.attention,
        };

        let mut h = self.conv_in.forward(&sample)?;
        let mut skips = vec![h.clone()];
        for block in &self.down_blocks {
            let (out, s) = block.forward(&h, Some(&emb), Some(&context))?;
            h = out;
            skips.extend(s);
        }
        if let Some(mid) = &self.mid_block {
            h = mid.forward(&h, Some(&emb), Some(&context))?;
        }
        let n = self.up_blocks.len();
        for (i, block) in self.up_blocks.iter().enumerate() {
            let remaining = skips.len() - block.num_layers();
            let upsample_size = if i + 1 < n && forward_upsample_size {
                let (_, _, sh, sw) = skips[remaining - 1].dims4()?;
                Some((sh, sw))
            } else {
                None
            };
            h = block.forward(h, &mut skips, Some(&emb), Some(&context), upsample_size)?;
        }
        let h = self.conv_norm_out.forward_then(&h, self.cfg.act_fn)?;
        self.conv_out.forward(&h)
    }
}
