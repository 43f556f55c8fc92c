//! Fused, tiled scaled-dot-product attention (the FlashAttention scheme on a CPU).
//!
//! Candle's plain path materialises the whole `n_q x n_k` score matrix (64 MiB per
//! head at 4096 tokens) and walks it three times. Here each task takes one head and
//! a tile of `BR` queries, and streams the keys in tiles of `BC`: scores for the
//! tile, a running (online) softmax maximum and sum per query, and the output
//! accumulated and rescaled as the maximum grows. Scratch is tile-sized (a few tens
//! of KiB per thread); nothing of size `n_q x n_k` exists.
//!
//! The tiles are kept transposed, queries along the vector lanes: scores are
//! `S^T[j][i]`, the output accumulator `O^T[d][i]`. Then the softmax maximum and
//! sum over keys are lane-wise (no horizontal reductions), the rescale is one
//! multiply per vector, and keys and head dimensions are broadcast scalars, so any
//! key count and any head size (40, 64, 80, 160, odd ones) run without padding;
//! only the last query tile has idle lanes. The softmax scale and log2(e) are
//! folded into the packed queries, so the exponentials are exp2.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::simd::{Avx2, Avx512};
use super::simd::{Portable, Simd};
use super::{check_bounds, isa, require, Isa, SharedMut};

/// Keys per tile: the score tile (`BC x BR` floats, 32 KiB at BR = 64) stays in
/// L1/L2 while it is read once per block of head dimensions.
const BC: usize = 128;
/// The widest query tile any instruction set uses (AVX-512: 4 vectors of 16).
const BR_MAX: usize = 64;

/// `softmax(q k^T * scale) v` by the fused kernel. `q` is `[batch, heads, n_q, d]`,
/// `k` and `v` `[batch, heads, n_k, d]`, all f32 on the CPU, any strides (a view
/// whose last dimension is strided is made contiguous first). `causal`: query `i`
/// sees keys `0..=i`.
///
/// The result is `[batch, heads, n_q, d]` as a transposed view of a contiguous
/// `[batch, n_q, heads, d]` buffer: the layout attention's caller merges the heads
/// back into, so that merge is free.
pub fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    flash_attention_on(isa(), q, k, v, scale, causal)
}

/// [`flash_attention`] on a chosen instruction set (an error if this CPU lacks
/// it): how the tests prove every path the machine can run.
pub fn flash_attention_on(isa: Isa, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    require(isa)?;
    let unit = |t: &Tensor| if t.stride().last() == Some(&1) { Ok(t.clone()) } else { t.contiguous() };
    let nq = q.dims().get(2).copied().unwrap_or(0);
    let per_head = |t: &Tensor| if packs_keys(nq, t.stride(), t.dims()) { t.contiguous() } else { unit(t) };
    let (q, k, v) = (unit(q)?, per_head(k)?, per_head(v)?);
    let op = FlashAttention { scale: scale as f32, causal, isa };
    q.apply_op3_no_bwd(&k, &v, &op)?.transpose(1, 2)
}

/// Fewest queries for which strided keys and values are first copied head by head.
pub(crate) const PACK_KEYS_MIN_QUERIES: usize = 1024;

/// Whether keys or values of this layout are copied to `[batch, heads, n_k, d]`
/// before the kernel runs. A layer's k and v are views of `[batch, n_k, heads, d]`,
/// so a head's consecutive keys lie `heads * d` floats apart (1280 bytes in SD 1.5's
/// first level): a key tile's rows then fall into a sixteenth of L1's sets, and the
/// value tile, read once per block of head dimensions, came from L2 each time.
/// Contiguous, SD 1.5's 4096-token attention ran 1.25-1.35x as fast, the copy
/// included (alternated in one process, medians of 15; 1024 tokens at d 80: 1.08x);
/// with 256 queries (four tiles) the copy is not repaid. The memory estimator counts
/// the copies by the same rule (`memory::sim`).
pub(crate) fn packs_keys(nq: usize, stride: &[usize], dims: &[usize]) -> bool {
    nq >= PACK_KEYS_MIN_QUERIES && stride.len() == 4 && dims.len() == 4 && stride[2] != dims[3]
}

struct FlashAttention {
    scale: f32,
    causal: bool,
    isa: Isa,
}

