//! A liveness walk over the forward passes brume runs: which tensors are alive
//! at once, op by op, so the peak of activations at a resolution and batch can be
//! predicted without running the model. The rules follow our own code (Rust
//! temporaries live to the end of their statement; `h = f(&h)` frees the old `h`
//! after `f` returns), not a generic framework's.

use crate::layers::AttentionMode;
use crate::models::{AutoencoderKLConfig, ClipTextConfig, UNetConfig};
use crate::models::unet_2d_condition::{DownBlockType, MidBlockType, UpBlockType};

/// Bytes the mapped convolution's patch buffer may take (see `layers/mapped.rs`).
const COLS_BUDGET: u64 = 16 << 20;

/// Which implementations the layers will run (`layers/norm.rs`,
/// `layers/attention.rs`), because they hold different temporaries: the fused
/// GroupNorm (+ SiLU) kernel writes its output and nothing else, and the fused
/// attention kernel never forms the `n_q x n_k` score matrix, so chunking the
/// queries saves nothing where it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels {
    pub fused_norm: bool,
    pub fused_attention: bool,
    /// 3x3 stride-1 convolutions run the direct kernel, whose scratch is three input
    /// rows per thread (under a megabyte at SD sizes), or for narrow maps a
    /// zero-bordered copy of the input (at most 16 MiB), not an im2col band.
    pub direct_conv: bool,
    /// The bf16 attention kernel that runs, if any: it rounds every head's keys and
    /// values into packed copies that live for the call.
    pub bf16_attention: Option<crate::kernels::Bf16Attention>,
    /// 3x3 convolutions with f32 products on large maps may run Winograd
    /// (`kernels::winograd::choose`: F(4x4, 3x3) by default where it wins), whose
    /// transformed kernel and chunk of transformed input and products live for the call.
    pub winograd: bool,
    /// An upsampler's conv with f32 products on the row layout reads the half-size map
    /// in place (`kernels::conv3x3::run_upsampled`): the doubled map is never formed.
    pub upsample_in_place: bool,
    /// 3x3 convolutions with bf16 products on mid-size maps may run Winograd F(2x2, 3x3)
    /// (`kernels::winograd_bf16::wins`): a larger packed kernel, and chunk scratch.
    pub bf16_winograd: bool,
}

impl Kernels {
    /// candle's plain ops (`--kernels reference`, other devices, non-f32 compute).
    pub const REFERENCE: Self =
        Self { fused_norm: false, fused_attention: false, direct_conv: false, bf16_attention: None, winograd: false, upsample_in_place: false, bf16_winograd: false };

    /// What this process runs on the CPU for activations of `dtype`, by the
    /// layers' own rules (`kernels::fast_for`, `kernels::fused_attention_on_cpu`).
    pub fn current(dtype: candle_core::DType) -> Self {
        let fast = crate::kernels::fast_for(dtype);
        let fused_attention = crate::kernels::fused_attention_on_cpu();
        let bf16_attention = if fused_attention { crate::kernels::bf16_attention() } else { None };
        let winograd = fast && crate::kernels::compute() == crate::kernels::Compute::F32 && crate::kernels::winograd::mode() != crate::kernels::winograd::Mode::Off;
        let upsample_in_place = fast && crate::kernels::compute() == crate::kernels::Compute::F32;
        let bf16_winograd = crate::kernels::bf16_copies_for(dtype);
        Self { fused_norm: fast, fused_attention, direct_conv: fast, bf16_attention, winograd, upsample_in_place, bf16_winograd }
    }
}

/// Live bytes and their running peak.
#[derive(Debug, Clone, Copy)]
pub struct Sim {
    live: u64,
    peak: u64,
    kernels: Kernels,
    /// Bytes of packed kernels the walk's convolutions keep beyond what
    /// `estimate::segment_weights` counts (bf16 Winograd transforms).
    held_weights: u64,
    /// The largest scratch a kernel keeps between calls (bf16 Winograd's chunk buffers).
    held_scratch: u64,
}

/// What a walk of one network found: its activations' peak, and the bytes its layers
/// keep from their first call on beyond what `estimate::segment_weights` counts (bf16
/// Winograd transforms, which depend on the map sizes, and that kernel's scratch), which
/// the estimator holds with the segment's weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Walk {
    pub peak: u64,
    pub held: u64,
}

