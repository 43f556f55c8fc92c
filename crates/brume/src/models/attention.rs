//! diffusers `attention.py` / `attention_processor.py` / `transformer_2d.py`:
//! multi-head attention, the GEGLU feed-forward, `BasicTransformerBlock` and
//! `Transformer2DModel` as the SD UNets use them.

use std::cell::{Cell, RefCell};

use candle_core::{Result, Tensor};

use crate::error::LoadError;
use crate::layers::{attention_with, AttentionMask, AttentionMode, Conv2d, Conv2dConfig, Fuse, GroupNorm, LayerNorm, Linear};
use crate::loading::Weights;

/// Cross-attention keys and values of one conditioning, computed on first use
/// and reused on every later step and image: the text does not change between
/// steps, so projecting it again each step is pure waste (on SD 1.5 at 512 px,
/// 16 layers x 2 projections of 77 tokens per step and branch).
#[derive(Debug, Default)]
pub struct KvCache {
    slots: RefCell<Vec<Option<(Tensor, Tensor)>>>,
    computed: Cell<usize>,
    reused: Cell<usize>,
}

impl KvCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// (projections computed, projections reused) so far.
    pub fn stats(&self) -> (usize, usize) {
        (self.computed.get(), self.reused.get())
    }

    /// Bytes held by the cached keys and values.
    pub fn nbytes(&self) -> usize {
        self.slots
            .borrow()
            .iter()
            .flatten()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
            .sum()
    }

    /// FLOPs one step spends projecting the text to keys and values: what the
    /// cache saves on every step after the first (`context_dim` is the text width).
    pub fn projection_flops(&self, context_dim: usize) -> u64 {
        self.slots
            .borrow()
            .iter()
            .flatten()
            .map(|(k, _)| {
                let d = k.dims();
                // [batch, heads, tokens, head_dim]: two projections of tokens x context_dim -> heads * head_dim.
                let (b, h, t, dh) = (d[0] as u64, d[1] as u64, d[2] as u64, d[3] as u64);
                2 * 2 * b * t * context_dim as u64 * h * dh
            })
            .sum()
    }

    /// Number of cross-attention layers cached.
    pub fn layers(&self) -> usize {
        self.slots.borrow().iter().flatten().count()
    }

    fn get_or_compute(&self, slot: usize, compute: impl FnOnce() -> Result<(Tensor, Tensor)>) -> Result<(Tensor, Tensor)> {
        if let Some(Some(kv)) = self.slots.borrow().get(slot) {
            self.reused.set(self.reused.get() + 1);
            return Ok(kv.clone());
        }
        let kv = compute()?;
        let mut slots = self.slots.borrow_mut();
        if slots.len() <= slot {
            slots.resize(slot + 1, None);
        }
        slots[slot] = Some(kv.clone());
        self.computed.set(self.computed.get() + 1);
        Ok(kv)
    }
}

/// The text conditioning as cross-attention layers see it: the encoder hidden
/// states and, optionally, the cache of their projections.
#[derive(Clone, Copy)]
pub struct CrossContext<'a> {
    pub hidden: &'a Tensor,
    pub cache: Option<&'a KvCache>,
    /// How every attention layer of the UNet forms its scores (chunked to bound memory).
    pub attention: AttentionMode,
}

impl<'a> CrossContext<'a> {
    pub fn uncached(hidden: &'a Tensor) -> Self {
        Self { hidden, cache: None, attention: AttentionMode::Full }
    }
}

/// `Attention` with separate q/k/v projections and `to_out.0`.
pub struct Attention {
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    heads: usize,
    dim_head: usize,
    /// This layer's place in a [`KvCache`] when it attends to the text.
    slot: Option<usize>,
}

impl Attention {
    /// `context_dim` is the key/value input width (`cross_attention_dim`), or
    /// `query_dim` for self-attention. `qkv_bias` is false in the UNet and true in the VAE.
    pub fn load(
        w: &Weights,
        query_dim: usize,
        context_dim: usize,
        heads: usize,
        dim_head: usize,
        qkv_bias: bool,
    ) -> std::result::Result<Self, LoadError> {
        let inner = heads * dim_head;
        Ok(Self {
            to_q: Linear::load(&w.pp("to_q"), query_dim, inner, qkv_bias)?,
            to_k: Linear::load(&w.pp("to_k"), context_dim, inner, qkv_bias)?,
            to_v: Linear::load(&w.pp("to_v"), context_dim, inner, qkv_bias)?,
            to_out: Linear::load(&w.pp("to_out").pp(0), inner, query_dim, true)?,
            heads,
            dim_head,
            slot: None,
        })
    }

