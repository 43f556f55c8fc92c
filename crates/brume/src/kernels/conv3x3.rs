//! Direct 3x3 convolution, stride 1, padding 1: the UNet's and the VAE's main conv.
//!
//! The im2col + GEMM path unfolds every input value nine times into a patch buffer
//! and hands a general matrix product shapes it is poor at when the channel count
//! is small (the built-in model's VAE runs 16 channels at 128x128: a 16-row GEMM).
//! This kernel instead keeps a block of 6 output channels x 2 vectors of output
//! pixels in registers (4 vectors on AVX-512 rows a multiple of 64 wide) and, for
//! every input channel and tap, loads two (four) input vectors and broadcasts six
//! weights: 12 FMAs per 8 loads (24 per 10), so it is arithmetic-bound at any
//! channel count. Weights are read where they are (out, in, 3, 3) — six streams
//! of contiguous taps — so nothing is repacked and no per-layer copy is made. The
//! only scratch is three zero-bordered input rows per task (one thread-local
//! buffer), which also removes every bounds check from the inner loop. On AVX2
//! those rows are cut into one tile per register block (its 16 columns and the two
//! beside them, every channel's three rows in a row): see [`output_row`].
//!
//! A block of 2 vectors is 32 pixels (AVX-512), so rows narrower than that, or of
//! another width, would compute lanes that are thrown away: half of them on a
//! 16-wide map, three quarters on an 8-wide one, which is where an SD UNet's
//! 1280-channel layers run. Those maps take the flat layout ([`Flat`]) instead: the
//! whole image, zero-bordered, as one row of pitch `w + 2`, so a block of 32 runs on
//! across rows and only the two border columns per row are wasted. Such layers have
//! few positions and many weights, so their tasks take runs of position blocks and
//! walk the input channels in panels ([`FlatTasks`]): the kernel is read once per
//! run, not once per block.

use std::cell::RefCell;

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::matmul::{load_block, store_block, store_wide};
use super::simd::{Portable, Simd};
use super::{isa, require, Isa, SharedMut};

/// Output channels per register block (the bf16 kernel's too: [`FlatTasks`] counts
/// channel blocks of OB for both).
pub(crate) const OB: usize = 6;
// A block's partial sums go through the GEMM's block loads and stores (MR rows).
const _: () = assert!(OB == super::matmul::MR);

thread_local! {
    /// Three zero-bordered input rows of every channel, reused across tasks.
    static ROWS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The sizes of one convolution.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub batch: usize,
    pub in_ch: usize,
    pub out_ch: usize,
    pub h: usize,
    pub w: usize,
}

impl Dims {
    /// Checks a call's f32 buffers (input, [o, c, 3, 3] kernel, output) against these
    /// sizes; `Ok(false)` when nothing is left to compute (an empty output, or no input
    /// channels, which zeroes it). `what` names the kernel in the error.
    pub(crate) fn check(&self, what: &str, x: &[f32], weights: &[f32], out: &mut [f32]) -> Result<bool> {
        let Dims { batch, in_ch: c, out_ch: o, h, w } = *self;
        if x.len() != batch * c * h * w || weights.len() != o * c * 9 || out.len() != batch * o * h * w {
            candle_core::bail!("{what}: buffer sizes do not match {self:?}");
        }
        Ok(self.needs_compute(out))
    }

    /// Checks the buffers of a conv that reads the nearest-neighbour 2x upsampling of
    /// `x` ([b, c, h / 2, w / 2]) in place, against these (the output's) sizes.
    pub(crate) fn check_upsampled(&self, what: &str, x: &[f32], weights: &[f32], out: &[f32]) -> Result<()> {
        let Dims { batch, in_ch: c, out_ch: o, h, w } = *self;
        if !h.is_multiple_of(2) || !w.is_multiple_of(2) || x.len() != batch * c * (h / 2) * (w / 2) {
            candle_core::bail!("{what} (upsampled): input of {} values is not the half-size map of {self:?}", x.len());
        }
        if weights.len() != o * c * 9 || out.len() != batch * o * h * w {
            candle_core::bail!("{what} (upsampled): buffer sizes do not match {self:?}");
        }
        Ok(())
    }

    /// `false` when nothing is left to compute in `out`: it is empty, or there are no
    /// input channels (then it is zeroed).
    pub(crate) fn needs_compute(&self, out: &mut [f32]) -> bool {
        if out.is_empty() {
            return false;
        }
        if self.in_ch == 0 {
            out.fill(0.0);
            return false;
        }
        true
    }
}

/// Largest zero-bordered copy of the input the flat layout may make; past it the
/// row layout runs, whatever lanes it wastes.
const FLAT_SCRATCH_MAX: usize = 16 << 20;

/// The flat layout of a small or odd-width map: each channel's plane, zero-bordered,
/// is one row of `pitch = w + 2` values per image row, so output pixel (y, x) is flat
/// position `y * pitch + x` and its tap (ky, kx) reads position `+ ky * pitch + kx`.
/// Blocks of `xb` positions run over `blocks * xb >= h * pitch`; a channel's plane
/// takes `plane` values, the last block's farthest tap included.
///
/// `dense` drops the two border columns (`pitch = w`, a zero row above and below and
/// one zero value before): a kernel that masks its kx = 0 loads at x = 0 and its kx = 2
/// loads at x = w - 1 ([`Flat::edge_masks`]) then computes no lane for a border column.
/// Those columns were 2 of every 18 lanes at 16x16 and, with the last block's tail,
/// a third of them at 8x8 (80 positions in 3 blocks of 32; dense: 64 in 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Flat {
    pub pitch: usize,
    pub blocks: usize,
    pub plane: usize,
    pub dense: bool,
}