impl Sim {
    fn new(kernels: Kernels) -> Self {
        Self { live: 0, peak: 0, kernels, held_weights: 0, held_scratch: 0 }
    }
    pub fn peak(&self) -> u64 {
        self.peak
    }
    fn walk(&self) -> Walk {
        Walk { peak: self.peak, held: self.held_weights + self.held_scratch }
    }
    /// Transient bytes of `GroupNorm` over `x` bytes. The plain path centres the
    /// input, which lives to the end of the call, and the normalised map, its
    /// scaled copy and the shifted result overlap it: four buffers of the input's
    /// size. The kernel writes one.
    fn norm(&self, x: u64) -> u64 {
        if self.kernels.fused_norm {
            x
        } else {
            4 * x
        }
    }
    /// `GroupNorm` then SiLU as a conv's input: the normalised map and the
    /// activation's output on the plain path, one fused output with the kernel.
    fn norm_act(&self, x: u64) -> u64 {
        if self.kernels.fused_norm {
            x
        } else {
            2 * x
        }
    }
    /// The scratch of a 3x3, stride-1 convolution from `c` to `o` channels over `m`.
    ///
    /// A bf16 Winograd conv holds its kernel's transform, 16/9 of the direct kernel's
    /// pair table that `estimate::segment_weights` counts, for as long as its segment is
    /// loaded (the difference, 14 bytes per (input, output) channel pair, goes to
    /// `held_weights`), and its scratch from its first call on (`held_scratch`): no
    /// transient bytes.
    fn conv3(&mut self, c: u64, o: u64, m: Map) -> u64 {
        let d = crate::kernels::conv3x3::Dims { batch: m.b as usize, in_ch: c as usize, out_ch: o as usize, h: m.h as usize, w: m.w as usize };
        if self.kernels.bf16_winograd && crate::kernels::winograd_bf16::wins(d) {
            self.held_weights += 14 * c * o;
            self.held_scratch = self.held_scratch.max(crate::kernels::winograd_bf16::scratch_bytes(d) as u64);
            return 0;
        }
        if let Some(bytes) = self.kernels.winograd.then(|| crate::kernels::winograd::scratch_bytes(d)).flatten() {
            bytes as u64
        } else if self.kernels.direct_conv {
            // Narrow maps run on a zero-bordered copy of the input (the flat layout).
            crate::kernels::conv3x3::scratch_bytes(m.b as usize, c as usize, m.h as usize, m.w as usize) as u64
        } else {
            cols(c, 3, m.h, m.w)
        }
    }
    fn alloc(&mut self, b: u64) {
        self.live += b;
        self.peak = self.peak.max(self.live);
    }
    fn free(&mut self, b: u64) {
        self.live = self.live.saturating_sub(b);
    }
    /// A transient `b` bytes on top of what is live.
    fn spike(&mut self, b: u64) {
        self.peak = self.peak.max(self.live + b);
    }
}

/// The patch buffer of a k x k convolution producing `ho x wo` from `c` channels.
fn cols(c: u64, k: u64, ho: u64, wo: u64) -> u64 {
    if k == 1 {
        return 0;
    }
    let ck = c * k * k;
    let band = (COLS_BUDGET / (4 * ck * wo).max(1)).clamp(1, ho.max(1)); // a 0-row map must not panic
    4 * ck * band * wo
}

/// Geometry of one feature map: batch x (h x w), `s` bytes per element.
#[derive(Debug, Clone, Copy)]
struct Map {
    b: u64,
    h: u64,
    w: u64,
    s: u64,
}

impl Map {
    /// Bytes of `c` channels.
    fn ch(&self, c: usize) -> u64 {
        self.b * self.h * self.w * self.s * c as u64
    }
    fn n(&self) -> u64 {
        self.h * self.w
    }
    fn half(&self) -> Map {
        Map { h: self.h.div_ceil(2), w: self.w.div_ceil(2), ..*self }
    }
    fn double(&self) -> Map {
        Map { h: self.h * 2, w: self.w * 2, ..*self }
    }
}

/// `ResnetBlock2D`: input live on entry; on return the output is live too. The
/// timestep offset and the skip are added in place by the convs (`layers::Fuse`), so
/// conv1's output is the only map before the shortcut, and conv2's is the output.
fn resnet(sim: &mut Sim, m: Map, cin: usize, cout: usize) {
    let (i, o) = (m.ch(cin), m.ch(cout));
    // norm1 internals, then norm + silu + conv1 and its patches.
    sim.spike(sim.norm(i));
    let conv = sim.conv3(cin as u64, cout as u64, m);
    sim.spike(sim.norm_act(i) + o + conv);
    sim.alloc(o); // h, the timestep offset added in place
    let mut held = o;
    if cin != cout {
        sim.alloc(o); // shortcut, live through conv2
        held += o;
    }
    sim.spike(sim.norm(o));
    let conv = sim.conv3(cout as u64, cout as u64, m);
    sim.spike(sim.norm_act(o) + o + conv);
    sim.alloc(o); // output: conv2 with the skip added in place
    sim.free(held);
}

