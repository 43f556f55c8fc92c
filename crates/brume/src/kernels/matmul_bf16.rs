//! The layers' matrix product with bf16 products and f32 sums (AVX512-BF16).
//!
//! [`super::matmul`]'s block (6 rows of A x 4 vectors of B's columns in registers,
//! 2 for short products) with `vdpbf16ps`: pairs run along k, so A is rounded into a table of (A[i][2p],
//! A[i][2p + 1]) words — adjacent values, half A's f32 size — and B into panels of
//! pairs (B[2p][j], B[2p + 1][j]) per column. A weight on either side can be rounded
//! once and kept by its layer ([`PackedPairRows`] for a 1x1 conv's kernel,
//! [`PackedStrips`] for a linear layer's); activations are rounded per call. Sums
//! are f32; the error is bf16's rounding of the two factors, as in
//! [`super::conv3x3_bf16`].

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::cell::RefCell;

use candle_core::Result;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::bf16::{pack_pairs, round_into};
#[cfg(target_arch = "x86_64")]
use super::matmul::{load_wide, store_wide};
#[cfg(target_arch = "x86_64")]
use super::simd::Avx512;
use super::bf16::require;
// MR, rows of A per register block: the f32 GEMM's, whose task split and output
// block loads and stores this uses.
use super::matmul::{check, BLayout, Split, MR};
use super::SharedMut;

const L: usize = 16;
/// Vectors of B's columns per register block: 6 rows x 4 vectors hold 24 of the 32
/// zmm registers, and each pair of k feeds 24 `vdpbf16ps` from 4 loads and 6
/// broadcasts where 6 x 2 fed 12 from 2 and 6 (the f32 GEMM's `WIDE`).
const WIDE: usize = 4;
/// The narrow block, for products of at most SHORT_M rows whose B is rounded per call
/// (as in the f32 GEMM: packing wide, deep strips per call costs short products more
/// than the wide block saves them).
const NARROW: usize = 2;
const SHORT_M: usize = 192;
/// Most pairs of k per panel of a narrow strip: 192 x 32 words = 24 KB, in L1.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const KCP: usize = 192;
/// Most pairs of k per panel of a wide strip: 640 x 64 words = 160 KB, so k <= 1280
/// runs in one pass with the sums in registers and the strip streaming from L2 (the
/// f32 GEMM's `PANEL_BYTES` rule); every further panel reloads and stores the output.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const KCP_WIDE: usize = 640;
/// Values of one column rounded at a time when packing an [n, k] B.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const ROUND: usize = 192;
/// Rows per chunk: 48 rows x 192 pairs = 36 KB of A (120 KB at 640), reused from L1/L2
/// by every strip.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const MC: usize = 8 * MR;

thread_local! {
    static PANEL: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// `dst[i][j] = sum_kk a[i * lda + kk] * B[kk][j]`, bf16 products (see
/// [`super::matmul::gemm`]): on AMX tiles where the CPU has them, else `vdpbf16ps`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(m: usize, n: usize, k: usize, a: &[f32], lda: usize, b: &[f32], bl: BLayout, dst: &mut [f32]) -> Result<()> {
    if super::amx::supported() {
        return super::amx::gemm(m, n, k, a, lda, b, bl, dst);
    }
    gemm_vector(m, n, k, a, lda, b, bl, dst)
}

/// A left factor A [m, k] rounded to bf16 pairs along k: `kp = ceil(k / 2)` words
/// per row, the last high half zero past an odd k.
pub struct PackedPairRows {
    data: Vec<u32>,
    m: usize,
    k: usize,
}

impl PackedPairRows {
    /// `a[i * lda + kk]` for i < m, kk < k.
    pub fn new(a: &[f32], m: usize, k: usize, lda: usize) -> Result<Self> {
        require()?;
        if !super::matmul::a_fits(a, m, k, lda) {
            candle_core::bail!("gemm bf16: A of {} values is too short for {m}x{k} (row stride {lda})", a.len());
        }
        let kp = k.div_ceil(2);
        let mut data = vec![0u32; m * kp];
        if kp > 0 {
            data.par_chunks_mut(kp).enumerate().for_each(|(i, row)| {
                let src = &a[i * lda..i * lda + k];
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX512-BF16 checked above; the row's kp words hold k >= 2 * kp - 1
                // values (the last high half, past an odd k, stays zero).
                unsafe {
                    round_into(src, row.as_mut_ptr() as *mut u16)
                }
                #[cfg(not(target_arch = "x86_64"))]
                let _ = (src, &row);
            });
        }
        Ok(Self { data, m, k })
    }