impl Flat {
    /// The flat layout of an h x w map in blocks of `xb` positions, whatever it wastes
    /// (the AMX conv runs every map this way).
    pub(crate) fn new(h: usize, w: usize, xb: usize) -> Self {
        Self::with_pitch(h, w + 2, xb, false)
    }

    /// The dense flat layout (no border columns) of an h x w map in blocks of `xb`.
    pub(crate) fn dense(h: usize, w: usize, xb: usize) -> Self {
        Self::with_pitch(h, w, xb, true)
    }

    fn with_pitch(h: usize, pitch: usize, xb: usize, dense: bool) -> Self {
        let blocks = (h * pitch).div_ceil(xb);
        Self { pitch, blocks, plane: blocks * xb + 2 * pitch + 2, dense }
    }

    /// `Some` when the flat layout (`dense` where the kernel masks the border
    /// columns) computes at least a tenth fewer lanes than the row layout with blocks
    /// of `xb` pixels and its copy of the input (`channels` planes per image: the
    /// input channels for f32, the channel pairs for bf16) stays small.
    pub(crate) fn plan(batch: usize, channels: usize, h: usize, w: usize, xb: usize, dense: bool) -> Option<Self> {
        if w.is_multiple_of(xb) || h == 0 || w == 0 {
            return None;
        }
        let flat = if dense { Self::dense(h, w, xb) } else { Self::new(h, w, xb) };
        let row_lanes = h * w.div_ceil(xb) * xb;
        (flat.blocks * xb * 10 <= row_lanes * 9 && flat.bytes(batch, channels) <= FLAT_SCRATCH_MAX).then_some(flat)
    }

    /// Per block of `xb` (<= 64) positions of a dense layout (whose pitch is the map's
    /// width), the lanes whose kx = 0 tap reads inside the map (bit i: position
    /// blk * xb + i is not in column 0) and those whose kx = 2 tap does (not in the
    /// last column); all ones for a bordered layout.
    pub(crate) fn edge_masks(&self, xb: usize) -> Vec<EdgeLanes> {
        (0..self.blocks)
            .map(|blk| {
                let mut m = [0u64; 2];
                for i in 0..xb {
                    let x = (blk * xb + i) % self.pitch;
                    m[0] |= u64::from(!self.dense || x != 0) << i;
                    m[1] |= u64::from(!self.dense || x + 1 != self.pitch) << i;
                }
                EdgeLanes(m)
            })
            .collect()
    }

    /// Bytes of the zero-bordered copy of `batch` images of `channels` planes
    /// (saturating: a size past `usize` is simply too large).
    pub(crate) fn bytes(&self, batch: usize, channels: usize) -> usize {
        batch.saturating_mul(channels).saturating_mul(self.plane).saturating_mul(4)
    }

    /// Copies the valid positions of a block's `count`-lane result, starting at flat
    /// position `p0`, to output plane `dst` ([h, w]).
    ///
    /// SAFETY: `dst` points at an h x w plane with h * pitch >= the flat positions
    /// covered (`blocks * xb` from 0) and `src` at `count` floats.
    #[inline(always)]
    pub(crate) unsafe fn scatter(&self, w: usize, h: usize, src: *const f32, p0: usize, count: usize, dst: *mut f32) {
        let end = (p0 + count).min(h * self.pitch);
        if self.dense {
            // Flat position p is output pixel p: one copy.
            // SAFETY: p0..end lies inside the h x w plane; end - p0 <= count.
            unsafe { std::ptr::copy_nonoverlapping(src, dst.add(p0), end.saturating_sub(p0)) };
            return;
        }
        let mut p = p0;
        while p < end {
            let (y, x) = (p / self.pitch, p % self.pitch);
            let row_end = ((y + 1) * self.pitch).min(end);
            if x < w {
                let n = (w - x).min(row_end - p);
                // SAFETY: y < h and x + n <= w: inside the plane; p - p0 + n <= count.
                unsafe { std::ptr::copy_nonoverlapping(src.add(p - p0), dst.add(y * w + x), n) };
            }
            p = row_end;
        }
    }
}

/// Which lanes of a block's tap loads read the input; the others read zero. One
/// loop ([`block`], the bf16 kernel's) serves the row layout and the bordered flat
/// one ([`AllLanes`]: plain loads) and the dense flat one ([`EdgeLanes`]: masked).
pub(crate) trait TapLanes: Copy {
    /// Every lane loads: the block takes plain loads.
    const ALL: bool;
    /// The lanes of tap column `kx`'s load of lanes `first..` (bit i: lane first + i).
    fn lanes(self, kx: usize, first: usize) -> u64;
}

#[derive(Clone, Copy)]
pub(crate) struct AllLanes;

impl TapLanes for AllLanes {
    const ALL: bool = true;
    #[inline(always)]
    fn lanes(self, _kx: usize, _first: usize) -> u64 {
        u64::MAX
    }
}

/// A dense flat block's lanes for kx = 0 and kx = 2 ([`Flat::edge_masks`]); kx = 1
/// reads every lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EdgeLanes(pub [u64; 2]);

impl TapLanes for EdgeLanes {
    const ALL: bool = false;
    #[inline(always)]
    fn lanes(self, kx: usize, first: usize) -> u64 {
        match kx {
            0 => self.0[0] >> first,
            2 => self.0[1] >> first,
            _ => u64::MAX,
        }
    }
}

