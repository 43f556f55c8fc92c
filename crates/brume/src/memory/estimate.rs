//! Peak memory of a request, predicted from the model's safetensors headers
//! (dtype and bytes of every tensor) and configs, before anything is loaded.
//!
//! Two figures, because the OS charges them differently: RSS counts every
//! resident page, including memory-mapped f32 weights read in place; private
//! dirty counts only memory the process wrote (converted or upcast weights,
//! activations), which is what a phone's jetsam charges and what cannot be
//! evicted. Mapped weights are clean pages the kernel can drop and re-read.

use candle_core::DType;

use super::sim::{self, Kernels};
use super::strategy::{Branches, Residency, Strategy, VaeDecode};
use crate::loading::Segment;
use crate::models::{ClipTextConfig, UNetConfig};
use crate::pipelines::{SdModel, VaeConfig};

/// Private memory of the process itself before any model runs: code and data
/// of the executable, the tokenizer's tables, thread stacks and allocator
/// arenas. Measured on Linux x86-64: `brume generate --width 64 --height 64
/// --memory-report` on the built-in model peaks at 11 MiB private.
pub const BASE_PRIVATE: u64 = 10 << 20;
/// Resident clean pages of the executable and shared libraries (the same run:
/// 21.4 MiB RSS, 11 MiB of it private).
pub const BASE_SHARED: u64 = 10 << 20;
/// Tokens of a CLIP prompt.
const TOKENS: usize = 77;

/// Memory as the OS charges it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Footprint {
    /// Resident set: private memory plus resident mapped (clean) weight pages.
    pub rss: u64,
    /// Private dirty memory only.
    pub private_dirty: u64,
}

impl Footprint {
    fn add(self, o: Footprint) -> Footprint {
        Footprint { rss: self.rss + o.rss, private_dirty: self.private_dirty + o.private_dirty }
    }
    fn max(self, o: Footprint) -> Footprint {
        Footprint { rss: self.rss.max(o.rss), private_dirty: self.private_dirty.max(o.private_dirty) }
    }
    fn private(b: u64) -> Footprint {
        Footprint { rss: b, private_dirty: b }
    }
}

/// One segment's weights as they will sit in memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentWeights {
    /// Matrices and kernels read in place from the mapped file (clean pages):
    /// f32 ones directly, half-precision and compressed ones expanded per layer.
    pub mapped: u64,
    /// Copied or converted tensors (private dirty).
    pub private: u64,
    /// The largest block a packed linear or conv weight of the segment expands
    /// into (f32 bytes): the per-thread scratch, which outlives the segment.
    pub scratch: u64,
}

impl SegmentWeights {
    fn footprint(&self) -> Footprint {
        Footprint { rss: self.mapped + self.private, private_dirty: self.private }
    }
}

/// How a segment's weights will be held when computing in `dtype` on the CPU,
/// following `layers::Param::load`: matrices and kernels (rank >= 2) stored as
/// f32, f16, bf16 or compressed stay in the file (f32 read in place, the rest
/// expanded a block of output channels at a time into a reused scratch); every
/// other floating tensor, and everything when computing in another dtype, is
/// materialised in the compute dtype.
pub fn segment_weights(model: &SdModel, seg: Segment, dtype: DType) -> SegmentWeights {
    use crate::layers::packed::{block_rows, BLOCK_ALIGN, EXPAND_BLOCK_VALUES};
    use crate::quantization::Scheme;
    let (component, prefixes) = seg.weights();
    let mut w = SegmentWeights::default();
    // Under `--compute bf16`, each in-place f32 conv and linear weight keeps a bf16
    // copy packed for its kernel (layers::mapped): half its bytes, private. (TAESD's
    // first and last convs, and the convs after its first two upsamplings, keep f32
    // products by position, not by name, so they are
    // counted here though they make no copy: at most a few KiB over, on the safe side.)
    let bf16_copies = crate::kernels::bf16_copies_for(dtype);
    for (name, t) in model.store(component).iter() {
        if !prefixes.is_empty() && !prefixes.iter().any(|p| name.starts_with(p)) {
            continue;
        }
        let Some(scheme) = t.scheme() else { continue };
        let shape = t.shape();
        let numel: usize = shape.iter().product();
        if dtype == DType::F32 && shape.len() >= 2 {
            w.mapped += t.nbytes() as u64;
            let rounded = !name.contains("embeddings.") && !name.contains("downsamplers.") && !crate::layers::f32_products(name);
            if bf16_copies && scheme == Scheme::F32 && rounded {
                w.private += numel as u64 * 2;
            }
            // Embedding tables are gathered row by row, with no scratch.
            if scheme != Scheme::F32 && !name.contains("embeddings.") {
                let (rows, row) = (shape[0], numel / shape[0].max(1));
                let block = block_rows(rows, row, EXPAND_BLOCK_VALUES, BLOCK_ALIGN) * row;
                w.scratch = w.scratch.max(block as u64 * 4);
            }
        } else {
            w.private += (numel * dtype.size_in_bytes()) as u64;
        }
    }
    w
}