    /// Rows already rounded by the caller: `data` holds m rows of `ceil(k / 2)` words.
    pub(crate) fn from_words(data: Vec<u32>, m: usize, k: usize) -> Result<Self> {
        if data.len() != m * k.div_ceil(2) {
            candle_core::bail!("gemm bf16: {} pair words for {m}x{k}", data.len());
        }
        Ok(Self { data, m, k })
    }

    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }
}

/// A right factor B [k, n] rounded to pairs and cut into the panels the tasks read:
/// for each strip of 64 columns (the wide block's), `kp` rows of 64 pair words
/// (B[2p][j] low, B[2p + 1][j] high), zero past n and k. Packed once, it saves every task its panel copy, which
/// for the text encoder's 77-row products cost as much as the products.
pub struct PackedStrips {
    data: Vec<u32>,
    k: usize,
    n: usize,
}

impl PackedStrips {
    pub(crate) fn new(b: &[f32], k: usize, n: usize, bl: BLayout) -> Result<Self> {
        require()?;
        if !super::matmul::b_fits(b, k, n, bl) {
            candle_core::bail!("gemm bf16: B of {} values is too short for {k}x{n} ({bl:?})", b.len());
        }
        let kp = k.div_ceil(2);
        let nr = WIDE * L;
        let mut data = vec![0u32; n.div_ceil(nr) * kp * nr];
        if kp > 0 {
            data.par_chunks_mut(kp * nr).enumerate().for_each(|(s, strip)| {
                let (j0, w) = (s * nr, nr.min(n - s * nr));
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX512-BF16 checked above; the strip holds kp rows of nr words.
                unsafe {
                    pack_panel(b, bl, k, j0, w, nr, 0, kp, strip)
                }
                #[cfg(not(target_arch = "x86_64"))]
                let _ = (j0, w, &strip);
            });
        }
        Ok(Self { data, k, n })
    }

    /// A linear layer's weight W [n, k] (row-major) as the right factor W^T.
    pub fn of_linear(w: &[f32], n: usize, k: usize) -> Result<Self> {
        Self::new(w, k, n, BLayout::NK { ld: k })
    }

    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }

    fn view(&self) -> StripsRef<'_> {
        StripsRef { data: &self.data, k: self.k, n: self.n }
    }
}

/// B [k, n] already in [`PackedStrips`]' layout, wherever it lives: a layer's packed
/// weight, or a scratch buffer a kernel filled in that layout itself (Winograd's
/// transformed input, [`super::winograd_bf16`]).
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct StripsRef<'a> {
    data: &'a [u32],
    k: usize,
    n: usize,
}

impl<'a> StripsRef<'a> {
    /// Words a [k, n] B takes in strips: `ceil(n / 64)` strips of `ceil(k / 2)` rows of 64.
    pub(crate) fn words(k: usize, n: usize) -> usize {
        n.div_ceil(WIDE * L) * k.div_ceil(2) * WIDE * L
    }

    /// `data` holds [`Self::words`] for [k, n]: strip s, pair row p, column j at
    /// `(s * ceil(k / 2) + p) * 64 + j`.
    pub(crate) fn new(data: &'a [u32], k: usize, n: usize) -> Result<Self> {
        if data.len() < Self::words(k, n) {
            candle_core::bail!("gemm bf16: {} strip words for {k}x{n}", data.len());
        }
        Ok(Self { data, k, n })
    }
}

/// Where the tasks find B's panels.
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
enum Right<'a> {
    /// In memory as f32: each task rounds its panel as it goes.
    Raw { b: &'a [f32], bl: BLayout },
    /// Already rounded and cut ([`PackedStrips`], [`StripsRef`]).
    Strips(StripsRef<'a>),
}

/// As [`gemm`] with `vdpbf16ps` on zmm registers, whatever else the CPU has.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_vector(m: usize, n: usize, k: usize, a: &[f32], lda: usize, b: &[f32], bl: BLayout, dst: &mut [f32]) -> Result<()> {
    require()?;
    if !check(m, n, k, a, lda, b, bl, dst)? {
        return Ok(());
    }
    run(&PackedPairRows::new(a, m, k, lda)?, n, Right::Raw { b, bl }, dst)
}

