//! f32 matrix product for the layers' shapes: linear layers (`x W^T`) and 1x1
//! convolutions (`W x`), the other half of a UNet's FLOPs after the 3x3 convs.
//!
//! A block of 6 rows of A x 4 vectors of columns of B (2 for AVX2, the portable
//! path and short products, see `SHORT_M`) stays in registers for a chunk of the
//! reduction: per step, four loads of B and six broadcasts of A feed 24 FMAs, the
//! same arithmetic-bound inner loop as the direct 3x3 conv. B is read through a
//! per-thread panel (its k x NV-vector column strips, packed contiguously and
//! zero-padded past n), which serves both of B's layouts — [k, n] for a conv's
//! activations (a copy), [n, k] for a linear layer's weight as stored (a transpose,
//! in 16 x 16 register tiles on AVX-512). Nothing the size of a weight is copied, so
//! a mapped or expanded weight is used where it lies and private memory does not grow.

use std::cell::RefCell;

use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::simd::{Portable, Simd};
use super::{isa, require, Isa, SharedMut};

/// Rows of A per register block (the bf16 GEMM's too).
pub(super) const MR: usize = 6;

thread_local! {
    static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// How B is laid out in memory.
#[derive(Debug, Clone, Copy)]
pub(crate) enum BLayout {
    /// B[kk][j] at `kk * ld + j` (a conv's [c, h * w] activations).
    KN { ld: usize },
    /// B[kk][j] at `j * ld + kk`: B is the transpose of an [n, k] matrix (a linear
    /// layer's [out, in] weight).
    NK { ld: usize },
}

/// Checks a product's buffers against its sizes; `Ok(false)` when nothing is left
/// to compute (an empty output, or k = 0, which zeroes it).
#[allow(clippy::too_many_arguments)]
pub(crate) fn check(m: usize, n: usize, k: usize, a: &[f32], lda: usize, b: &[f32], bl: BLayout, dst: &mut [f32]) -> Result<bool> {
    if dst.len() < m * n {
        candle_core::bail!("gemm: output of {} for {m}x{n}", dst.len());
    }
    if m == 0 || n == 0 {
        return Ok(false);
    }
    if k == 0 {
        dst[..m * n].fill(0.0);
        return Ok(false);
    }
    if !a_fits(a, m, k, lda) {
        candle_core::bail!("gemm: A of {} values is too short for {m}x{k} (row stride {lda})", a.len());
    }
    if !b_fits(b, k, n, bl) {
        candle_core::bail!("gemm: B of {} values is too short for {k}x{n} ({bl:?})", b.len());
    }
    Ok(true)
}

/// Whether `a` holds an m x k matrix with rows `lda` apart (an empty one always fits).
pub(crate) fn a_fits(a: &[f32], m: usize, k: usize, lda: usize) -> bool {
    m == 0 || k == 0 || (lda >= k && a.len() >= (m - 1) * lda + k)
}

/// Whether `b` holds a k x n matrix laid out as `bl` says (an empty one always fits).
pub(crate) fn b_fits(b: &[f32], k: usize, n: usize, bl: BLayout) -> bool {
    k == 0
        || n == 0
        || match bl {
            BLayout::KN { ld } => ld >= n && b.len() >= (k - 1) * ld + n,
            BLayout::NK { ld } => ld >= k && b.len() >= (n - 1) * ld + k,
        }
}

/// How an m x n output is cut into tasks of `mc` rows x `per` column blocks of `nr`.
///
/// Columns are split first: each task packs its panels of B once and runs all of its
/// rows of A past them, so B is repacked only as often as the rows are split
/// (packing a linear weight's [n, k] strip is a transpose, ~15% of the work when it
/// was repeated for every 200 rows). Rows are split only to feed every thread.
pub(crate) struct Split {
    m: usize,
    n: usize,
    nr: usize,
    mc: usize,
    per: usize,
    n_tasks: usize,
    m_tasks: usize,
}

impl Split {
    pub(crate) fn new(m: usize, n: usize, nr: usize) -> Self {
        let want = 8 * rayon::current_num_threads();
        let n_blocks = n.div_ceil(nr);
        let n_tasks = n_blocks.min(want);
        let m_tasks = want.div_ceil(n_tasks).min(m.div_ceil(MR));
        let mc = m.div_ceil(m_tasks).div_ceil(MR) * MR;
        let per = n_blocks.div_ceil(n_tasks);
        Self { m, n, nr, mc, per, n_tasks: n_blocks.div_ceil(per), m_tasks: m.div_ceil(mc) }
    }

    pub(crate) fn tasks(&self) -> usize {
        self.m_tasks * self.n_tasks
    }

    /// Task `t`'s rows and columns (the columns may be empty for a trailing task).
    pub(crate) fn task(&self, t: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (mt, nt) = (t / self.n_tasks, t % self.n_tasks);
        let rows = mt * self.mc..((mt + 1) * self.mc).min(self.m);
        let span = self.per * self.nr;
        (rows, (nt * span).min(self.n)..((nt + 1) * span).min(self.n))
    }
}

/// `dst[i][j] = sum_kk a[i * lda + kk] * B[kk][j]` for i < m, j < n (dst row stride n).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(isa: Isa, m: usize, n: usize, k: usize, a: &[f32], lda: usize, b: &[f32], bl: BLayout, dst: &mut [f32]) -> Result<()> {
    require(isa)?;
    if !check(m, n, k, a, lda, b, bl, dst)? {
        return Ok(());
    }
    // Short products take the narrow block and small strips (see SHORT_M).
    let short = m <= SHORT_M;
    #[cfg(target_arch = "x86_64")]
    if let (Isa::Avx2, true, BLayout::NK { ld }) = (isa, weight_rows_win(m, n), bl) {
        // SAFETY: `require` found AVX2 and FMA; `check` the buffers' sizes; m <= WEIGHT_ROWS_MAX_M.
        unsafe { by_weight_rows_avx2(m, n, k, a, lda, b, ld, dst) };
        return Ok(());
    }
    let panel_bytes = if short { SHORT_PANEL_BYTES } else { PANEL_BYTES };
    let nr = match isa {
        Isa::Avx512 if !short => WIDE * 16,
        _ => 2 * isa.lanes(),
    };
    let split = Split::new(m, n, nr);
    let out = SharedMut(dst.as_mut_ptr());
    (0..split.tasks()).into_par_iter().for_each(|t| {
        let (rows, cols) = split.task(t);
        if cols.is_empty() {
            return;
        }
        let p = Problem { m, n, k, a, lda, b, bl };
        PANEL.with(|cell| {
            let mut panel = cell.borrow_mut();
            // SAFETY: the task writes only dst rows `rows` x columns `cols`, disjoint
            // from every other task's and inside dst (m x n, checked above).
            unsafe {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 if !short => task_avx512::<WIDE>(&p, panel_bytes, rows, cols, &mut panel, out),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => task_avx512::<2>(&p, panel_bytes, rows, cols, &mut panel, out),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => task_avx2(&p, panel_bytes, rows, cols, &mut panel, out),
                    _ => task::<Portable, 2>(&p, panel_bytes, rows, cols, &mut panel, out),
                }
            }
        });
    });
    Ok(())
}