/// Scaled dot-product attention over `heads` heads, `nq` queries and `nk` keys,
/// q/k/v of `c` channels (bytes `cq`, `ckv` for the query and key/value maps).
#[allow(clippy::too_many_arguments)]
fn attention(sim: &mut Sim, b: u64, heads: u64, nq: u64, nk: u64, cq: u64, ckv: u64, mode: AttentionMode) {
    // The kernel reads q, k, v in place (their last dimension is contiguous), f32
    // keys and values of long query runs from head-by-head copies, and writes the
    // output; its scratch is one tile. A bf16 kernel also packs the
    // rounded keys and values (2 bytes each), padded to its granule along the keys
    // and the head dimension.
    if sim.kernels.fused_attention {
        let packs = match sim.kernels.bf16_attention {
            // Multi-head k and v are views of [b, n_k, heads, d]: copied head by head
            // for long query runs (`flash_attention::packs_keys`).
            None if heads > 1 && nq as usize >= crate::kernels::flash_attention::PACK_KEYS_MIN_QUERIES => 2 * ckv,
            None => 0,
            Some(kernel) => {
                let g = if kernel == crate::kernels::Bf16Attention::Tiles { 32 } else { 2 };
                let d = (ckv / 4 / (b * nk * heads).max(1)).max(1);
                2 * b * heads * nk.next_multiple_of(g) * d.next_multiple_of(g) * 2
            }
        };
        sim.spike(cq + packs);
        return;
    }
    // Contiguous per-head copies of q, k, v; the scores, then scaled scores /
    // softmax (two score buffers at once); the output.
    match mode {
        AttentionMode::Full => {
            let scores = 4 * b * heads * nq * nk;
            sim.spike(cq + 2 * ckv + 2 * scores + cq);
        }
        AttentionMode::Chunked(chunk) => {
            let qc = (chunk.get() as u64).min(nq);
            let scores = 4 * b * heads * qc * nk;
            let q_chunk = cq * qc / nq.max(1);
            // k, v copies; all chunk outputs (one q's worth) then their concatenation.
            sim.spike(2 * ckv + q_chunk + 2 * scores + 2 * cq);
        }
    }
}

/// `Transformer2DModel` over `m` with `c` channels: input live on entry, output live on return.
#[allow(clippy::too_many_arguments)]
fn transformer(sim: &mut Sim, m: Map, c: usize, heads: usize, depth: usize, ctx_tokens: u64, only_cross: bool, mode: AttentionMode) {
    let t = m.ch(c);
    let ctx = m.b * ctx_tokens * m.s * c as u64;
    sim.spike(sim.norm(t));
    sim.alloc(t); // normed
    sim.spike(2 * t); // projection out + token copy
    sim.alloc(t); // tokens
    for _ in 0..depth {
        // norm1, q, k, v projections (views), then attention's copies and scores.
        if only_cross {
            sim.alloc(2 * t);
            attention(sim, m.b, heads as u64, m.n(), ctx_tokens, t, ctx, mode);
            sim.free(2 * t);
        } else {
            sim.alloc(4 * t);
            attention(sim, m.b, heads as u64, m.n(), m.n(), t, t, mode);
            sim.free(4 * t);
        }
        sim.spike(3 * t); // output, head merge copy, to_out
        sim.alloc(t); // x + a1
        sim.alloc(2 * t);
        attention(sim, m.b, heads as u64, m.n(), ctx_tokens, t, ctx, mode);
        sim.free(2 * t);
        sim.spike(3 * t);
        sim.alloc(t); // x + a2
        sim.free(t);
        // norm3, GEGLU projection (8c), gelu(gate) (4c), product (4c), out: candle's
        // plain ops. The fused GEGLU op needs 8c + 4c, and the projection made by
        // blocks of rows under bf16 compute 4c and a 2 MiB block (`Linear::forward_geglu`),
        // but an in-place weight is what decides the latter, which this walk does not
        // know, so it keeps the plain path's bound (at most 0.1 GB high at 512 px).
        sim.spike(t + 8 * t + 4 * t + 4 * t);
        sim.alloc(t); // new tokens
        sim.free(2 * t); // the block's input and the x + a1 intermediate
    }
    // Map copy and projection (the residual added in place), or the linear
    // projection and the residual sum.
    sim.spike(2 * t);
    sim.alloc(t); // output
    sim.free(2 * t); // normed, tokens
}