/// `dst [m, n] = A B` for B [k, n] in memory with A already rounded (a 1x1 conv's
/// kernel, kept by its layer).
pub(crate) fn gemm_packed_a(a: &PackedPairRows, n: usize, b: &[f32], bl: BLayout, dst: &mut [f32]) -> Result<()> {
    require()?;
    let k = a.k;
    if !super::matmul::b_fits(b, k, n, bl) {
        candle_core::bail!("gemm bf16: B of {} values is too short for {k}x{n} ({bl:?})", b.len());
    }
    run(a, n, Right::Raw { b, bl }, dst)
}

/// `dst [m, n] = x B` for x [m, k] with B already in panels (a linear layer's weight,
/// kept by its layer).
pub(crate) fn gemm_packed_b(x: &[f32], m: usize, b: &PackedStrips, dst: &mut [f32]) -> Result<()> {
    require()?;
    run(&PackedPairRows::new(x, m, b.k, b.k)?, b.n, Right::Strips(b.view()), dst)
}

/// `dst [m, n] = A B` with both factors already rounded: A kept by its layer, B in
/// strips (Winograd's products).
pub(crate) fn gemm_packed_both(a: &PackedPairRows, b: StripsRef, dst: &mut [f32]) -> Result<()> {
    require()?;
    run(a, b.n, Right::Strips(b), dst)
}