/// A product of few rows (the text encoder's 77 or 154 tokens, SD's 16x16 level's
/// 256: [`weight_rows_win`]) by a linear layer's weight as stored, W [n, k], on AVX2:
/// the product is formed transposed, with W's rows as the broadcast side (six at a
/// time, read in place) and A packed into strips of 16 tokens. The general path packs
/// B, so it transposed the whole weight into strips on every call, where each weight
/// value is then used only m times; packing A moves m x k values, not n x k (a
/// per-call buffer of at most 256 x k floats, 5 MiB at k = 5120, beside an input of
/// that size). Every output still sums its k terms one at a time from k = 0 (`fma(w,
/// x, acc)` is `fma(x, w, acc)` to the bit), so its values are the general path's and
/// a row's result does not depend on the rows beside it.
///
/// SAFETY: the CPU has AVX2 and FMA; the sizes passed `check`; `m <= WEIGHT_ROWS_MAX_M`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn by_weight_rows_avx2(m: usize, n: usize, k: usize, a: &[f32], lda: usize, w: &[f32], ldw: usize, dst: &mut [f32]) {
    let t = TOKENS;
    let strips = m.div_ceil(t);
    assert!(strips <= MAX_TOKEN_STRIPS, "by_weight_rows: {m} rows");
    // A^T in strips: packed[s][kk][tt] = a[s * t + tt][kk], zeros past m.
    let mut packed = vec![0f32; strips * k * t];
    packed.par_chunks_mut(k * t).enumerate().for_each(|(s, strip)| {
        let rows = t.min(m - s * t);
        assert!((s * t + rows - 1) * lda + k <= a.len());
        // SAFETY: the CPU has AVX2 (the caller's); rows s*t.. of A (k floats, lda
        // apart) lie in `a` (asserted); the strip holds k rows of t >= rows floats.
        unsafe { transpose_avx2(a.as_ptr().add(s * t * lda), lda, rows, k, strip.as_mut_ptr(), t) };
    });
    let blocks = n.div_ceil(MR);
    let per = blocks.div_ceil(blocks.min(8 * rayon::current_num_threads()));
    let out = SharedMut(dst.as_mut_ptr());
    let packed = &packed;
    (0..blocks.div_ceil(per)).into_par_iter().for_each(|task| {
        let blks = task * per..((task + 1) * per).min(blocks);
        // SAFETY: the CPU has AVX2 and FMA; the task writes only the columns of its
        // blocks of weight rows, disjoint from every other task's; sizes checked above.
        unsafe { weight_rows_task_avx2(m, n, k, packed, strips, w, ldw, blks, out) }
    });
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose_avx2(src: *const f32, ld: usize, rows: usize, cols: usize, dst: *mut f32, ldd: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { <super::simd::Avx2 as Simd>::transpose(src, ld, rows, cols, dst, ldd) }
}