/// Pointers and strides of one call, shared by every task.
struct Views {
    q: *const f32,
    k: *const f32,
    v: *const f32,
    out: SharedMut,
    /// Batch, head and token strides of q, k, v (the last dimension has stride 1).
    qs: [usize; 3],
    ks: [usize; 3],
    vs: [usize; 3],
    heads: usize,
    nq: usize,
    nk: usize,
    d: usize,
    /// scale * log2(e), folded into the packed queries.
    scale2: f32,
    causal: bool,
}
// SAFETY: the input pointers are only read; the output is written through SharedMut
// in disjoint rows per task (see `tile`).
unsafe impl Sync for Views {}

/// Per-thread scratch: packed queries, the score tile, the output accumulator and
/// the running softmax state. All tile-sized.
struct Scratch {
    qt: Vec<f32>,
    st: Vec<f32>,
    ot: Vec<f32>,
    m: [f32; BR_MAX],
    l: [f32; BR_MAX],
    alpha: [f32; BR_MAX],
}

impl Scratch {
    fn new(d: usize) -> Self {
        Self {
            qt: vec![0.0; d * BR_MAX],
            st: vec![0.0; BC * BR_MAX],
            ot: vec![0.0; d * BR_MAX],
            m: [0.0; BR_MAX],
            l: [0.0; BR_MAX],
            alpha: [0.0; BR_MAX],
        }
    }
}

fn f32_slice<'a>(s: &'a CpuStorage, what: &str) -> Result<&'a [f32]> {
    match s {
        CpuStorage::F32(v) => Ok(v),
        other => candle_core::bail!("attention takes f32 {what}, got {:?}", other.dtype()),
    }
}

pub(super) fn strides3(l: &Layout, what: &str) -> Result<[usize; 3]> {
    match l.stride() {
        &[b, h, n, 1] => Ok([b, h, n]),
        s => candle_core::bail!("attention: {what} needs a unit last stride, got {s:?}"),
    }
}

