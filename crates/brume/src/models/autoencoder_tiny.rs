//! `AutoencoderTiny` (TAESD): a small conv-only VAE for fast decoding and
//! previews. Encoder and decoder load separately, like the full VAE.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::json;

use super::config::ConfigReader;
use crate::error::LoadError;
use crate::layers::{Activation, Conv2d, Conv2dConfig, Fuse};
use crate::loading::{Loader, WeightStore, Weights};

#[derive(Debug, Clone, PartialEq)]
pub struct AutoencoderTinyConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    pub encoder_block_out_channels: Vec<usize>,
    pub decoder_block_out_channels: Vec<usize>,
    pub num_encoder_blocks: Vec<usize>,
    pub num_decoder_blocks: Vec<usize>,
    pub latent_channels: usize,
    pub act_fn: Activation,
    pub upsampling_scaling_factor: usize,
    pub scaling_factor: f64,
    pub shift_factor: f64,
}

impl AutoencoderTinyConfig {
    pub fn from_file(path: &Path) -> Result<Self, LoadError> {
        Self::from_reader(&ConfigReader::open(path)?)
    }

    pub fn from_reader(c: &ConfigReader) -> Result<Self, LoadError> {
        if let Some(name) = c.string("_class_name")? {
            if name != "AutoencoderTiny" {
                return Err(c.error("_class_name", format!("`{name}` is not an AutoencoderTiny")));
            }
        }
        c.expect_one_of("upsample_fn", &[json!("nearest")])?;
        let list = |f: &str, d: [usize; 4]| -> Result<Vec<usize>, LoadError> {
            match c.get(f) {
                None => Ok(d.to_vec()),
                Some(_) => c.usizes(f),
            }
        };
        let cfg = Self {
            in_channels: c.usize("in_channels", Some(3))?,
            out_channels: c.usize("out_channels", Some(3))?,
            encoder_block_out_channels: list("encoder_block_out_channels", [64, 64, 64, 64])?,
            decoder_block_out_channels: list("decoder_block_out_channels", [64, 64, 64, 64])?,
            num_encoder_blocks: list("num_encoder_blocks", [1, 3, 3, 3])?,
            num_decoder_blocks: list("num_decoder_blocks", [3, 3, 3, 1])?,
            latent_channels: c.usize("latent_channels", Some(4))?,
            act_fn: {
                let name = c.string("act_fn")?.unwrap_or_else(|| "relu".into());
                Activation::parse(&name).ok_or_else(|| c.error("act_fn", format!("`{name}` is not supported")))?
            },
            upsampling_scaling_factor: c.usize("upsampling_scaling_factor", Some(2))?,
            scaling_factor: c.f64("scaling_factor", 1.0)?,
            shift_factor: c.f64("shift_factor", 0.0)?,
        };
        if cfg.encoder_block_out_channels.len() != cfg.num_encoder_blocks.len() || cfg.encoder_block_out_channels.is_empty() {
            return Err(c.error("num_encoder_blocks", "must have one entry per encoder_block_out_channels entry"));
        }
        if cfg.decoder_block_out_channels.len() != cfg.num_decoder_blocks.len() || cfg.decoder_block_out_channels.is_empty() {
            return Err(c.error("num_decoder_blocks", "must have one entry per decoder_block_out_channels entry"));
        }
        // The pixel factor is upsampling_scaling_factor^(blocks - 1): bounded so it cannot overflow.
        if cfg.decoder_block_out_channels.len() > 8 || cfg.encoder_block_out_channels.len() > 8 {
            return Err(c.error("decoder_block_out_channels", "at most 8 blocks are supported"));
        }
        if !(1..=4).contains(&cfg.upsampling_scaling_factor) {
            return Err(c.error("upsampling_scaling_factor", format!("must be 1..=4, found {}", cfg.upsampling_scaling_factor)));
        }
        super::autoencoder_kl::check_latent_scaling(c, cfg.scaling_factor, cfg.shift_factor)?;
        Ok(cfg)
    }