/// Tokens per packed strip of A in [`by_weight_rows_avx2`]: two AVX2 vectors.
#[cfg(target_arch = "x86_64")]
const TOKENS: usize = 16;
/// Most rows of A [`by_weight_rows_avx2`] takes: SD's 16x16 level unguided (256
/// tokens). Products with cold weights (`cargo run --release -p brume --example
/// cold_linear -- M K N 8 6`, eight weights cycled so none stays in L3; Zen 3, three
/// alternations, medians in GFLOP/s, general path / this one): 256 x 1280 -> 1280
/// 137 / 150, -> 10240 151 / 154, 256 x 5120 -> 1280 140 / 153; at 512 rows it lost
/// (512 x 1280 -> 1280 154 / 144, also with shorter passes over k), its packed A
/// then outgrowing L2.
#[cfg(target_arch = "x86_64")]
const WEIGHT_ROWS_MAX_M: usize = 256;
/// Most strips of A [`by_weight_rows_avx2`] holds partial sums for.
#[cfg(target_arch = "x86_64")]
const MAX_TOKEN_STRIPS: usize = WEIGHT_ROWS_MAX_M.div_ceil(TOKENS);

/// Whether an m x n product by a linear weight takes [`by_weight_rows_avx2`]: it packs
/// A (m x k values) where the general path packs the weight (n x k), so it wins where
/// A is the smaller one, up to [`WEIGHT_ROWS_MAX_M`] rows.
#[cfg(target_arch = "x86_64")]
fn weight_rows_win(m: usize, n: usize) -> bool {
    m <= SHORT_M || (m <= WEIGHT_ROWS_MAX_M && m < n)
}

/// Values of k per pass in [`by_weight_rows_avx2`]: six weight rows of this many
/// floats (6 KiB) stay in L1 while every strip of A (16 KiB each) goes by from L2.
#[cfg(target_arch = "x86_64")]
const KC_ROWS: usize = 256;

/// One task of [`by_weight_rows_avx2`]: weight rows `blks` (blocks of MR) against
/// every strip of the packed A, written transposed into the m x n output.
///
/// SAFETY: the CPU has AVX2 and FMA; `packed` holds `strips` strips of k x TOKENS
/// floats; W's rows are k floats `ldw` apart; `out` is the m x n output, of which
/// only the columns of `blks` are written here.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn weight_rows_task_avx2(m: usize, n: usize, k: usize, packed: &[f32], strips: usize, w: &[f32], ldw: usize, blks: std::ops::Range<usize>, out: SharedMut) {
    type S = super::simd::Avx2;
    const NV: usize = TOKENS / 8;
    // Partial sums of one block of weight rows against every strip, between passes over k.
    let mut sums = [[[0f32; TOKENS]; MR]; MAX_TOKEN_STRIPS];
    for blk in blks {
        let j0 = blk * MR;
        let live = MR.min(n - j0);
        let mut k0 = 0;
        while k0 < k {
            let kc = KC_ROWS.min(k - k0);
            // Rows past n repeat the last one; their sums are dropped.
            // SAFETY: row min(j0 + i, n - 1) of W, k floats from its start, lies in `w`.
            let rows: [*const f32; MR] = std::array::from_fn(|i| unsafe { w.as_ptr().add((j0 + i).min(n - 1) * ldw + k0) });
            for (s, sum) in sums.iter_mut().enumerate().take(strips) {
                // SAFETY: the strip holds kc rows of TOKENS floats from k0; each row pointer kc floats.
                unsafe {
                    let mut acc = if k0 == 0 {
                        [[S::splat(0.0); NV]; MR]
                    } else {
                        std::array::from_fn(|i| std::array::from_fn(|v| S::load(sum[i].as_ptr().add(v * 8))))
                    };
                    block::<S, NV>(&mut acc, &rows, packed.as_ptr().add((s * k + k0) * TOKENS), kc);
                    for (i, r) in acc.iter().enumerate() {
                        for (v, &x) in r.iter().enumerate() {
                            S::store(sum[i].as_mut_ptr().add(v * 8), x);
                        }
                    }
                }
            }
            k0 += kc;
        }
        for (s, sum) in sums.iter().enumerate().take(strips) {
            for tt in 0..TOKENS.min(m - s * TOKENS) {
                let row = s * TOKENS + tt;
                for (i, w_row) in sum.iter().enumerate().take(live) {
                    // SAFETY: row < m and column j0 + i < n lie in the output; this task
                    // alone writes the columns of its blocks.
                    unsafe { *out.get().add(row * n + j0 + i) = w_row[tt] };
                }
            }
        }
    }
}