/// Bytes of scratch a 3x3 conv of `channels` input channels over `batch` maps of
/// h x w takes beyond its output with this CPU's kernels (the flat layout's copy;
/// the row layout's three rows per thread are too small to count; AVX2's GEMM route
/// for the smallest maps, one image's unfolded input; on AMX, the packed input every
/// map takes).
pub fn scratch_bytes(batch: usize, channels: usize, h: usize, w: usize) -> usize {
    if super::amx_for(candle_core::DType::F32) {
        return super::amx::conv3x3_input_bytes(batch, channels, h, w);
    }
    let d = Dims { batch, in_ch: channels, out_ch: 1, h, w };
    if gemm_wins(isa(), d) {
        return channels.saturating_mul(9 * h * w * 4);
    }
    let xb = 2 * isa().lanes();
    Flat::plan(batch, channels, h, w, xb, dense_flat(isa())).map_or(0, |f| f.bytes(batch, channels))
}

/// 3x3 / stride 1 / padding 1 convolution of `x` [b, c, h, w] with `w` [o, c, 3, 3]
/// (no bias) on the instruction set `isa`; contiguous f32 CPU tensors.
pub fn conv3x3_on(isa: Isa, x: &Tensor, w: &Tensor) -> Result<Tensor> {
    on_tensors(isa, x, w, false)
}

/// As [`conv3x3_on`] by the unfold + GEMM route [`run_best`] takes for AVX2's smallest
/// maps, whatever the sizes (tests and benches).
pub fn conv3x3_gemm_on(isa: Isa, x: &Tensor, w: &Tensor) -> Result<Tensor> {
    on_tensors(isa, x, w, true)
}

fn on_tensors(isa: Isa, x: &Tensor, w: &Tensor, gemm: bool) -> Result<Tensor> {
    require(isa)?;
    let w = w.contiguous()?;
    let (o, wc, kh, kw) = w.dims4()?;
    if (kh, kw) != (3, 3) || wc != x.dim(1)? {
        candle_core::bail!("conv3x3: kernel {:?} does not fit input {:?}", w.dims(), x.dims());
    }
    let (storage, layout) = w.storage_and_layout();
    let candle_core::Storage::Cpu(CpuStorage::F32(data)) = &*storage else {
        candle_core::bail!("conv3x3: the kernel must be an f32 CPU tensor");
    };
    let (a, b) = layout.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("conv3x3: strided kernel".into()))?;
    x.contiguous()?.apply_op1_no_bwd(&Conv3x3Op { weights: &data[a..b], out_ch: o, isa, gemm })
}

/// As [`conv3x3_on`] on this CPU's widest instruction set.
pub fn conv3x3(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    conv3x3_on(isa(), x, w)
}

struct Conv3x3Op<'a> {
    weights: &'a [f32],
    out_ch: usize,
    isa: Isa,
    gemm: bool,
}

impl CustomOp1 for Conv3x3Op<'_> {
    fn name(&self) -> &'static str {
        "conv3x3"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(data) = storage else {
            candle_core::bail!("conv3x3 takes f32 input");
        };
        let Some((a, b)) = layout.contiguous_offsets() else {
            candle_core::bail!("conv3x3 needs a contiguous input");
        };
        let (batch, in_ch, h, w) = layout.shape().dims4()?;
        let d = Dims { batch, in_ch, out_ch: self.out_ch, h, w };
        let mut out = vec![0f32; batch * self.out_ch * h * w];
        if self.gemm {
            run_gemm(self.isa, &data[a..b], d, self.weights, &mut out)?;
        } else {
            run(self.isa, &data[a..b], d, self.weights, &mut out)?;
        }
        Ok((CpuStorage::F32(out), Shape::from((batch, self.out_ch, h, w))))
    }
}

/// How a direct convolution's output is cut into tasks: one output row of one
/// image for a range of channel blocks. Each task copies its three input rows, so
/// the channels are split only when the rows alone are too few to feed every thread.
pub(crate) struct RowTasks {
    h: usize,
    rows: usize,
    blocks: usize,
    chunks: usize,
    per_chunk: usize,
}

impl RowTasks {
    pub(crate) fn new(batch: usize, h: usize, blocks: usize) -> Self {
        let rows = batch * h;
        let want = 4 * rayon::current_num_threads();
        let chunks = want.div_ceil(rows.max(1)).clamp(1, blocks.max(1));
        Self { h, rows, blocks, chunks, per_chunk: blocks.div_ceil(chunks) }
    }

    pub(crate) fn tasks(&self) -> usize {
        self.rows * self.chunks
    }

    /// Task `t`: (image, output row, channel blocks), `None` when its blocks are empty.
    pub(crate) fn task(&self, t: usize) -> Option<(usize, usize, std::ops::Range<usize>)> {
        let (row, chunk) = (t / self.chunks, t % self.chunks);
        let first = chunk * self.per_chunk;
        let last = ((chunk + 1) * self.per_chunk).min(self.blocks);
        (first < last).then_some((row / self.h, row % self.h, first..last))
    }
}

/// Output channel blocks (of OB) per flat task: 48 channels, whose weights for one k
/// panel (PANEL planes x 9 taps: 55 KB of bf16 pairs, 55 KB of f32 at the f32 kernel's
/// 32 channels) stay in L2 while the task's position blocks go by.
const CHUNK: usize = 8;
/// Input planes per k panel of a flat task: channels for the f32 kernel, channel
/// pairs for the bf16 one.
const PANEL: usize = 32;
/// Most position blocks per flat task: bounds its partial sums (QMAX x CHUNK x OB
/// rows of at most 32 floats = 147 KB per thread, L2-resident) whatever the batch.
const QMAX: usize = 24;