/// Peak activation bytes of one UNet evaluation on a latent of `h x w` with
/// batch `b` (already doubled for guidance), `s` bytes per element, and what its layers
/// keep ([`Walk`]).
#[allow(clippy::too_many_arguments)]
pub fn unet(cfg: &UNetConfig, b: usize, h: usize, w: usize, s: usize, ctx_tokens: usize, mode: AttentionMode, kernels: Kernels) -> Walk {
    let mut sim = Sim::new(kernels);
    let mut m = Map { b: b as u64, h: h as u64, w: w as u64, s: s as u64 };
    let ch = &cfg.block_out_channels;
    let ctx = ctx_tokens as u64;
    sim.alloc(m.ch(cfg.in_channels)); // the sample
    let conv = sim.conv3(cfg.in_channels as u64, ch[0] as u64, m);
    sim.spike(m.ch(ch[0]) + conv);
    sim.alloc(m.ch(ch[0])); // conv_in (also the first skip: shared storage)
    let mut skips: Vec<u64> = vec![m.ch(ch[0])];
    let mut prev = ch[0];
    for (i, &c) in ch.iter().enumerate() {
        let attn = cfg.down_block_types[i] == DownBlockType::CrossAttnDownBlock2D;
        for j in 0..cfg.layers_per_block[i] {
            let cin = if j == 0 { prev } else { c };
            resnet(&mut sim, m, cin, c);
            // The input stays alive: it is a skip (or conv_in / downsample output, also a skip).
            if attn {
                transformer(&mut sim, m, c, cfg.num_heads[i], cfg.transformer_layers_per_block[i], ctx, cfg.only_cross_attention[i], mode);
                sim.free(m.ch(c)); // the resnet output
            }
            skips.push(m.ch(c));
        }
        prev = c;
        if i + 1 < ch.len() {
            let down = m.half();
            sim.spike(down.ch(c) + cols(c as u64, 3, down.h, down.w));
            sim.alloc(down.ch(c));
            skips.push(down.ch(c));
            m = down;
        }
    }
    let last = *ch.last().unwrap_or(&0);
    let last_heads = cfg.num_heads.last().copied().unwrap_or(1);
    let last_depth = cfg.transformer_layers_per_block.last().copied().unwrap_or(1);
    match cfg.mid_block_type {
        MidBlockType::CrossAttn => {
            resnet(&mut sim, m, last, last);
            transformer(&mut sim, m, last, last_heads, last_depth, ctx, false, mode);
            resnet(&mut sim, m, last, last);
            sim.free(2 * m.ch(last));
        }
        MidBlockType::Plain => {
            resnet(&mut sim, m, last, last);
        }
        MidBlockType::None => sim.alloc(m.ch(last)),
    }
    // Every skip is held until its up-block layer; `h` is live.
    let rev: Vec<usize> = ch.iter().rev().copied().collect();
    let n = rev.len();
    let mut prev = rev[0];
    for (i, &c) in rev.iter().enumerate() {
        let bi = n - 1 - i;
        let attn = cfg.up_block_types[i] == UpBlockType::CrossAttnUpBlock2D;
        let layers = cfg.layers_per_block[bi] + 1;
        for j in 0..layers {
            let skip = skips.pop().unwrap_or(0);
            let skip_c = (skip / m.ch(1).max(1)) as usize;
            let cin = if j == 0 { prev } else { c };
            sim.alloc(m.ch(cin + skip_c)); // concatenation
            resnet(&mut sim, m, cin + skip_c, c);
            sim.free(m.ch(cin + skip_c) + m.ch(cin) + skip);
            if attn {
                transformer(&mut sim, m, c, cfg.num_heads[bi], cfg.reverse_transformer_layers_per_block.get(i).copied().unwrap_or(1), ctx, cfg.only_cross_attention[bi], mode);
                sim.free(m.ch(c));
            }
        }
        prev = c;
        if i + 1 < n {
            m = upsample(&mut sim, m, c);
        }
    }
    let conv = sim.conv3(ch[0] as u64, cfg.out_channels as u64, m);
    sim.spike(sim.norm(m.ch(ch[0])).max(sim.norm_act(m.ch(ch[0])) + conv + m.ch(cfg.out_channels)));
    sim.walk()
}