struct Problem<'a> {
    m: usize,
    n: usize,
    k: usize,
    a: &'a [f32],
    lda: usize,
    b: &'a [f32],
    bl: BLayout,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn task_avx512<const NV: usize>(p: &Problem, panel_bytes: usize, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>, panel: &mut Vec<f32>, out: SharedMut) {
    // SAFETY: forwarded from the caller.
    unsafe { task::<super::simd::Avx512, NV>(p, panel_bytes, rows, cols, panel, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn task_avx2(p: &Problem, panel_bytes: usize, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>, panel: &mut Vec<f32>, out: SharedMut) {
    // SAFETY: forwarded from the caller.
    unsafe { task::<super::simd::Avx2, 2>(p, panel_bytes, rows, cols, panel, out) }
}

/// Most bytes of one packed strip of B (KC x NV vectors): up to k = 1280 with 4
/// vectors, the whole reduction in one chunk. Every chunk after the first reloads
/// and stores the task's output blocks, and at 16 KiB (k in chunks of 64) a linear
/// layer's 4096 x 2560 output (42 MB) went through memory five times per call; the
/// strip instead streams from L2 (4 vectors per 24 FMAs). Alternated in one process
/// on the Intel Xeon host, 7 SD 1.5 layer shapes, medians of 21, twice: 320 KiB was
/// 1.00-1.32x the GFLOP/s of 16 KiB (64 KiB in between).
const PANEL_BYTES: usize = 320 * 1024;
/// Most rows of A that take 2-vector blocks and 16 KiB strips instead. Every task
/// packs its strips of B per call (for a linear layer, a transpose of its weight),
/// which a short A cannot repay over wide, deep strips: with them the text encoder's
/// 77-token products ran slower (bench speed text-sd15, f32: 0.21-0.23 -> 0.28-0.31 s).
/// Either way every output sums its k terms in the same order, so a product's rows
/// do not depend on how many rows it has (a guided batch of 2 and its branches one at
/// a time give the same picture).
const SHORT_M: usize = 192;
const SHORT_PANEL_BYTES: usize = 16 * 1024;
/// Vectors of B's columns per register block with AVX-512: 6 rows x 4 vectors hold 24
/// of its 32 registers, and each step of k feeds 24 FMAs from 4 loads and 6
/// broadcasts where 6 x 2 fed 12 from 2 and 6. Alternated in one process on the
/// Intel Xeon host (2026-12-03), 7 layer shapes (1x1 convs 320-960 channels at
/// 384-4096 positions, linear layers 4096 x 320-1280 -> 320-2560), medians of 25: 4
/// vectors ran 0.81-0.97x the time of 2 on six, 1.05x on one.
const WIDE: usize = 4;
/// Rows of A per chunk, reused from L1/L2 by every strip of the task (48 rows x 320
/// values = 60 KB).
const MC: usize = 8 * MR;

/// One task: rows x cols of the output, GotoBLAS-style. For each chunk of k (an even
/// split into at most KC values), the task's strips of B are packed, then its rows
/// are taken MC at a time and each row chunk runs against every strip (the partial
/// sums of one k chunk are picked up by the next from `out`). A row chunk stays in
/// L1/L2 while the strips go by; walking all rows per strip instead re-read A from
/// L3 for every strip of columns.
///
/// SAFETY: the CPU has `S`'s features; `out` points at the m x n output, of which
/// this call writes only `rows` x `cols`; the slices in `p` were bounds-checked.
#[inline(always)]
unsafe fn task<S: Simd, const NV: usize>(p: &Problem, panel_bytes: usize, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>, panel: &mut Vec<f32>, out: SharedMut) {
    let nr = NV * S::LANES;
    let k = p.k;
    let chunks = k.div_ceil(panel_bytes / 4 / nr);
    let kc_max = k.div_ceil(chunks);
    let strips = cols.len().div_ceil(nr);
    if panel.len() < strips * kc_max * nr {
        panel.resize(strips * kc_max * nr, 0.0);
    }
    let mut k0 = 0;
    while k0 < k {
        let kc = kc_max.min(k - k0);
        for s in 0..strips {
            let j0 = cols.start + s * nr;
            let w = nr.min(p.n - j0);
            let panel = &mut panel[s * kc * nr..(s + 1) * kc * nr];
            // Pack B[k0..k0 + kc][j0..j0 + w] into panel[kk * nr + j], zeros past w.
            // A [k, n] B is packed too: in place its rows lie a power of two apart
            // (h * w floats), all in the same few L1 sets, evicting each other.
            match p.bl {
                BLayout::KN { ld } => {
                    for kk in 0..kc {
                        let at = (k0 + kk) * ld + j0;
                        let dst = &mut panel[kk * nr..(kk + 1) * nr];
                        dst[..w].copy_from_slice(&p.b[at..at + w]);
                        dst[w..].fill(0.0);
                    }
                }
                BLayout::NK { ld } => {
                    if w < nr {
                        panel.fill(0.0);
                    }
                    // B's rows j0.. of [n, k] (w of them, kc values each from k0)
                    // become the strip's columns.
                    let last = (j0 + w - 1) * ld + k0 + kc;
                    assert!(last <= p.b.len() && panel.len() >= kc * nr);
                    // SAFETY: the source rows end at `last` <= b.len() and the strip
                    // holds kc rows of nr >= w floats (both asserted); they are distinct buffers.
                    unsafe { S::transpose(p.b.as_ptr().add(j0 * ld + k0), ld, w, kc, panel.as_mut_ptr(), nr) };
                }
            }
        }
        let mut ic = rows.start;
        while ic < rows.end {
            let chunk_end = (ic + MC).min(rows.end);
            for s in 0..strips {
                let j0 = cols.start + s * nr;
                let w = nr.min(p.n - j0);
                let strip = panel[s * kc * nr..].as_ptr();
                let mut i0 = ic;
                while i0 < chunk_end {
                    let arows: [*const f32; MR] = std::array::from_fn(|i| {
                        let r = (i0 + i).min(p.m - 1);
                        // SAFETY: r < m, and row r of A (lda apart, k long) was bounds-checked; k0 < k.
                        unsafe { p.a.as_ptr().add(r * p.lda + k0) }
                    });
                    let live = MR.min(chunk_end - i0);
                    // SAFETY: rows i0..i0 + live < m and columns j0..j0 + w <= n lie in the output.
                    let at = unsafe { out.get().add(i0 * p.n + j0) };
                    // SAFETY: as above; the strip holds kc rows of NV vectors, each A row pointer kc floats.
                    unsafe {
                        let mut acc = if k0 > 0 { load_wide::<S, NV>(at, p.n, live, w) } else { [[S::splat(0.0); NV]; MR] };
                        block::<S, NV>(&mut acc, &arows, strip, kc);
                        store_wide::<S, NV>(&acc, at, p.n, live, w);
                    }
                    i0 += MR;
                }
            }
            ic = chunk_end;
        }
        k0 += kc;
    }
}

/// The partial sums of an output block: `live` rows of `w` (<= 2 vectors) floats
/// from `at`, rows `ld` apart; a short row goes through a zero-padded copy.
///
/// SAFETY: the CPU has `S`'s features; those rows and columns lie in the output.
#[inline(always)]
pub(super) unsafe fn load_block<S: Simd>(at: *const f32, ld: usize, live: usize, w: usize) -> [[S::V; 2]; MR] {
    // SAFETY: forwarded from the caller.
    unsafe { load_wide::<S, 2>(at, ld, live, w) }
}

/// [`load_block`] for blocks of NV vectors (NV * LANES <= 64).
#[inline(always)]
pub(super) unsafe fn load_wide<S: Simd, const NV: usize>(at: *const f32, ld: usize, live: usize, w: usize) -> [[S::V; NV]; MR] {
    unsafe {
        let mut acc = [[S::splat(0.0); NV]; MR];
        for (i, a) in acc.iter_mut().enumerate().take(live) {
            let row = at.add(i * ld);
            if w == NV * S::LANES {
                *a = std::array::from_fn(|v| S::load(row.add(v * S::LANES)));
            } else {
                let mut tail = [0f32; 64];
                std::ptr::copy_nonoverlapping(row, tail.as_mut_ptr(), w);
                *a = std::array::from_fn(|v| S::load(tail.as_ptr().add(v * S::LANES)));
            }
        }
        acc
    }
}

/// Writes an output block back: `live` rows of `w` (<= 2 vectors) floats to `at`,
/// rows `ld` apart; a short row through a copy.
///
/// SAFETY: the CPU has `S`'s features; those rows and columns lie in the output.
#[inline(always)]
pub(super) unsafe fn store_block<S: Simd>(acc: &[[S::V; 2]; MR], at: *mut f32, ld: usize, live: usize, w: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { store_wide::<S, 2>(acc, at, ld, live, w) }
}

/// [`store_block`] for blocks of NV vectors (NV * LANES <= 64).
#[inline(always)]
pub(super) unsafe fn store_wide<S: Simd, const NV: usize>(acc: &[[S::V; NV]; MR], at: *mut f32, ld: usize, live: usize, w: usize) {
    unsafe {
        for (i, a) in acc.iter().enumerate().take(live) {
            let row = at.add(i * ld);
            if w == NV * S::LANES {
                for (v, &x) in a.iter().enumerate() {
                    S::store(row.add(v * S::LANES), x);
                }
            } else {
                let mut tail = [0f32; 64];
                for (v, &x) in a.iter().enumerate() {
                    S::store(tail.as_mut_ptr().add(v * S::LANES), x);
                }
                std::ptr::copy_nonoverlapping(tail.as_ptr(), row, w);
            }
        }
    }
}

/// Adds MR rows x NV vectors of the product over `kc` values of k to `acc`.
///
/// SAFETY: the CPU has `S`'s features; each `a[i]` points at kc floats and `b` at
/// kc rows of NV * LANES floats.
#[inline(always)]
pub(super) unsafe fn block<S: Simd, const NV: usize>(acc: &mut [[S::V; NV]; MR], a: &[*const f32; MR], b: *const f32, kc: usize) {
    unsafe {
        let mut r = *acc;
        for kk in 0..kc {
            let bv: [S::V; NV] = std::array::from_fn(|v| S::load(b.add((kk * NV + v) * S::LANES)));
            for i in 0..MR {
                let av = S::splat(*a[i].add(kk));
                for v in 0..NV {
                    r[i][v] = S::fmadd(av, bv[v], r[i][v]);
                }
            }
        }
        *acc = r;
    }
}

fn f32_contiguous<'a>(t: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(d) = t else {
        candle_core::bail!("matmul kernel: {what} must be f32");
    };
    match l.contiguous_offsets() {
        Some((s, e)) => Ok(&d[s..e]),
        None => candle_core::bail!("matmul kernel: {what} must be contiguous"),
    }
}

/// `a [m, k] x w^T` with `w [n, k]` (a linear layer), on `isa`; for tests and benches.
pub fn linear_on(isa: Isa, a: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (m, k) = a.dims2()?;
    let (n, wk) = w.dims2()?;
    if wk != k {
        candle_core::bail!("linear kernel: input width {k}, weight {:?}", w.dims());
    }
    let (a, w) = (a.contiguous()?, w.contiguous()?);
    let (sa, la) = a.storage_and_layout();
    let (sw, lw) = w.storage_and_layout();
    let (candle_core::Storage::Cpu(ca), candle_core::Storage::Cpu(cw)) = (&*sa, &*sw) else {
        candle_core::bail!("linear kernel: CPU tensors only");
    };
    let (ad, wd) = (f32_contiguous(ca, la, "input")?, f32_contiguous(cw, lw, "weight")?);
    let mut out = vec![0f32; m * n];
    gemm(isa, m, n, k, ad, k, wd, BLayout::NK { ld: k }, &mut out)?;
    drop((sa, sw));
    Tensor::from_vec(out, Shape::from((m, n)), a.device())
}

/// As [`linear_on`] on this CPU's widest instruction set.
pub fn linear(a: &Tensor, w: &Tensor) -> Result<Tensor> {
    linear_on(isa(), a, w)
}