thread_local! {
    /// A flat task's partial sums, reused across tasks.
    static SUMS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// How the flat layout's work is cut: a task takes a chunk of CHUNK output channel
/// blocks and a run of position blocks (numbered over all images) and walks the
/// input planes a panel at a time, GotoBLAS-style, with its partial sums in a small
/// per-thread buffer. Small maps with many channels (SD's 1280-channel levels at
/// 16x16 and 8x8) have few positions and a large kernel (59 MB of f32 weights at 1280
/// -> 1280): a task per position block streamed the whole kernel from memory once per
/// block (18 times for a guided 16x16 layer); a run of blocks now reads it once.
pub(crate) struct FlatTasks {
    blocks: usize,
    runs: usize,
    per_run: usize,
    positions: usize,
    chunks: usize,
}

impl FlatTasks {
    pub(crate) fn new(batch: usize, out_ch: usize, f: Flat) -> Self {
        let blocks = out_ch.div_ceil(OB);
        let chunks = blocks.div_ceil(CHUNK);
        let positions = batch * f.blocks;
        // Enough runs that every thread has work when the output is narrow, none longer than QMAX.
        let want = (2 * rayon::current_num_threads()).div_ceil(chunks.max(1));
        let runs = want.max(positions.div_ceil(QMAX)).clamp(1, positions.max(1));
        Self { blocks, runs, per_run: positions.div_ceil(runs), positions, chunks }
    }

    pub(crate) fn tasks(&self) -> usize {
        self.chunks * self.runs
    }

    /// Task `t`: (output channel blocks, position blocks), `None` when either is empty.
    pub(crate) fn task(&self, t: usize) -> Option<(std::ops::Range<usize>, std::ops::Range<usize>)> {
        let (chunk, run) = (t / self.runs, t % self.runs);
        let obs = chunk * CHUNK..((chunk + 1) * CHUNK).min(self.blocks);
        let q = run * self.per_run..((run + 1) * self.per_run).min(self.positions);
        (!obs.is_empty() && !q.is_empty()).then_some((obs, q))
    }
}

/// One k panel of a flat task's product, per kernel (f32 FMAs, bf16 pair dot products).
pub(crate) trait FlatPanel {
    /// Positions per block: two vectors.
    const XB: usize;

    /// Adds input planes `p0..p0 + pc` of position block `blk` of image `n` to output
    /// channel block `ob`'s partial sums at `sums` (OB rows of XB floats), which it
    /// starts from zero when `p0` is 0.
    ///
    /// SAFETY: the CPU has the kernel's features; `sums` points at OB x XB floats;
    /// n, blk, ob and the planes are in range.
    unsafe fn panel(&self, n: usize, blk: usize, ob: usize, p0: usize, pc: usize, sums: *mut f32);
}

/// Runs `f` with this thread's flat-task sum buffer. Borrowed here, in the task's
/// closure, and passed down: a closure inside the kernels' `#[target_feature]` code
/// would not have those features, and its intrinsics would become calls (the f32
/// flat path ran 50x slower that way).
pub(crate) fn with_sums<R>(f: impl FnOnce(&mut Vec<f32>) -> R) -> R {
    SUMS.with(|cell| f(&mut cell.borrow_mut()))
}

/// Runs flat task (`obs`, `q`) of a conv whose input has `planes` planes per image:
/// each panel of planes over every position block x channel block, then the sums of
/// the valid positions into the [b, o, h, w] output. `sums` is the thread's buffer
/// ([`with_sums`]).
///
/// SAFETY: the CPU has `k`'s features; `dst` is the whole output, of which this call
/// writes only the positions of blocks `q` in the channels of `obs`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn flat_task<K: FlatPanel>(
    k: &K,
    d: Dims,
    f: Flat,
    planes: usize,
    obs: std::ops::Range<usize>,
    q: std::ops::Range<usize>,
    sums: &mut Vec<f32>,
    dst: SharedMut,
) {
    let (o, h, w) = (d.out_ch, d.h, d.w);
    let nob = obs.len();
    let row = OB * K::XB;
    if sums.len() < q.len() * nob * row {
        sums.resize(q.len() * nob * row, 0.0);
    }
    let sp = sums.as_mut_ptr();
    let mut p0 = 0;
    while p0 < planes {
        let pc = PANEL.min(planes - p0);
        for (qi, qq) in q.clone().enumerate() {
            for (bi, ob) in obs.clone().enumerate() {
                // SAFETY: block (qi, bi)'s sums lie inside the buffer; the rest is forwarded.
                unsafe { k.panel(qq / f.blocks, qq % f.blocks, ob, p0, pc, sp.add((qi * nob + bi) * row)) };
            }
        }
        p0 += pc;
    }
    for (qi, qq) in q.enumerate() {
        let (n, blk) = (qq / f.blocks, qq % f.blocks);
        for (bi, ob) in obs.clone().enumerate() {
            for j in 0..OB.min(o - ob * OB) {
                // SAFETY: the row's XB sums lie inside the buffer; image n's plane of
                // channel ob * OB + j < o is inside the output.
                unsafe {
                    let src = sp.add((qi * nob + bi) * row + j * K::XB);
                    f.scatter(w, h, src, blk * K::XB, K::XB, dst.get().add((n * o + ob * OB + j) * h * w));
                }
            }
        }
    }
}