    pub fn scale_factor(&self) -> usize {
        self.upsampling_scaling_factor.pow(self.decoder_block_out_channels.len() as u32 - 1)
    }
}

/// `AutoencoderTinyBlock`: three 3x3 convs with activations, a skip, and a ReLU.
struct TinyBlock {
    convs: [Conv2d; 3],
    skip: Option<Conv2d>,
    act: Activation,
}

impl TinyBlock {
    fn load(w: &Weights, in_ch: usize, out_ch: usize, act: Activation) -> Result<Self, LoadError> {
        let c = w.pp("conv");
        Ok(Self {
            convs: [
                Conv2d::load(&c.pp(0), in_ch, out_ch, Conv2dConfig::K3, true)?,
                Conv2d::load(&c.pp(2), out_ch, out_ch, Conv2dConfig::K3, true)?,
                Conv2d::load(&c.pp(4), out_ch, out_ch, Conv2dConfig::K3, true)?,
            ],
            skip: (in_ch != out_ch)
                .then(|| Conv2d::load(&w.pp("skip"), in_ch, out_ch, Conv2dConfig::K1, false))
                .transpose()?,
            act,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.convs[0].forward_with(x, Fuse::act(self.act))?;
        let h = self.convs[1].forward_with(&h, Fuse::act(self.act))?;
        let skip = match &self.skip {
            Some(s) => s.forward(x)?,
            None => x.clone(),
        };
        // diffusers: fuse(conv(x) + skip(x)), where `fuse` is a ReLU whatever act_fn is.
        self.convs[2].forward_with(&h, Fuse { residual: Some(&skip), act: Some(Activation::Relu), ..Fuse::default() })
    }
}

enum Layer {
    /// A conv and the activation layer that follows it, applied as one op; `true`:
    /// on the nearest 2x upsampling of the input (the upsampling layer before it).
    Conv(Conv2d, Option<Activation>, bool),
    Block(TinyBlock),
    Act(Activation),
    Upsample(usize),
}

impl Layer {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Layer::Conv(c, act, false) => c.forward_with(x, Fuse { act: *act, ..Fuse::default() }),
            Layer::Conv(c, act, true) => c.forward_upsampled(x, Fuse { act: *act, ..Fuse::default() }),
            Layer::Block(b) => b.forward(x),
            Layer::Act(a) => a.forward(x),
            Layer::Upsample(f) => {
                let (_, _, h, w) = x.dims4()?;
                x.upsample_nearest2d(h * f, w * f)
            }
        }
    }
}

/// Mirrors an `nn.Sequential`: parameter-free layers still take an index (counted
/// apart from `layers`, where an activation may be fused into the conv before it).
struct Sequential<'a> {
    w: Weights<'a>,
    layers: Vec<Layer>,
    index: usize,
}

impl<'a> Sequential<'a> {
    fn new(w: Weights<'a>) -> Self {
        Self { w, layers: Vec::new(), index: 0 }
    }