    /// Marks this layer as attending to the text, with its cache slot.
    fn with_slot(mut self, slot: usize) -> Self {
        self.slot = Some(slot);
        self
    }

    /// Attention to the text: keys and values come from the cache when there is one.
    pub fn forward_cross(&self, x: &Tensor, ctx: &CrossContext) -> Result<Tensor> {
        let project = || -> Result<(Tensor, Tensor)> {
            let k = self.split_heads(&self.to_k.forward(ctx.hidden)?)?.contiguous()?;
            let v = self.split_heads(&self.to_v.forward(ctx.hidden)?)?.contiguous()?;
            Ok((k, v))
        };
        let (k, v) = match (ctx.cache, self.slot) {
            (Some(cache), Some(slot)) => cache.get_or_compute(slot, project)?,
            _ => project()?,
        };
        let o = self.attend(x, &k, &v, ctx.attention)?;
        self.to_out.forward(&o)
    }

    /// The heads' outputs merged back to [batch, n, inner], before `to_out`. The
    /// queries and the per-head output are dropped on return, so they do not
    /// live through the output projection.
    fn attend(&self, x: &Tensor, k: &Tensor, v: &Tensor, mode: AttentionMode) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        let q = self.split_heads(&self.to_q.forward(x)?)?;
        let scale = (self.dim_head as f64).powf(-0.5);
        let o = attention_with(&q, k, v, scale, AttentionMask::None, mode)?;
        o.transpose(1, 2)?.reshape((b, n, self.heads * self.dim_head))
    }

    fn split_heads(&self, t: &Tensor) -> Result<Tensor> {
        let (b, n, _) = t.dims3()?;
        t.reshape((b, n, self.heads, self.dim_head))?.transpose(1, 2)
    }

    /// `x` [batch, n, query_dim]; `context` [batch, m, context_dim] or `None` for self-attention.
    pub fn forward(&self, x: &Tensor, context: Option<&Tensor>) -> Result<Tensor> {
        self.forward_with(x, context, AttentionMode::Full)
    }

    /// [`Attention::forward`] with the scores formed as `mode` says.
    pub fn forward_with(&self, x: &Tensor, context: Option<&Tensor>, mode: AttentionMode) -> Result<Tensor> {
        let ctx = context.unwrap_or(x);
        // Keys and values are dropped before the output projection runs.
        let o = {
            let k = self.split_heads(&self.to_k.forward(ctx)?)?;
            let v = self.split_heads(&self.to_v.forward(ctx)?)?;
            self.attend(x, &k, &v, mode)?
        };
        self.to_out.forward(&o)
    }
}

/// `FeedForward` with `activation_fn="geglu"`: net.0 (GEGLU proj) -> net.2.
struct FeedForward {
    proj: Linear,
    out: Linear,
}