/// `out` [b, o, h, w] = conv(`x` [b, c, h, w], `weights` [o, c, 3, 3]), padding 1,
/// by the fastest f32 kernel for the sizes: Winograd on large maps with enough
/// channels ([`super::winograd::choose`]), the GEMM on AVX2's smallest maps
/// ([`gemm_wins`]), else the direct kernel.
pub(crate) fn run_best(isa: Isa, x: &[f32], d: Dims, weights: &[f32], out: &mut [f32]) -> Result<()> {
    use super::winograd::{choose, Choice};
    match choose(d) {
        Choice::F4 => super::winograd43::run(isa, x, d, weights, out, false),
        Choice::F2(_) => super::winograd::run(isa, x, d, weights, out),
        Choice::Direct if gemm_wins(isa, d) => run_gemm(isa, x, d, weights, out),
        Choice::Direct => run(isa, x, d, weights, out),
    }
}

/// Most positions per map (h * w) that [`run_best`] runs by unfolding and the GEMM.
const GEMM_MAX_POSITIONS: usize = 64;

/// Whether [`run_best`] unfolds `d`'s input (9c x hw per image) and runs the GEMM on
/// it: AVX2 maps of at most 8x8 positions. There the flat layout ran SD's 1280-channel
/// 8x8 layers at ~68 GFLOP/s, a third of the core's peak, while the GEMM ran them at
/// 130-140 (Zen 3, `brume bench kernels --only conv3x3_1280_8`, 2 images); at 16x16
/// and 32x32 the direct kernel stayed ahead (0.094-0.097 s against 0.106-0.121 at
/// 16x16). AVX-512's dense flat layout masks the border lanes and ran 8x8 at ~200 on
/// Zen 4, so it keeps it.
fn gemm_wins(isa: Isa, d: Dims) -> bool {
    matches!(isa, Isa::Avx2) && d.h * d.w <= GEMM_MAX_POSITIONS
}

/// [`run_best`]'s GEMM route: per image, the input unfolded into a [c * 9, h * w]
/// patch matrix (zero padding), times the kernel read as [o, c * 9] where it is.
fn run_gemm(isa: Isa, x: &[f32], d: Dims, weights: &[f32], out: &mut [f32]) -> Result<()> {
    require(isa)?;
    if !d.check("conv3x3 (gemm)", x, weights, out)? {
        return Ok(());
    }
    let Dims { batch, in_ch: c, out_ch: o, h, w } = d;
    let (hw, k) = (h * w, c * 9);
    let mut patch = vec![0f32; k * hw];
    for (img, dst) in x.chunks_exact(c * hw).zip(out.chunks_exact_mut(o * hw)).take(batch) {
        super::im2col::im2col(img, c, h, w, 3, 3, 1, 1, 0, h, w, &mut patch);
        super::matmul::gemm(isa, o, hw, k, weights, k, &patch, super::matmul::BLayout::KN { ld: hw }, dst)?;
    }
    Ok(())
}

/// `out` [b, o, h, w] = conv(`x` [b, c, h, w], `weights` [o, c, 3, 3]), padding 1,
/// by the direct kernel.
pub(crate) fn run(isa: Isa, x: &[f32], d: Dims, weights: &[f32], out: &mut [f32]) -> Result<()> {
    require(isa)?;
    if !d.check("conv3x3", x, weights, out)? {
        return Ok(());
    }
    let Dims { batch, in_ch: c, out_ch: _, h, w } = d;
    if let Some(flat) = Flat::plan(batch, c, h, w, 2 * isa.lanes(), dense_flat(isa)) {
        run_flat(isa, x, d, weights, out, flat);
        return Ok(());
    }
    rows(isa, x, d, weights, out, false);
    Ok(())
}

/// As [`run`] on the nearest-neighbour 2x upsampling of `x` ([b, c, h / 2, w / 2] for
/// the output's `d.h` x `d.w`) without forming it: each task fills its zero-bordered
/// input rows from the half-size map, every value twice. A decoder's upsampler feeds
/// its conv a map four times its input (256 MB at the SD VAE's 512 px level), written
/// once and read once; here it never exists. `Ok(false)`, nothing written, where the
/// output's size takes the flat layout: the caller upsamples and runs [`run`].
pub(crate) fn run_upsampled(isa: Isa, x: &[f32], d: Dims, weights: &[f32], out: &mut [f32]) -> Result<bool> {
    require(isa)?;
    d.check_upsampled("conv3x3", x, weights, out)?;
    if !reads_upsampled(isa, d.batch, d.in_ch, d.h, d.w) {
        return Ok(false);
    }
    if super::winograd::choose(d) == super::winograd::Choice::F4 {
        super::winograd43::run(isa, x, d, weights, out, true)?;
        return Ok(true);
    }
    if d.needs_compute(out) {
        // By output phases: 16 products per 2x2 outputs where the doubled map's 3x3 taps make 36.
        if super::conv3x3_upsampled::enabled() && super::conv3x3_upsampled::takes(isa, d) {
            super::conv3x3_upsampled::run(isa, x, d, weights, out);
        } else {
            rows(isa, x, d, weights, out, true);
        }
    }
    Ok(true)
}

/// Whether [`run_upsampled`] reads the half-size map of `batch` upsampled h x w maps
/// of `channels` in place on `isa`: where the output takes the row layout. The layers
/// and the memory estimator ask this too.
pub(crate) fn reads_upsampled(isa: Isa, batch: usize, channels: usize, h: usize, w: usize) -> bool {
    Flat::plan(batch, channels, h, w, 2 * isa.lanes(), dense_flat(isa)).is_none()
}