/// Peak activation bytes of the KL VAE decoder on a latent of `h x w`, batch `b`, and
/// what its layers keep ([`Walk`]).
pub fn vae_decoder(cfg: &AutoencoderKLConfig, b: usize, h: usize, w: usize, s: usize, kernels: Kernels) -> Walk {
    let mut sim = Sim::new(kernels);
    let mut m = Map { b: b as u64, h: h as u64, w: w as u64, s: s as u64 };
    let ch = &cfg.block_out_channels;
    let top = *ch.last().unwrap_or(&0);
    sim.alloc(2 * m.ch(cfg.latent_channels)); // latents, post_quant_conv
    let conv = sim.conv3(cfg.latent_channels as u64, top as u64, m);
    sim.spike(m.ch(top) + conv);
    sim.alloc(m.ch(top));
    resnet(&mut sim, m, top, top);
    sim.free(m.ch(top));
    if cfg.mid_block_add_attention {
        let t = m.ch(top);
        // norm (internals), token view; q/k/v (each from a contiguous copy), attention.
        sim.spike(sim.norm(t));
        sim.alloc(t);
        sim.spike(2 * t);
        sim.alloc(3 * t);
        attention(&mut sim, m.b, 1, m.n(), m.n(), t, t, AttentionMode::Full);
        sim.free(3 * t);
        sim.spike(4 * t);
        sim.alloc(t);
        sim.free(t);
    }
    resnet(&mut sim, m, top, top);
    sim.free(m.ch(top));
    let rev: Vec<usize> = ch.iter().rev().copied().collect();
    let mut prev = rev[0];
    for (i, &c) in rev.iter().enumerate() {
        for j in 0..cfg.layers_per_block + 1 {
            let cin = if j == 0 { prev } else { c };
            resnet(&mut sim, m, cin, c);
            sim.free(m.ch(cin));
        }
        prev = c;
        if i + 1 < rev.len() {
            m = upsample(&mut sim, m, c);
        }
    }
    let conv = sim.conv3(ch[0] as u64, cfg.out_channels as u64, m);
    sim.spike(sim.norm(m.ch(ch[0])).max(sim.norm_act(m.ch(ch[0])) + conv + m.ch(cfg.out_channels)));
    sim.walk()
}

/// Peak activation bytes of the CLIP text encoder on `b` sequences of `tokens`.
pub fn text_encoder(cfg: &ClipTextConfig, b: usize, tokens: usize, s: usize, kernels: Kernels) -> u64 {
    let (b, n, d, f) = (b as u64, tokens as u64, cfg.hidden_size as u64, cfg.intermediate_size as u64);
    let t = b * n * d * s as u64;
    // The fused kernel applies the causal mask itself and keeps no scores.
    let scores = if kernels.fused_attention { 0 } else { 4 * b * cfg.num_attention_heads as u64 * n * n };
    // hidden, norm, q/k/v and copies, causal mask, scores; or the MLP's fc1 + activation.
    let attn = 9 * t + 2 * scores + 4 * n * n;
    let mlp = 3 * t + 2 * b * n * f * s as u64;
    attn.max(mlp)
}

/// Nearest 2x upsample then its 3x3 conv: the doubled map, the conv's patch
/// buffer while it runs, its output; the input and the upsampled map are freed.
/// Where the conv reads the half-size map in place, only its scratch and output.
fn upsample(sim: &mut Sim, m: Map, c: usize) -> Map {
    let up = m.double();
    let (b, h, w) = (up.b as usize, up.h as usize, up.w as usize);
    let formed = !(sim.kernels.upsample_in_place && crate::kernels::conv3x3::reads_upsampled(crate::kernels::isa(), b, c, h, w));
    let doubled = if formed { up.ch(c) } else { 0 };
    sim.alloc(doubled);
    let mut conv = sim.conv3(c as u64, c as u64, up);
    // In place on the direct kernel it runs by output phases: a zero-bordered copy of
    // the half-size map, and per task its summed taps and partial sums
    // (`kernels::conv3x3_upsampled`).
    let d = crate::kernels::conv3x3::Dims { batch: b, in_ch: c, out_ch: c, h, w };
    if !formed && sim.kernels.direct_conv && !(sim.kernels.winograd && crate::kernels::winograd::scratch_bytes(d).is_some()) {
        conv += crate::kernels::conv3x3_upsampled::scratch_bytes(crate::kernels::isa(), d) as u64;
    }
    sim.spike(up.ch(c) + conv);
    sim.alloc(up.ch(c));
    sim.free(doubled + m.ch(c));
    up
}