/// What the estimator needs of a model: its configs and how each segment's
/// weights will sit in memory in the compute dtype. Owned, so a guard can keep
/// it for the whole run.
#[derive(Debug, Clone)]
pub struct ModelProfile {
    pub text: ClipTextConfig,
    pub unet: UNetConfig,
    pub vae: VaeConfig,
    pub dtype: DType,
    /// The implementations the layers will run, which decide their temporaries.
    pub kernels: Kernels,
    weights: [SegmentWeights; 4],
}

impl ModelProfile {
    pub fn of(model: &SdModel, dtype: DType) -> Self {
        let weights = Segment::ALL.map(|s| segment_weights(model, s, dtype));
        Self {
            text: model.text_config.clone(),
            unet: model.unet_config.clone(),
            vae: model.vae_config.clone(),
            dtype,
            kernels: Kernels::current(dtype),
            weights,
        }
    }

    /// The same model as run on other kernels (the planner's tests use the
    /// plain path, where chunked attention is a rung of its own).
    pub fn with_kernels(self, kernels: Kernels) -> Self {
        Self { kernels, ..self }
    }

    pub fn weights(&self, s: Segment) -> SegmentWeights {
        let i = Segment::ALL.iter().position(|&x| x == s).unwrap_or(0);
        self.weights[i]
    }
}

/// The shape of a request as the estimator needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestShape {
    pub batch: usize,
    /// Classifier-free guidance doubles the UNet batch.
    pub guided: bool,
    pub width: usize,
    pub height: usize,
    /// Whether the VAE encoder runs (img2img, inpainting).
    pub encodes_image: bool,
}

/// Predicted peaks, per phase and overall.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Estimate {
    pub text: Footprint,
    /// The VAE encoder phase (edits only; zero otherwise).
    pub encode: Footprint,
    pub unet: Footprint,
    pub decode: Footprint,
    pub peak: Footprint,
}