    /// The weights of the next module, which takes its index.
    fn next(&mut self) -> Weights<'a> {
        self.index += 1;
        self.w.pp(self.index - 1)
    }

    /// A 3x3 conv; `outer` marks the network's first or last one, which keeps f32
    /// products under bf16 compute as every network's `conv_in` / `conv_out` does
    /// ([`crate::layers::f32_products`]).
    fn conv(&mut self, i: usize, o: usize, stride: usize, bias: bool, outer: bool) -> Result<(), LoadError> {
        let cfg = Conv2dConfig {
            kernel: 3,
            stride,
            padding: 1,
        };
        let c = Conv2d::load(&self.next(), i, o, cfg, bias)?;
        let c = if outer { c.with_f32_products() } else { c };
        // A 2x upsampling right before a stride-1 conv is read by the conv in place.
        if stride == 1 && matches!(self.layers.last(), Some(Layer::Upsample(2))) {
            self.layers.pop();
            self.layers.push(Layer::Conv(c, None, true));
        } else {
            self.layers.push(Layer::Conv(c, None, false));
        }
        Ok(())
    }

    /// An activation layer: fused into the conv before it, when there is one.
    fn act(&mut self, act: Activation) {
        self.index += 1;
        match self.layers.last_mut() {
            Some(Layer::Conv(_, slot @ None, _)) => *slot = Some(act),
            _ => self.layers.push(Layer::Act(act)),
        }
    }

    fn upsample(&mut self, factor: usize) {
        self.index += 1;
        self.layers.push(Layer::Upsample(factor));
    }

    fn block(&mut self, ch: usize, act: Activation) -> Result<(), LoadError> {
        let b = TinyBlock::load(&self.next(), ch, ch, act)?;
        self.layers.push(Layer::Block(b));
        Ok(())
    }
}

fn run(layers: &[Layer], x: &Tensor) -> candle_core::Result<Tensor> {
    layers.iter().try_fold(x.clone(), |h, l| l.forward(&h))
}

/// TAESD encoder: images in [-1, 1] to latents (unscaled, as diffusers returns them).
pub struct TinyEncoder {
    layers: Vec<Layer>,
}

impl TinyEncoder {
    pub fn load(store: &WeightStore, cfg: &AutoencoderTinyConfig, device: &Device, dtype: DType) -> Result<Self, LoadError> {
        let loader = store.loader("vae encoder (AutoencoderTiny)", device, dtype);
        let model = Self::from_loader(&loader, cfg)?;
        loader.finish(&["encoder."])?;
        Ok(model)
    }

    /// Builds the module from any loader (a file-backed one, or a recorder).
    pub fn from_loader(loader: &Loader, cfg: &AutoencoderTinyConfig) -> Result<Self, LoadError> {
        let mut s = Sequential::new(loader.root().pp("encoder").pp("layers"));
        for (i, (&ch, &blocks)) in cfg.encoder_block_out_channels.iter().zip(&cfg.num_encoder_blocks).enumerate() {
            if i == 0 {
                s.conv(cfg.in_channels, ch, 1, true, true)?;
            } else {
                s.conv(ch, ch, 2, false, false)?;
            }
            for _ in 0..blocks {
                s.block(ch, cfg.act_fn)?;
            }
        }
        let last = *cfg.encoder_block_out_channels.last().unwrap_or(&0);
        s.conv(last, cfg.latent_channels, 1, true, true)?;
        let layers = s.layers;
        Ok(Self { layers })
    }

    pub fn encode(&self, image: &Tensor) -> candle_core::Result<Tensor> {
        run(&self.layers, &((image + 1.0)? / 2.0)?)
    }
}

/// TAESD decoder: latents (unscaled) to images in [-1, 1].
pub struct TinyDecoder {
    layers: Vec<Layer>,
}

impl TinyDecoder {
    pub fn load(store: &WeightStore, cfg: &AutoencoderTinyConfig, device: &Device, dtype: DType) -> Result<Self, LoadError> {
        let loader = store.loader("vae decoder (AutoencoderTiny)", device, dtype);
        let model = Self::from_loader(&loader, cfg)?;
        loader.finish(&["decoder."])?;
        Ok(model)
    }