/// The product of checked, rounded A with B.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn run(a: &PackedPairRows, n: usize, b: Right, dst: &mut [f32]) -> Result<()> {
    let (m, k) = (a.m, a.k);
    if let Right::Strips(s) = b {
        if (s.k, s.n) != (k, n) {
            candle_core::bail!("gemm bf16: A is {m}x{k} but B is {}x{}", s.k, s.n);
        }
    }
    if dst.len() < m * n {
        candle_core::bail!("gemm bf16: output of {} for {m}x{n}", dst.len());
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        dst[..m * n].fill(0.0);
        return Ok(());
    }
    // Packed strips are wide; B rounded per call takes the narrow block for short A.
    let nv = match b {
        Right::Raw { .. } if m <= SHORT_M => NARROW,
        _ => WIDE,
    };
    let split = Split::new(m, n, nv * L);
    let out = SharedMut(dst.as_mut_ptr());
    let ap = &a.data;
    (0..split.tasks()).into_par_iter().for_each(|t| {
        let (rows, cols) = split.task(t);
        if cols.is_empty() {
            return;
        }
        PANEL.with(|cell| {
            let mut panel = cell.borrow_mut();
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX512-BF16 checked by every caller; the task writes only dst rows
            // `rows` x columns `cols`, disjoint from other tasks and inside dst.
            unsafe {
                if nv == WIDE {
                    task::<WIDE>(m, n, k, ap, b, rows, cols, &mut panel, out)
                } else {
                    task::<NARROW>(m, n, k, ap, b, rows, cols, &mut panel, out)
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (rows, cols, &mut panel, out, ap);
        });
    });
    Ok(())
}

/// Rounds pair rows `p0..p0 + pc` of B's columns `j0..j0 + w` into `panel` (pc rows
/// of nr words), zeros past w and k.
///
/// SAFETY: AVX512-BF16; B holds those columns and rows (checked by the callers);
/// `panel` holds at least pc * nr words; w <= nr.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
#[allow(clippy::too_many_arguments)]
unsafe fn pack_panel(b: &[f32], bl: BLayout, k: usize, j0: usize, w: usize, nr: usize, p0: usize, pc: usize, panel: &mut [u32]) {
    let panel = &mut panel[..pc * nr];
    match bl {
        BLayout::KN { ld } => {
            for pp in 0..pc {
                let (kk, dst) = (2 * (p0 + pp), &mut panel[pp * nr..(pp + 1) * nr]);
                let lo = &b[kk * ld + j0..kk * ld + j0 + w];
                let hi = (kk + 1 < k).then(|| &b[(kk + 1) * ld + j0..(kk + 1) * ld + j0 + w]);
                // SAFETY: AVX-512 F and BW (the caller's features); dst has nr >= w words.
                unsafe { pack_pairs(lo, hi, dst.as_mut_ptr()) };
                dst[w..].fill(0);
            }
        }
        BLayout::NK { ld } => {
            // Column j of B is row j0 + j of the [n, k] matrix: its k values from
            // 2 p0 are adjacent, so they round straight into pair words, ROUND at a time.
            let mut col = [0u32; ROUND];
            if w < nr {
                panel.fill(0);
            }
            let mut c0 = 0;
            while c0 < pc {
                let cc = ROUND.min(pc - c0);
                let (k0, k1) = (2 * (p0 + c0), (2 * (p0 + c0 + cc)).min(k));
                for j in 0..w {
                    let at = (j0 + j) * ld;
                    col[..cc].fill(0);
                    // SAFETY: AVX512-BF16 (the caller's); col holds 2 * ROUND >= k1 - k0 values.
                    unsafe { round_into(&b[at + k0..at + k1], col.as_mut_ptr() as *mut u16) };
                    for (pp, &v) in col[..cc].iter().enumerate() {
                        panel[(c0 + pp) * nr + j] = v;
                    }
                }
                c0 += cc;
            }
        }
    }
}

/// The task's product, GotoBLAS-style, in blocks of 6 rows x NV vectors: for each
/// panel of k (an even split of the pairs into at most KCP, or KCP_WIDE for the wide
/// block), B's strips for the task's columns are rounded (or found
/// packed), then rows are taken MC at a time and each chunk runs against every strip.
/// A chunk's pair rows (MC x pc words) stay in L1/L2 while the strips go by, and
/// each strip (pc x nr words) in L1 (narrow) or L2 (wide) while the chunk's row
/// blocks go by; walking all
/// rows per strip instead re-streamed A from L3 for every 32 columns (a 4096 x 320 x
/// 2560 product ran at 230 GFLOP/s, the 320-column one at 310).
///
/// SAFETY: AVX512-BF16; `out` is the m x n output of which only `rows` x `cols` is
/// written; B's panels lie where `b` says (checked by the callers), packed strips
/// NV vectors wide; `cols` starts on a multiple of NV * 16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
#[allow(clippy::too_many_arguments)]
unsafe fn task<const NV: usize>(
    m: usize,
    n: usize,
    k: usize,
    ap: &[u32],
    b: Right,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    panel: &mut Vec<u32>,
    out: SharedMut,
) {
    let nr = NV * L;
    let kp = k.div_ceil(2);
    let panels = kp.div_ceil(if NV == WIDE { KCP_WIDE } else { KCP });
    let pc_max = kp.div_ceil(panels);
    let strips = cols.len().div_ceil(nr);
    if matches!(b, Right::Raw { .. }) && panel.len() < strips * pc_max * nr {
        panel.resize(strips * pc_max * nr, 0);
    }
    let mut p0 = 0;
    while p0 < kp {
        let pc = pc_max.min(kp - p0);
        if let Right::Raw { b, bl } = b {
            for s in 0..strips {
                let j0 = cols.start + s * nr;
                // SAFETY: forwarded; the scratch holds strips * pc_max * nr words.
                unsafe { pack_panel(b, bl, k, j0, nr.min(n - j0), nr, p0, pc, &mut panel[s * pc * nr..]) };
            }
        }
        let strip = |s: usize| -> *const u32 {
            match b {
                Right::Raw { .. } => panel[s * pc * nr..].as_ptr(),
                // SAFETY: column strips start at multiples of nr (the split's spans are
                // whole blocks), and strip j / nr has kp rows of nr words from p0 = 0.
                Right::Strips(st) => unsafe { st.data.as_ptr().add(((cols.start / nr + s) * kp + p0) * nr) },
            }
        };
        let mut ic = rows.start;
        while ic < rows.end {
            let chunk_end = (ic + MC).min(rows.end);
            for s in 0..strips {
                let (j0, bs) = (cols.start + s * nr, strip(s));
                let w = nr.min(n - j0);
                let mut i0 = ic;
                while i0 < chunk_end {
                    let arows: [*const u32; MR] = std::array::from_fn(|i| {
                        let r = (i0 + i).min(m - 1);
                        // SAFETY: r < m; row r of the pair table has kp words, p0 < kp.
                        unsafe { ap.as_ptr().add(r * kp + p0) }
                    });
                    let live = MR.min(chunk_end - i0);
                    // SAFETY: rows i0..i0 + live < m, columns j0..j0 + w <= n: inside the output.
                    let at = unsafe { out.get().add(i0 * n + j0) };
                    // SAFETY: as above; the strip holds pc pair-rows of nr words, each A pointer pc words.
                    unsafe {
                        let mut acc = if p0 > 0 { load_wide::<Avx512, NV>(at, n, live, w) } else { [[_mm512_setzero_ps(); NV]; MR] };
                        block::<NV>(&mut acc, &arows, bs, pc);
                        store_wide::<Avx512, NV>(&acc, at, n, live, w);
                    }
                    i0 += MR;
                }
            }
            ic = chunk_end;
        }
        p0 += pc;
    }
}

/// SAFETY: AVX512-BF16; each `a[i]` points at `pc` pair words, `b` at pc x NV * 16 words.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
#[inline]
unsafe fn block<const NV: usize>(acc: &mut [[__m512; NV]; MR], a: &[*const u32; MR], b: *const u32, pc: usize) {
    unsafe {
        let mut r = *acc;
        for pp in 0..pc {
            // A loop, not `array::from_fn`: a closure would not inherit this function's
            // target features, and its loads would become calls.
            let mut bs: [__m512bh; NV] = [std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()); NV];
            for (v, bv) in bs.iter_mut().enumerate() {
                *bv = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(b.add((pp * NV + v) * L) as *const __m512i));
            }
            for i in 0..MR {
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a[i].add(pp) as i32));
                for v in 0..NV {
                    r[i][v] = _mm512_dpbf16_ps(r[i][v], bs[v], av);
                }
            }
        }
        *acc = r;
    }
}