impl FeedForward {
    fn load(w: &Weights, dim: usize) -> std::result::Result<Self, LoadError> {
        let inner = dim * 4;
        Ok(Self {
            proj: Linear::load(&w.pp("net").pp(0).pp("proj"), dim, inner * 2, true)?,
            out: Linear::load(&w.pp("net").pp(2), inner, dim, true)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // The projection (8 maps wide) and the GELU are freed before the output
        // projection runs.
        let p = self.proj.forward_geglu(x)?;
        self.out.forward(&p)
    }
}

/// `BasicTransformerBlock` (layer-norm variant): self-attention (or cross-attention
/// when `only_cross_attention`), cross-attention, GEGLU feed-forward.
struct BasicTransformerBlock {
    norm1: LayerNorm,
    attn1: Attention,
    norm2: LayerNorm,
    attn2: Attention,
    norm3: LayerNorm,
    ff: FeedForward,
    only_cross_attention: bool,
}

impl BasicTransformerBlock {
    fn load(w: &Weights, c: &TransformerConfig) -> std::result::Result<Self, LoadError> {
        let dim = c.heads * c.dim_head;
        let attn1_ctx = if c.only_cross_attention { c.cross_attention_dim } else { dim };
        let mut attn1 = Attention::load(&w.pp("attn1"), dim, attn1_ctx, c.heads, c.dim_head, false)?;
        if c.only_cross_attention {
            attn1 = attn1.with_slot(w.next_slot());
        }
        let attn2 =
            Attention::load(&w.pp("attn2"), dim, c.cross_attention_dim, c.heads, c.dim_head, false)?.with_slot(w.next_slot());
        Ok(Self {
            norm1: LayerNorm::load(&w.pp("norm1"), dim, 1e-5)?,
            attn1,
            norm2: LayerNorm::load(&w.pp("norm2"), dim, 1e-5)?,
            attn2,
            norm3: LayerNorm::load(&w.pp("norm3"), dim, 1e-5)?,
            ff: FeedForward::load(&w.pp("ff"), dim)?,
            only_cross_attention: c.only_cross_attention,
        })
    }

    /// Each intermediate is dropped as soon as the next exists (a shadowed
    /// binding would live to the end of the function): at 64x64 with guidance
    /// that is four token maps, ~42 MiB, off the UNet's peak, and it is what
    /// `memory::sim::transformer` assumes.
    fn forward(&self, x: &Tensor, ctx: &CrossContext) -> Result<Tensor> {
        let a1 = {
            let h = self.norm1.forward(x)?;
            if self.only_cross_attention {
                self.attn1.forward_cross(&h, ctx)?
            } else {
                self.attn1.forward_with(&h, None, ctx.attention)?
            }
        };
        let x = {
            let x1 = (a1 + x)?;
            (self.attn2.forward_cross(&self.norm2.forward(&x1)?, ctx)? + &x1)?
        };
        let y = self.ff.forward(&self.norm3.forward(&x)?)?;
        y + x
    }
}

/// Shape parameters of a [`Transformer2DModel`].
#[derive(Debug, Clone, Copy)]
pub struct TransformerConfig {
    pub channels: usize,
    pub heads: usize,
    pub dim_head: usize,
    pub layers: usize,
    pub cross_attention_dim: usize,
    pub groups: usize,
    pub use_linear_projection: bool,
    pub only_cross_attention: bool,
}

enum Projection {
    Conv(Conv2d),
    Linear(Linear),
}

/// `Transformer2DModel` over an NCHW feature map, with a residual connection.
pub struct Transformer2DModel {
    norm: GroupNorm,
    proj_in: Projection,
    blocks: Vec<BasicTransformerBlock>,
    proj_out: Projection,
    inner: usize,
}

impl Transformer2DModel {
    pub fn load(w: &Weights, c: &TransformerConfig) -> std::result::Result<Self, LoadError> {
        let inner = c.heads * c.dim_head;
        let (proj_in, proj_out) = if c.use_linear_projection {
            (
                Projection::Linear(Linear::load(&w.pp("proj_in"), c.channels, inner, true)?),
                Projection::Linear(Linear::load(&w.pp("proj_out"), inner, c.channels, true)?),
            )
        } else {
            (
                Projection::Conv(Conv2d::load(&w.pp("proj_in"), c.channels, inner, Conv2dConfig::K1, true)?),
                Projection::Conv(Conv2d::load(&w.pp("proj_out"), inner, c.channels, Conv2dConfig::K1, true)?),
            )
        };
        Ok(Self {
            norm: GroupNorm::load(&w.pp("norm"), c.groups, c.channels, 1e-6)?,
            proj_in,
            blocks: (0..c.layers)
                .map(|i| BasicTransformerBlock::load(&w.pp("transformer_blocks").pp(i), c))
                .collect::<std::result::Result<_, _>>()?,
            proj_out,
            inner,
        })
    }

    pub fn forward(&self, x: &Tensor, context: &CrossContext) -> Result<Tensor> {
        let (b, c, h, w) = x.dims4()?;
        let residual = x;
        let x = self.norm.forward(x)?;
        let to_tokens = |t: &Tensor, ch: usize| t.permute((0, 2, 3, 1))?.reshape((b, h * w, ch));
        let mut tokens = match &self.proj_in {
            Projection::Conv(conv) => to_tokens(&conv.forward(&x)?, self.inner)?,
            Projection::Linear(lin) => lin.forward(&to_tokens(&x, c)?)?,
        };
        for block in &self.blocks {
            tokens = block.forward(&tokens, context)?;
        }
        let to_map = |t: &Tensor, ch: usize| t.reshape((b, h, w, ch))?.permute((0, 3, 1, 2));
        match &self.proj_out {
            // The residual added in place to the projection's output ([`Fuse`]).
            Projection::Conv(conv) => conv.forward_with(&to_map(&tokens, self.inner)?.contiguous()?, Fuse::residual(residual)),
            Projection::Linear(lin) => to_map(&lin.forward(&tokens)?, c)? + residual,
        }
    }
}