/// Whether `isa`'s flat path takes the dense layout: AVX-512 masks a load for free;
/// elsewhere a masked load costs more than the border lanes it saves.
fn dense_flat(isa: Isa) -> bool {
    matches!(isa, Isa::Avx512)
}

/// The row layout's tasks over `x`: the input itself, or (`up`) its half-size map.
pub(crate) fn rows(isa: Isa, x: &[f32], d: Dims, weights: &[f32], out: &mut [f32], up: bool) {
    let Dims { batch, in_ch: c, out_ch: o, h, w } = d;
    let split = RowTasks::new(batch, h, o.div_ceil(OB));
    let dst = SharedMut(out.as_mut_ptr());
    let per_image = if up { c * (h / 2) * (w / 2) } else { c * h * w };
    (0..split.tasks()).into_par_iter().for_each(|task| {
        let Some((n, y, blocks)) = split.task(task) else { return };
        let img = Src { data: &x[n * per_image..(n + 1) * per_image], up };
        ROWS.with(|cell| {
            let mut buf = cell.borrow_mut();
            // SAFETY: task (n, y, chunk) writes only output rows y of image n for the
            // channels of `blocks`: disjoint from every other task, inside `out`.
            unsafe {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => row_avx512(img, d, n, y, weights, blocks.clone(), &mut buf, dst),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => row_avx2(img, d, n, y, weights, blocks.clone(), &mut buf, dst),
                    _ => output_row::<Portable, 2, false>(img, d, n, y, weights, blocks.clone(), &mut buf, dst),
                }
            }
        });
    });
}

/// One image's input to the row layout: the map itself, or (`up`) the half-size map
/// whose nearest-neighbour 2x upsampling is the input.
#[derive(Clone, Copy)]
struct Src<'a> {
    data: &'a [f32],
    up: bool,
}