/// q [b, h, n_q, d], k and v [b, h, n_k, d] as f32 slices, their sizes checked against
/// each other and every view against its buffer: (q, k, v, (b, h, n_q, n_k, d)).
/// Shared by the fused kernels.
#[allow(clippy::type_complexity)]
pub(super) fn checked_inputs<'a>(
    (s1, l1): (&'a CpuStorage, &Layout),
    (s2, l2): (&'a CpuStorage, &Layout),
    (s3, l3): (&'a CpuStorage, &Layout),
) -> Result<(&'a [f32], &'a [f32], &'a [f32], (usize, usize, usize, usize, usize))> {
    let (q, k, v) = (f32_slice(s1, "queries")?, f32_slice(s2, "keys")?, f32_slice(s3, "values")?);
    let (b, h, nq, d) = l1.shape().dims4()?;
    let (kb, kh, nk, kd) = l2.shape().dims4()?;
    if (kb, kh, kd) != (b, h, d) || l3.shape().dims4()? != (b, h, nk, d) {
        candle_core::bail!("attention shapes disagree: q {:?}, k {:?}, v {:?}", l1.dims(), l2.dims(), l3.dims());
    }
    if nk == 0 && b * h * nq * d > 0 {
        candle_core::bail!("attention over zero keys");
    }
    check_bounds(q.len(), l1)?;
    check_bounds(k.len(), l2)?;
    check_bounds(v.len(), l3)?;
    Ok((q, k, v, (b, h, nq, nk, d)))
}

impl CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "brume-flash-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (q, k, v, (b, h, nq, nk, d)) = checked_inputs((s1, l1), (s2, l2), (s3, l3))?;
        let out_shape = Shape::from((b, nq, h, d));
        if b * h * nq * d == 0 {
            return Ok((CpuStorage::F32(vec![0.0; out_shape.elem_count()]), out_shape));
        }
        let mut out = vec![0f32; out_shape.elem_count()];
        let views = Views {
            // SAFETY (all three): start offsets lie inside their buffers (check_bounds).
            q: unsafe { q.as_ptr().add(l1.start_offset()) },
            k: unsafe { k.as_ptr().add(l2.start_offset()) },
            v: unsafe { v.as_ptr().add(l3.start_offset()) },
            out: SharedMut(out.as_mut_ptr()),
            qs: strides3(l1, "q")?,
            ks: strides3(l2, "k")?,
            vs: strides3(l3, "v")?,
            heads: h,
            nq,
            nk,
            d,
            scale2: self.scale * std::f32::consts::LOG2_E,
            causal: self.causal,
        };
        let isa = self.isa;
        // Query tile: NV * LANES of the tile_* instantiation below (kept in step by
        // the tests, which cover every query count around these multiples).
        let br = match isa {
            Isa::Avx512 => 64,
            Isa::Avx2 => 16,
            Isa::Portable => 16,
        };
        let tiles = nq.div_ceil(br);
        (0..b * h * tiles).into_par_iter().for_each_init(
            || Scratch::new(d),
            |scr, t| {
                let (bh, q0) = (t / tiles, (t % tiles) * br);
                // SAFETY: views were bounds-checked above; the CPU has the features of
                // `isa` (detected at run time); tasks write disjoint output rows.
                unsafe {
                    match isa {
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx512 => tile_avx512(&views, bh, q0, scr),
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx2 => tile_avx2(&views, bh, q0, scr),
                        _ => tile::<Portable, 2, 2, 4>(&views, bh, q0, scr),
                    }
                }
            },
        );
        Ok((CpuStorage::F32(out), out_shape))
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn tile_avx512(vw: &Views, bh: usize, q0: usize, scr: &mut Scratch) {
    // SAFETY: forwarded from the caller.
    unsafe { tile::<Avx512, 4, 6, 6>(vw, bh, q0, scr) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2(vw: &Views, bh: usize, q0: usize, scr: &mut Scratch) {
    // SAFETY: forwarded from the caller.
    unsafe { tile::<Avx2, 2, 6, 6>(vw, bh, q0, scr) }
}

/// One head (`bh` = batch * heads + head) and the queries `q0..q0 + NV * LANES`
/// against all keys. `MK` keys per score micro-kernel, `MD` head dimensions per
/// output micro-kernel: the register blocking.
///
/// SAFETY: `vw` describes valid buffers; `bh` and `q0` are in range; the CPU has
/// `S`'s features. Writes only output rows `q0..` of head `bh`.
#[inline(always)]
unsafe fn tile<S: Simd, const NV: usize, const MK: usize, const MD: usize>(
    vw: &Views,
    bh: usize,
    q0: usize,
    scr: &mut Scratch,
) {
    let l = S::LANES;
    let br = NV * l;
    let d = vw.d;
    let nvalid = br.min(vw.nq - q0);
    let (b, h) = (bh / vw.heads, bh % vw.heads);
    // SAFETY (whole body): every pointer below addresses an element of a view
    // whose extent check_bounds verified, or a scratch slot within its length
    // (qt, ot: d * br <= d * BR_MAX; st: BC * br).
    unsafe {
        let qp = vw.q.add(b * vw.qs[0] + h * vw.qs[1]);
        let kp = vw.k.add(b * vw.ks[0] + h * vw.ks[1]);
        let vp = vw.v.add(b * vw.vs[0] + h * vw.vs[1]);
        let (qt, st, ot) = (scr.qt.as_mut_ptr(), scr.st.as_mut_ptr(), scr.ot.as_mut_ptr());

        // Pack the queries transposed and pre-scaled; idle lanes are zero.
        for i in 0..br {
            let row = qp.add((q0 + i.min(nvalid - 1)) * vw.qs[2]);
            for dd in 0..d {
                *qt.add(dd * br + i) = if i < nvalid { *row.add(dd) * vw.scale2 } else { 0.0 };
            }
        }
        scr.ot[..d * br].fill(0.0);
        scr.m[..br].fill(f32::NEG_INFINITY);
        scr.l[..br].fill(0.0);
        let (mp, lp, ap) = (scr.m.as_mut_ptr(), scr.l.as_mut_ptr(), scr.alpha.as_mut_ptr());

        let last_q = q0 + nvalid - 1;
        let mut j0 = 0;
        while j0 < vw.nk {
            if vw.causal && j0 > last_q {
                break;
            }
            let bc = BC.min(vw.nk - j0);
            // Scores S^T = K Q^T for this key tile, with each query's maximum over the
            // tile taken from the registers (the softmax then reads the scores once).
            let mut tile_max = [S::splat(f32::NEG_INFINITY); NV];
            let mut j = 0;
            while j < bc {
                let rows = MK.min(bc - j);
                qk_rows::<S, NV>(rows, kp.add((j0 + j) * vw.ks[2]), vw.ks[2], qt, br, d, st.add(j * br), &mut tile_max);
                j += rows;
            }
            if vw.causal {
                // Masking lowers scores after the fact: the maximum is taken afresh.
                mask_future_keys(st, br, bc, j0, q0);
                for (vi, t) in tile_max.iter_mut().enumerate() {
                    *t = (0..bc).fold(S::splat(f32::NEG_INFINITY), |mx, jj| S::max(mx, S::load(st.add(jj * br + vi * l))));
                }
            }
            // Online softmax: new running maximum, rescale factor, exponentials, sums.
            for (vi, &t_max) in tile_max.iter().enumerate() {
                let o = vi * l;
                let mx = S::max(S::load(mp.add(o)), t_max);
                let alpha = S::exp2(S::sub(S::load(mp.add(o)), mx));
                let mut sum = S::splat(0.0);
                for jj in 0..bc {
                    let p = S::exp2(S::sub(S::load(st.add(jj * br + o)), mx));
                    S::store(st.add(jj * br + o), p);
                    sum = S::add(sum, p);
                }
                S::store(lp.add(o), S::fmadd(S::load(lp.add(o)), alpha, sum));
                S::store(mp.add(o), mx);
                S::store(ap.add(o), alpha);
            }
            // O^T = O^T * alpha + V^T P^T.
            let mut dd = 0;
            while dd < d {
                let rows = MD.min(d - dd);
                pv_rows::<S, NV>(rows, vp.add(j0 * vw.vs[2] + dd), vw.vs[2], st, br, bc, ap, ot.add(dd * br));
                dd += rows;
            }
            j0 += bc;
        }

        write_rows(vw.out.get().add(((b * vw.nq + q0) * vw.heads + h) * d), vw.heads * d, ot, lp, br, nvalid, d);
    }
}

/// Causal attention: the scores of keys `j0..j0 + bc` that come after their query
/// (`q0 + lane`) become -inf, in a transposed `[bc][br]` score tile.
///
/// SAFETY: `st` holds bc rows of br floats.
#[inline(always)]
pub(super) unsafe fn mask_future_keys(st: *mut f32, br: usize, bc: usize, j0: usize, q0: usize) {
    if j0 + bc - 1 <= q0 {
        return;
    }
    for jj in 0..bc {
        for i in 0..br {
            if j0 + jj > q0 + i {
                // SAFETY: jj < bc, i < br.
                unsafe { *st.add(jj * br + i) = f32::NEG_INFINITY };
            }
        }
    }
}

/// The tile's output: row i (at `out + i * stride`, d floats) = O^T[:, i] / l[i]
/// for its `nvalid` queries, from the transposed `[d][br]` accumulator.
///
/// SAFETY: `out` has nvalid rows of d floats `stride` apart; `ot` d rows of br
/// floats; `l` nvalid floats.
#[inline(always)]
pub(super) unsafe fn write_rows(out: *mut f32, stride: usize, ot: *const f32, l: *const f32, br: usize, nvalid: usize, d: usize) {
    for i in 0..nvalid {
        // SAFETY: as the contract says.
        unsafe {
            let inv = 1.0 / *l.add(i);
            let row = out.add(i * stride);
            for dd in 0..d {
                *row.add(dd) = *ot.add(dd * br + i) * inv;
            }
        }
    }
}

/// Scores for `rows` consecutive keys, dispatched to a register block of that height.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn qk_rows<S: Simd, const NV: usize>(
    rows: usize,
    k: *const f32,
    ks: usize,
    qt: *const f32,
    br: usize,
    d: usize,
    st: *mut f32,
    mx: &mut [S::V; NV],
) {
    // SAFETY: forwarded; `rows` keys exist from `k`.
    unsafe {
        match rows {
            1 => qk_block::<S, NV, 1>(k, ks, qt, br, d, st, mx),
            2 => qk_block::<S, NV, 2>(k, ks, qt, br, d, st, mx),
            3 => qk_block::<S, NV, 3>(k, ks, qt, br, d, st, mx),
            4 => qk_block::<S, NV, 4>(k, ks, qt, br, d, st, mx),
            5 => qk_block::<S, NV, 5>(k, ks, qt, br, d, st, mx),
            _ => qk_block::<S, NV, 6>(k, ks, qt, br, d, st, mx),
        }
    }
}

/// `st[r][lanes] = sum_d k[r][d] * qt[d][lanes]` for R keys and NV vectors of
/// queries, and `mx[v] = max(mx[v], st[r][v's lanes])` over those keys.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn qk_block<S: Simd, const NV: usize, const R: usize>(
    k: *const f32,
    ks: usize,
    qt: *const f32,
    br: usize,
    d: usize,
    st: *mut f32,
    mx: &mut [S::V; NV],
) {
    // SAFETY: R key rows of d floats from `k`, d rows of br floats at `qt`, R rows of br at `st`.
    unsafe {
        let mut acc = [[S::splat(0.0); NV]; R];
        for dd in 0..d {
            let qv: [S::V; NV] = std::array::from_fn(|v| S::load(qt.add(dd * br + v * S::LANES)));
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let kb = S::splat(*k.add(r * ks + dd));
                for (a, &qvv) in acc_r.iter_mut().zip(qv.iter()) {
                    *a = S::fmadd(kb, qvv, *a);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (v, &a) in acc_r.iter().enumerate() {
                S::store(st.add(r * br + v * S::LANES), a);
                mx[v] = S::max(mx[v], a);
            }
        }
    }
}

/// Output update for `rows` consecutive head dimensions.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn pv_rows<S: Simd, const NV: usize>(
    rows: usize,
    v: *const f32,
    vs: usize,
    pt: *const f32,
    br: usize,
    bc: usize,
    alpha: *const f32,
    ot: *mut f32,
) {
    // SAFETY: forwarded; `rows` head dimensions exist from `v` and `ot`.
    unsafe {
        match rows {
            1 => pv_block::<S, NV, 1>(v, vs, pt, br, bc, alpha, ot),
            2 => pv_block::<S, NV, 2>(v, vs, pt, br, bc, alpha, ot),
            3 => pv_block::<S, NV, 3>(v, vs, pt, br, bc, alpha, ot),
            4 => pv_block::<S, NV, 4>(v, vs, pt, br, bc, alpha, ot),
            5 => pv_block::<S, NV, 5>(v, vs, pt, br, bc, alpha, ot),
            _ => pv_block::<S, NV, 6>(v, vs, pt, br, bc, alpha, ot),
        }
    }
}

/// `ot[r][lanes] = ot[r][lanes] * alpha[lanes] + sum_j v[j][r] * pt[j][lanes]`
/// for R head dimensions over `bc` keys.
#[inline(always)]
unsafe fn pv_block<S: Simd, const NV: usize, const R: usize>(
    v: *const f32,
    vs: usize,
    pt: *const f32,
    br: usize,
    bc: usize,
    alpha: *const f32,
    ot: *mut f32,
) {
    // SAFETY: bc rows of V from `v` (R floats each used), bc rows of br floats at
    // `pt`, R rows of br floats at `ot`, br floats at `alpha`.
    unsafe {
        let al: [S::V; NV] = std::array::from_fn(|i| S::load(alpha.add(i * S::LANES)));
        let mut acc: [[S::V; NV]; R] =
            std::array::from_fn(|r| std::array::from_fn(|i| S::mul(S::load(ot.add(r * br + i * S::LANES)), al[i])));
        for j in 0..bc {
            let p: [S::V; NV] = std::array::from_fn(|i| S::load(pt.add(j * br + i * S::LANES)));
            let vrow = v.add(j * vs);
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let vb = S::splat(*vrow.add(r));
                for (a, &pv) in acc_r.iter_mut().zip(p.iter()) {
                    *a = S::fmadd(vb, pv, *a);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (i, &a) in acc_r.iter().enumerate() {
                S::store(ot.add(r * br + i * S::LANES), a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_copied_for_long_strided_runs_only() {
        let dev = candle_core::Device::Cpu;
        let strided = Tensor::zeros((1, 1024, 8, 40), candle_core::DType::F32, &dev).unwrap().transpose(1, 2).unwrap();
        let per_head = strided.contiguous().unwrap();
        assert!(packs_keys(1024, strided.stride(), strided.dims()));
        assert!(!packs_keys(1023, strided.stride(), strided.dims()), "too few query tiles to repay the copy");
        assert!(!packs_keys(4096, per_head.stride(), per_head.dims()), "already contiguous per head");
        let one_head = Tensor::zeros((1, 1024, 1, 40), candle_core::DType::F32, &dev).unwrap().transpose(1, 2).unwrap();
        assert!(!packs_keys(4096, one_head.stride(), one_head.dims()), "one head: keys are d apart already");
    }
}