/// Predicts the peak memory of `req` run as `strategy`.
pub fn estimate(model: &ModelProfile, req: &RequestShape, strategy: &Strategy) -> Estimate {
    let s = model.dtype.size_in_bytes();
    let weights = |seg| model.weights(seg).footprint();
    let text_w = weights(Segment::TextEncoder);
    let unet_w = weights(Segment::Unet);
    let dec_w = weights(Segment::VaeDecoder);
    let enc_w = if req.encodes_image { weights(Segment::VaeEncoder) } else { Footprint::default() };
    let branches = if req.guided { 2 } else { 1 };
    let f = model.vae.scale_factor();
    let (lh, lw) = (req.height / f, req.width / f);
    let lat_c = model.vae.latent_channels() as u64;
    let latents = (req.batch * lh * lw) as u64 * lat_c * 4;
    let hidden = model.text.hidden_size;
    // Encoder hidden states per branch and the cross-attention K/V cache.
    let cond = (branches * req.batch * TOKENS * hidden * 4) as u64 * 2
        + kv_channels(&model.unet) * (branches * req.batch * TOKENS * s) as u64;
    let base = Footprint { rss: BASE_PRIVATE + BASE_SHARED, private_dirty: BASE_PRIVATE };
    // The expansion scratch is the running thread's and never shrinks: each phase
    // holds the largest block of every segment run so far (text, encode, UNet, decode).
    let scratch = |segs: &[Segment]| {
        Footprint::private(segs.iter().map(|&s| model.weights(s).scratch).max().unwrap_or(0))
    };
    let encoder = if req.encodes_image { Segment::VaeEncoder } else { Segment::TextEncoder };
    let text_scratch = scratch(&[Segment::TextEncoder]);
    let enc_scratch = scratch(&[Segment::TextEncoder, encoder]);
    let unet_scratch = scratch(&[Segment::TextEncoder, encoder, Segment::Unet]);
    let dec_scratch = scratch(&[Segment::TextEncoder, encoder, Segment::Unet, Segment::VaeDecoder]);

    let text_act = sim::text_encoder(&model.text, req.batch, TOKENS, s, model.kernels);
    // One branch at a time: half the UNet batch, plus the first branch's output
    // held while the second runs.
    let (unet_batch, held) = match strategy.branches {
        Branches::OneAtATime if req.guided => (req.batch, latents),
        _ => (branches * req.batch, 0),
    };
    let unet_walk = sim::unet(&model.unet, unet_batch, lh, lw, s, TOKENS, strategy.attention, model.kernels);
    let unet_act = unet_walk.peak + held;
    let image = (req.batch * 3 * req.height * req.width * 4) as u64;
    let (dec_act, dec_held) = match (&model.vae, strategy.vae) {
        (VaeConfig::Kl(c), VaeDecode::Full) => {
            let walk = sim::vae_decoder(c, req.batch, lh, lw, s, model.kernels);
            (walk.peak, walk.held)
        }
        (VaeConfig::Kl(c), VaeDecode::Tiled(t)) => {
            let (th, tw) = (t.tile().min(lh), t.tile().min(lw));
            // One tile (of the whole batch) at a time, into an output canvas and its blend weights.
            let walk = sim::vae_decoder(c, req.batch, th, tw, s, model.kernels);
            (walk.peak + image + (req.height * req.width * 4) as u64, walk.held)
        }
        // The tiny VAE's activations are a small multiple of the image.
        (VaeConfig::Tiny(_), _) => (8 * image, 0),
    };
    // What the layers keep from their first call on with their weights (bf16 Winograd
    // transforms, sized by the maps they run on, and that kernel's scratch).
    let unet_w = unet_w.add(Footprint::private(unet_walk.held));
    let dec_w = dec_w.add(Footprint::private(dec_held));

    // The encoder's walk is bounded by the decoder's: at every resolution the SD
    // VAEs' decoder has at least the encoder's channels.
    let enc_act = match &model.vae {
        VaeConfig::Kl(c) if req.encodes_image => sim::vae_decoder(c, 1, lh, lw, s, model.kernels).peak + image,
        VaeConfig::Tiny(_) if req.encodes_image => 8 * image,
        _ => 0,
    };
    let (text, unet, decode) = match strategy.residency {
        Residency::AllResident => {
            let all = text_w.add(unet_w).add(dec_w).add(enc_w);
            (
                base.add(all).add(Footprint::private(text_act)),
                base.add(all).add(Footprint::private(cond + latents + unet_act)),
                base.add(all).add(Footprint::private(cond + latents + dec_act + image)),
            )
        }
        Residency::Sequential => (
            base.add(text_w).add(Footprint::private(text_act)),
            base.add(unet_w).add(Footprint::private(cond + latents + unet_act)),
            // The conditioning (with its K/V cache) lives until the pipeline returns.
            base.add(dec_w).add(Footprint::private(cond + latents + dec_act + image)),
        ),
    };
    let (text, unet, decode) = (text.add(text_scratch), unet.add(unet_scratch), decode.add(dec_scratch));
    let encode = if req.encodes_image {
        let weights = match strategy.residency {
            Residency::AllResident => text_w.add(unet_w).add(dec_w).add(enc_w),
            Residency::Sequential => enc_w,
        };
        base.add(weights).add(Footprint::private(cond + enc_act)).add(enc_scratch)
    } else {
        Footprint::default()
    };
    Estimate { text, encode, unet, decode, peak: text.max(encode).max(unet).max(decode) }
}

/// Sum over cross-attention layers of their K and V widths: what one token of
/// conditioning costs in the K/V cache, per element size.
fn kv_channels(u: &UNetConfig) -> u64 {
    use crate::models::unet_2d_condition::{DownBlockType, MidBlockType, UpBlockType};
    let ch = &u.block_out_channels;
    let n = ch.len();
    let mut total = 0usize;
    for i in 0..n {
        if u.down_block_types[i] == DownBlockType::CrossAttnDownBlock2D {
            total += u.layers_per_block[i] * u.transformer_layers_per_block[i] * ch[i];
        }
        let bi = n - 1 - i;
        if u.up_block_types[i] == UpBlockType::CrossAttnUpBlock2D {
            let depth = u.reverse_transformer_layers_per_block.get(i).copied().unwrap_or(1);
            total += (u.layers_per_block[bi] + 1) * depth * ch[bi];
        }
    }
    if u.mid_block_type == MidBlockType::CrossAttn {
        total += u.transformer_layers_per_block.last().copied().unwrap_or(1) * ch[n - 1];
    }
    2 * total as u64
}