    /// Builds the module from any loader (a file-backed one, or a recorder).
    ///
    /// Under bf16 compute, besides the first and last convs, the convs that read the
    /// first two upsamplings (TAESD: 64 -> 64 at 128x128 and 256x256 for a 512 px
    /// image, 6 of the decoder's 141 GFLOP) keep f32 products. Their input is a
    /// nearest-neighbour 2x map, so its rounding is the same in each 2x2 patch, and
    /// every later level carries it: `brume bench speed --components taesd-sdxs@512
    /// --modes bf16` measured the decoder's error against PyTorch f32 at 1.11e-2 with
    /// them in bf16 (the 1e-2 a mode must meet to count as accurate), 1.02e-2 with the
    /// first in f32, 8.72e-3 with both, 8.43e-3 adding the one at 512x512 (19 GFLOP,
    /// so not taken); keeping every block of the first two levels in f32 instead left
    /// it at 1.11e-2.
    pub fn from_loader(loader: &Loader, cfg: &AutoencoderTinyConfig) -> Result<Self, LoadError> {
        let mut s = Sequential::new(loader.root().pp("decoder").pp("layers"));
        let chans = &cfg.decoder_block_out_channels;
        s.conv(cfg.latent_channels, chans[0], 1, true, true)?;
        s.act(cfg.act_fn);
        let n = chans.len();
        for (i, (&ch, &blocks)) in chans.iter().zip(&cfg.num_decoder_blocks).enumerate() {
            let last = i + 1 == n;
            for _ in 0..blocks {
                s.block(ch, cfg.act_fn)?;
            }
            if !last {
                s.upsample(cfg.upsampling_scaling_factor);
            }
            let out = if last { cfg.out_channels } else { ch };
            s.conv(ch, out, 1, last, last || i + 2 < n)?;
        }
        let layers = s.layers;
        Ok(Self { layers })
    }

    pub fn decode(&self, latents: &Tensor) -> candle_core::Result<Tensor> {
        let x = ((latents / 3.0)?.tanh()? * 3.0)?;
        (run(&self.layers, &x)? * 2.0)? - 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under bf16 compute the network's first and last convolutions stay f32 (their
    /// names, `layers.N`, do not say `conv_in` / `conv_out`), the others round.
    #[test]
    fn outer_convs_keep_f32_products() {
        let cfg = AutoencoderTinyConfig {
            in_channels: 3,
            out_channels: 3,
            encoder_block_out_channels: vec![8, 8],
            decoder_block_out_channels: vec![8, 8],
            num_encoder_blocks: vec![1, 1],
            num_decoder_blocks: vec![1, 1],
            latent_channels: 4,
            act_fn: Activation::Relu,
            upsampling_scaling_factor: 2,
            scaling_factor: 1.0,
            shift_factor: 0.0,
        };
        let flags = |layers: &[Layer]| -> Vec<bool> {
            layers
                .iter()
                .flat_map(|l| match l {
                    Layer::Conv(c, ..) => vec![c.keeps_f32_products()],
                    Layer::Block(b) => b.convs.iter().map(Conv2d::keeps_f32_products).collect(),
                    _ => vec![],
                })
                .collect()
        };
        let dec = TinyDecoder::from_loader(&WeightStore::recorder("decoder", &Device::Cpu, DType::F32), &cfg).unwrap();
        let enc = TinyEncoder::from_loader(&WeightStore::recorder("encoder", &Device::Cpu, DType::F32), &cfg).unwrap();
        for f in [flags(&dec.layers), flags(&enc.layers)] {
            assert!(f.len() > 2 && f[0] && f[f.len() - 1], "{f:?}");
            assert!(f[1..f.len() - 1].iter().all(|&x| !x), "{f:?}");
        }
        // TAESD's four levels: the convs after the first two upsamplings stay f32 too.
        let taesd = AutoencoderTinyConfig {
            decoder_block_out_channels: vec![8; 4],
            num_decoder_blocks: vec![3, 3, 3, 1],
            ..cfg
        };
        let f = flags(&TinyDecoder::from_loader(&WeightStore::recorder("decoder", &Device::Cpu, DType::F32), &taesd).unwrap().layers);
        let (t, b) = (true, [false; 9]);
        let want: Vec<bool> = [&[t][..], &b, &[t], &b, &[t], &b, &[false], &[false; 3], &[t]].concat();
        assert_eq!(f, want);
    }
}