/// The flat layout: copies the input once, zero-bordered, then runs the blocked
/// schedule of [`FlatTasks`].
fn run_flat(isa: Isa, x: &[f32], d: Dims, weights: &[f32], out: &mut [f32], flat: Flat) {
    let Dims { batch, in_ch: c, out_ch: o, h, w } = d;
    let mut padded = vec![0f32; batch * c * flat.plane];
    padded.par_chunks_mut(flat.plane).enumerate().for_each(|(plane, dst)| {
        let src = &x[plane * h * w..(plane + 1) * h * w];
        for (y, row) in src.chunks_exact(w).enumerate() {
            let at = (y + 1) * flat.pitch + 1;
            dst[at..at + w].copy_from_slice(row);
        }
    });
    let tasks = FlatTasks::new(batch, o, flat);
    let dst = SharedMut(out.as_mut_ptr());
    let padded = &padded;
    let masks = &flat.edge_masks(2 * isa.lanes());
    (0..tasks.tasks()).into_par_iter().for_each(|t| {
        let Some((obs, q)) = tasks.task(t) else { return };
        // SAFETY: task t writes only the positions of blocks q for the channels of
        // obs: disjoint from every other task.
        with_sums(|sums| unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => flat_avx512(padded, d, flat, weights, masks, obs, q, sums, dst),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => flat_avx2(padded, d, flat, weights, masks, obs, q, sums, dst),
                _ => flat_task(&FloatPanel::<Portable>::new(padded, d, flat, weights, masks), d, flat, c, obs, q, sums, dst),
            }
        });
    });
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn flat_avx512(img: &[f32], d: Dims, f: Flat, w: &[f32], masks: &[EdgeLanes], obs: std::ops::Range<usize>, q: std::ops::Range<usize>, sums: &mut Vec<f32>, dst: SharedMut) {
    // SAFETY: forwarded from the caller.
    unsafe { flat_task(&FloatPanel::<super::simd::Avx512>::new(img, d, f, w, masks), d, f, d.in_ch, obs, q, sums, dst) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn flat_avx2(img: &[f32], d: Dims, f: Flat, w: &[f32], masks: &[EdgeLanes], obs: std::ops::Range<usize>, q: std::ops::Range<usize>, sums: &mut Vec<f32>, dst: SharedMut) {
    // SAFETY: forwarded from the caller.
    unsafe { flat_task(&FloatPanel::<super::simd::Avx2>::new(img, d, f, w, masks), d, f, d.in_ch, obs, q, sums, dst) }
}

/// The f32 kernel's panel: every image's zero-bordered planes (`img`, c planes of
/// `f.plane` values per image) and the kernel [o, c, 3, 3].
struct FloatPanel<'a, S> {
    img: &'a [f32],
    weights: &'a [f32],
    d: Dims,
    f: Flat,
    masks: &'a [EdgeLanes],
    simd: std::marker::PhantomData<S>,
}

impl<'a, S> FloatPanel<'a, S> {
    fn new(img: &'a [f32], d: Dims, f: Flat, weights: &'a [f32], masks: &'a [EdgeLanes]) -> Self {
        Self { img, weights, d, f, masks, simd: std::marker::PhantomData }
    }
}

impl<S: Simd> FlatPanel for FloatPanel<'_, S> {
    const XB: usize = 2 * S::LANES;

    #[inline(always)]
    unsafe fn panel(&self, n: usize, blk: usize, ob: usize, p0: usize, pc: usize, sums: *mut f32) {
        let (c, o, f) = (self.d.in_ch, self.d.out_ch, self.f);
        // The block's six weight rows from channel p0; past the last output channel,
        // repeat it (computed, not stored).
        let wrows: [*const f32; OB] = std::array::from_fn(|j| {
            let oc = (ob * OB + j).min(o - 1);
            // SAFETY: oc < o and p0 < c: inside `weights` (o * c * 9 long).
            unsafe { self.weights.as_ptr().add((oc * c + p0) * 9) }
        });
        // SAFETY: the caller's contract: `sums` holds OB x XB floats, image n's planes
        // p0..p0 + pc lie in `img`; loads read plane[blk * XB + ky * pitch + kx ..][..XB],
        // inside each plane (blocks * XB + 2 * pitch + 2 long).
        unsafe {
            let mut acc = if p0 > 0 { load_block::<S>(sums, Self::XB, OB, Self::XB) } else { [[S::splat(0.0); 2]; OB] };
            let planes = self.img.as_ptr().add((n * c + p0) * f.plane);
            if f.dense {
                block::<S, 2, _>(&mut acc, planes, f.plane, f.pitch, pc, &wrows, blk * Self::XB, self.masks[blk]);
            } else {
                block::<S, 2, _>(&mut acc, planes, f.plane, f.pitch, pc, &wrows, blk * Self::XB, AllLanes);
            }
            store_block::<S>(&acc, sums, Self::XB, OB, Self::XB);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn row_avx512(img: Src, d: Dims, n: usize, y: usize, w: &[f32], blocks: std::ops::Range<usize>, buf: &mut Vec<f32>, dst: SharedMut) {
    // SAFETY: forwarded from the caller.
    unsafe {
        if d.w.is_multiple_of(WIDE * 16) {
            output_row::<super::simd::Avx512, WIDE, false>(img, d, n, y, w, blocks, buf, dst)
        } else {
            output_row::<super::simd::Avx512, 2, false>(img, d, n, y, w, blocks, buf, dst)
        }
    }
}

/// Vectors of output pixels per register block on AVX-512 rows whose width they divide
/// (SD's 64-wide level, the VAE's 128-512): 6 channels x 4 vectors hold 24 of the 32
/// registers, and each tap feeds 24 FMAs from 4 loads and 6 broadcasts where 6 x 2 fed
/// 12 from 2 and 6 (the GEMM's same change: `matmul::WIDE`).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const WIDE: usize = 4;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_avx2(img: Src, d: Dims, n: usize, y: usize, w: &[f32], blocks: std::ops::Range<usize>, buf: &mut Vec<f32>, dst: SharedMut) {
    // SAFETY: forwarded from the caller.
    unsafe { output_row::<super::simd::Avx2, 2, true>(img, d, n, y, w, blocks, buf, dst) }
}

/// Output row `y` of image `n` (its input: `img`) for the channel blocks `blocks`.
///
/// The input rows y - 1..=y + 1 of every channel are copied zero-bordered into
/// scratch, as tiles: `TILED` cuts them into one tile per register block of output
/// columns (the block's NV * LANES columns and the two beside them, 12 % more than the
/// rows), else one tile holds whole rows. A block then reads its tile front to back:
/// c x 3 short rows in one run of memory. Across whole rows the same block reads 3c
/// places a row's length apart, 192 lines at 64 channels, which at a 512-wide row
/// (2 KB) fall into few of L1's sets and outrun the prefetchers. Tiles measured on
/// AVX2 (Zen 3; `brume bench kernels --only conv3x3_64`, alternated): 640->640 at
/// 64x64 1.35-1.5x faster, 64->64 at 512x512 1.1-1.4x (the whole rows' times swung
/// more); AVX-512 keeps whole rows, as it was measured there (untested tiled).
///
/// SAFETY: the CPU has `S`'s features; `dst` points at the whole [b, o, h, w] output
/// of which this call writes only row `y` of image `img`'s channels in `blocks`.
#[inline(always)]
unsafe fn output_row<S: Simd, const NV: usize, const TILED: bool>(
    img: Src,
    d: Dims,
    n: usize,
    y: usize,
    weights: &[f32],
    blocks: std::ops::Range<usize>,
    buf: &mut Vec<f32>,
    dst: SharedMut,
) {
    let (c, o, h, w) = (d.in_ch, d.out_ch, d.h, d.w);
    let xb = NV * S::LANES;
    let wpad = w.div_ceil(xb) * xb;
    // Padded column i is input column i - 1 (zero outside [1, w]). Tile t holds padded
    // columns [t * span, t * span + tw) of rows ky = 0..3 of every channel ci, row
    // (ci * 3 + ky) of the tile: wide enough for the shifted loads of its blocks.
    let span = if TILED { xb } else { wpad };
    let tw = span + 2;
    let tile = c * 3 * tw;
    let need = wpad / span * tile;
    // Tiled, one padded row (wpad + 2) is staged after the tiles, then cut into them;
    // whole rows are written in place.
    let stage = if TILED { wpad + 2 } else { 0 };
    if buf.len() < need + stage {
        buf.resize(need + stage, 0.0);
    }
    let (tiles, staged) = buf.split_at_mut(need);
    for ci in 0..c {
        for ky in 0..3 {
            let iy = y as isize + ky as isize - 1;
            let row = (ci * 3 + ky) * tw;
            let r = if TILED { &mut staged[..stage] } else { &mut tiles[row..row + tw] };
            if iy < 0 || iy >= h as isize {
                r.fill(0.0);
            } else {
                pad_row(img, ci, iy as usize, h, w, r);
            }
            if TILED {
                for (t, dst) in tiles.chunks_exact_mut(tile).enumerate() {
                    dst[row..row + tw].copy_from_slice(&staged[t * span..t * span + tw]);
                }
            }
        }
    }
    let out_img = dst.get();
    let base = tiles.as_ptr();
    for blk in blocks {
        // The block's six weight rows; past the last channel, repeat it (computed, not stored).
        let wrows: [*const f32; OB] = std::array::from_fn(|j| {
            let oc = (blk * OB + j).min(o - 1);
            // SAFETY: oc < o, so the row lies inside `weights` (o * c * 9 long).
            unsafe { weights.as_ptr().add(oc * c * 9) }
        });
        let mut x0 = 0;
        while x0 < w {
            let mut acc = [[S::splat(0.0); NV]; OB];
            // SAFETY: every load reads tile x0 / span's row ci * 3 + ky at columns
            // x0 % span + kx .. + NV * LANES: inside it (x0 % span + NV * LANES <= span,
            // kx <= 2, rows tw = span + 2 wide), and the tile inside `tiles`.
            unsafe { block::<S, NV, _>(&mut acc, base.add(x0 / span * tile), 3 * tw, tw, c, &wrows, x0 % span, AllLanes) };
            let count = xb.min(w - x0);
            // The block's channels are planes h * w apart in the output.
            // SAFETY: image n, channels blk * OB.. < o, row y < h, columns x0..x0 + count
            // <= w: inside the [b, o, h, w] output.
            unsafe {
                let at = out_img.add(((n * o + blk * OB) * h + y) * w + x0);
                store_wide::<S, NV>(&acc, at, h * w, OB.min(o - blk * OB), count);
            }
            x0 += xb;
        }
    }
}

/// Writes input row `iy` of channel `ci` into `r` zero-bordered: input column x at
/// r[x + 1], zeros at 0 and from w + 1 on.
fn pad_row(img: Src, ci: usize, iy: usize, h: usize, w: usize, r: &mut [f32]) {
    r[0] = 0.0;
    if img.up {
        let (hs, ws) = (h / 2, w / 2);
        let at = (ci * hs + iy / 2) * ws;
        for (pair, &v) in r[1..=w].chunks_exact_mut(2).zip(&img.data[at..at + ws]) {
            pair[0] = v;
            pair[1] = v;
        }
    } else {
        let at = (ci * h + iy) * w;
        r[1..=w].copy_from_slice(&img.data[at..at + w]);
    }
    r[w + 1..].fill(0.0);
}

/// Adds to `acc` six output channels x NV vectors of output pixels starting at `x0`,
/// summed over `c` input channels: channel ci's tap row ky starts `ci * chan + ky *
/// pitch` values into `rows`, its weights at `wrows[j] + ci * 9`. Each tap's loads
/// read the lanes `taps` says (a dense flat layout's border columns read zero).
///
/// SAFETY: the CPU has `S`'s features; for every ci < c and ky < 3, `rows` holds
/// `NV * LANES + 2` floats from `ci * chan + ky * pitch + x0` (those of the lanes
/// `taps` loads); each `wrows[j]` points at `c * 9` floats.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn block<S: Simd, const NV: usize, T: TapLanes>(
    acc: &mut [[S::V; NV]; OB],
    rows: *const f32,
    chan: usize,
    pitch: usize,
    c: usize,
    wrows: &[*const f32; OB],
    x0: usize,
    taps: T,
) {
    unsafe {
        let mut r = *acc;
        for ci in 0..c {
            let base = rows.add(ci * chan + x0);
            for ky in 0..3 {
                let row = base.add(ky * pitch);
                for kx in 0..3 {
                    let xs: [S::V; NV] = std::array::from_fn(|v| {
                        let p = row.add(kx + v * S::LANES);
                        if T::ALL {
                            S::load(p)
                        } else {
                            S::load_lanes(p, taps.lanes(kx, v * S::LANES))
                        }
                    });
                    let tap = ci * 9 + ky * 3 + kx;
                    for j in 0..OB {
                        let wv = S::splat(*wrows[j].add(tap));
                        for v in 0..NV {
                            r[j][v] = S::fmadd(xs[v], wv, r[j][v]);
                        }
                    }
                }
            }
        }
        *acc = r;
    }
}

#[cfg(test)]
mod tests {
    use super::{EdgeLanes, Flat};

    #[test]
    fn dense_layout_masks_exactly_the_border_columns() {
        for (h, w) in [(8, 8), (16, 16), (5, 7), (3, 1), (2, 33)] {
            let f = Flat::dense(h, w, 32);
            assert_eq!(f.pitch, w);
            assert!(f.blocks * 32 >= h * w && (f.blocks - 1) * 32 < h * w);
            // The farthest tap of the last lane stays inside the plane.
            assert!((f.blocks * 32 - 1) + 2 * f.pitch + 2 < f.plane);
            for (blk, &EdgeLanes(m)) in f.edge_masks(32).iter().enumerate() {
                for i in 0..32 {
                    let x = (blk * 32 + i) % w;
                    assert_eq!(m[0] >> i & 1 == 1, x != 0, "{h}x{w} block {blk} lane {i}: kx = 0");
                    assert_eq!(m[1] >> i & 1 == 1, x != w - 1, "{h}x{w} block {blk} lane {i}: kx = 2");
                }
                assert_eq!(m[0] >> 32, 0);
            }
        }
        // A bordered layout reads its own zero columns: every lane loads.
        let f = Flat::new(8, 8, 32);
        assert!(f.edge_masks(32).iter().all(|EdgeLanes(m)| m[0] & 0xFFFF_FFFF == 0xFFFF_FFFF && m[1] & 0xFFFF_FFFF == 0xFFFF_FFFF));
    }
}