/// `a [m, k] x w^T` with `w [n, k]`, bf16 products and f32 sums with `vdpbf16ps`
/// (the AMX kernel is [`super::amx::linear_amx`]) (tests, benches).
pub fn linear_bf16(a: &candle_core::Tensor, w: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    use candle_core::{CpuStorage, Storage};
    let (m, k) = a.dims2()?;
    let (n, wk) = w.dims2()?;
    if wk != k {
        candle_core::bail!("linear bf16: input width {k}, weight {:?}", w.dims());
    }
    let (a, w) = (a.contiguous()?, w.contiguous()?);
    let (sa, la) = a.storage_and_layout();
    let (sw, lw) = w.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(ad)), Storage::Cpu(CpuStorage::F32(wd))) = (&*sa, &*sw) else {
        candle_core::bail!("linear bf16: f32 CPU tensors only");
    };
    let (a0, a1) = la.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("strided input".into()))?;
    let (w0, w1) = lw.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("strided weight".into()))?;
    let mut out = vec![0f32; m * n];
    gemm_vector(m, n, k, &ad[a0..a1], k, &wd[w0..w1], BLayout::NK { ld: k }, &mut out)?;
    drop((sa, sw));
    candle_core::Tensor::from_vec(out, (m, n), a.device())
}

/// [`linear_bf16`] with W rounded into [`PackedStrips`] first, as a linear layer
/// keeps it (tests, benches).
pub fn linear_bf16_prepacked(a: &candle_core::Tensor, w: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    let (_, k) = a.dims2()?;
    let (n, wk) = w.dims2()?;
    if wk != k {
        candle_core::bail!("linear bf16: input width {k}, weight {:?}", w.dims());
    }
    let wd = w.flatten_all()?.to_vec1::<f32>()?;
    linear_bf16_packed(a, &PackedStrips::of_linear(&wd, n, k)?)
}

/// `a [m, k] x W^T` with W already in [`PackedStrips`], as a linear layer keeps it:
/// what `--compute bf16` runs per call (benches).
pub fn linear_bf16_packed(a: &candle_core::Tensor, w: &PackedStrips) -> Result<candle_core::Tensor> {
    let (m, k) = a.dims2()?;
    if k != w.k {
        candle_core::bail!("linear bf16: input width {k}, packed weight {}x{}", w.n, w.k);
    }
    let ad = a.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0f32; m * w.n];
    gemm_packed_b(&ad, m, w, &mut out)?;
    candle_core::Tensor::from_vec(out, (m, w.n), a.device())
}

/// `w [o, k] x x [k, hw]`, a 1x1 convolution's product, with w rounded into
/// [`PackedPairRows`] first, as a 1x1 conv layer keeps it (tests, benches).
pub fn conv1x1_bf16_prepacked(w: &candle_core::Tensor, x: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    let (o, k) = w.dims2()?;
    let (xk, hw) = x.dims2()?;
    if xk != k {
        candle_core::bail!("conv1x1 bf16: weight {:?} does not fit input {:?}", w.dims(), x.dims());
    }
    let (wd, xd) = (w.flatten_all()?.to_vec1::<f32>()?, x.flatten_all()?.to_vec1::<f32>()?);
    let mut out = vec![0f32; o * hw];
    gemm_packed_a(&PackedPairRows::new(&wd, o, k, k)?, hw, &xd, BLayout::KN { ld: hw }, &mut out)?;
    candle_core::Tensor::from_vec(out, (o, hw), x.device())
}
