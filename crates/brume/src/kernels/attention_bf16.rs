//! Fused attention with AVX512-BF16 dot products, for CPUs without AMX.
//!
//! The scheme and tile layout of [`super::flash_attention`] (one head and 64 queries
//! per task, keys streamed in tiles of 128, an online softmax, queries along the
//! vector lanes, nothing of size `n_q x n_k`), with both products in `vdpbf16ps`,
//! which multiplies pairs of bf16 values into f32 sums at twice the f32 FMA rate:
//!
//! - scores: the pairs run along the head dimension. Queries (with the softmax scale
//!   and log2(e) folded in) are rounded per task into `[d/2][64]` pair words; keys
//!   are rounded once per call, a key's row of bf16 values being its pair words.
//! - `P V`: the pairs run along the keys. Values are rounded once per call into
//!   `[n_k/2][d]` words (keys 2t and 2t + 1 of one head dimension); each tile's
//!   probabilities into `[keys/2][64]` words.
//!
//! Maximum, exponentials, sums and the output stay f32; q, k, v and the
//! probabilities are rounded to bf16 (nearest even). The AMX kernel splits P into
//! two bf16 halves because there P's rounding took a bf16 SD 1.5 step past 1e-2
//! relative error; here, with the conditioning projections and each network's first
//! and last convolution in f32 ([`crate::layers::f32_products`]), the split moved
//! the step's error by less than its run-to-run spread (8.9e-3 with it, 8.7e-3
//! without, `brume bench speed`) while costing a third more dot products: the
//! attention at 4096 tokens ran 0.110 s with it, 0.085 s without, 0.12 s in f32.
//! What the rounding costs is the scores' (q and k): on SD 1.5 at 256 px this kernel
//! takes the step's error from 8.8e-3 (f32 attention) to 1.02e-2, and a variant with
//! only the scores in bf16 (P V in f32) to 1.13e-2. `BRUME_BF16_ATTENTION=off` keeps
//! attention f32 under `--compute bf16` (see [`super::bf16_attention`]).

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::flash_attention::{checked_inputs, strides3};
use super::SharedMut;

/// Queries per task: four vectors of 16 lanes.
const BR: usize = 64;
/// Keys per tile (even, so every tile but the last starts on a key pair).
const BC: usize = 128;

/// `softmax(q k^T * scale) v` with bf16 products; the contract of
/// [`super::flash_attention::flash_attention`] (`q` [b, h, n_q, d], `k` and `v`
/// [b, h, n_k, d], f32 CPU tensors; the result a transposed view of a contiguous
/// [b, n_q, h, d] buffer). An error on a CPU without AVX512-BF16.
pub fn attention_bf16(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    super::bf16::require()?;
    let unit = |t: &Tensor| if t.stride().last() == Some(&1) { Ok(t.clone()) } else { t.contiguous() };
    let (q, k, v) = (unit(q)?, unit(k)?, unit(v)?);
    q.apply_op3_no_bwd(&k, &v, &Bf16Attention { scale: scale as f32, causal })?.transpose(1, 2)
}

struct Bf16Attention {
    scale: f32,
    causal: bool,
}

/// The sizes and shared inputs of one call.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Call {
    q: *const f32,
    /// Batch, head and token strides of q (its last dimension has stride 1).
    qs: [usize; 3],
    /// Rounded keys, `[b * h][n_k][d2]` pair words.
    kp: Vec<u32>,
    /// Rounded values, `[b * h][n_k.div_ceil(2)][d]` pair words.
    vp: Vec<u32>,
    out: SharedMut,
    heads: usize,
    nq: usize,
    nk: usize,
    d: usize,
    /// Pair words per key row: `d.div_ceil(2)`.
    d2: usize,
    /// scale * log2(e), folded into the packed queries.
    scale2: f32,
    causal: bool,
}
// SAFETY: `q` is only read; the output is written through SharedMut in disjoint
// rows per task (see `tile`).
unsafe impl Sync for Call {}

/// Per-thread scratch, all tile-sized.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Scratch {
    /// Packed queries, `[d2][BR]` words.
    qt: Vec<u32>,
    /// Scores, `[BC][BR]`.
    st: Vec<f32>,
    /// Probabilities, rounded, `[BC / 2][BR]` pair words.
    pt: Vec<u32>,
    /// Output accumulator, `[d][BR]`.
    ot: Vec<f32>,
    m: [f32; BR],
    l: [f32; BR],
    alpha: [f32; BR],
}

impl Scratch {
    fn new(d: usize) -> Self {
        Self {
            qt: vec![0; d.div_ceil(2) * BR],
            st: vec![0.0; BC * BR],
            pt: vec![0; BC / 2 * BR],
            ot: vec![0.0; d * BR],
            m: [0.0; BR],
            l: [0.0; BR],
            alpha: [0.0; BR],
        }
    }
}

impl CustomOp3 for Bf16Attention {
    fn name(&self) -> &'static str {
        "brume-bf16-attention"
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
        super::bf16::require()?;
        let (q, k, v, (b, h, nq, nk, d)) = checked_inputs((s1, l1), (s2, l2), (s3, l3))?;
        let out_shape = Shape::from((b, nq, h, d));
        let mut out = vec![0f32; out_shape.elem_count()];
        if b * h * nq * d == 0 {
            return Ok((CpuStorage::F32(out), out_shape));
        }
        let (qs, ks, vs) = (strides3(l1, "q")?, strides3(l2, "k")?, strides3(l3, "v")?);
        let (k, v) = (&k[l2.start_offset()..], &v[l3.start_offset()..]);
        let (d2, nk2) = (d.div_ceil(2), nk.div_ceil(2));
        // Keys and values, rounded once per call for every query tile of their head.
        let mut kp = vec![0u32; b * h * nk * d2];
        let mut vp = vec![0u32; b * h * nk2 * d];
        kp.par_chunks_mut(nk * d2).zip(vp.par_chunks_mut(nk2 * d)).enumerate().for_each(|(bh, (kh, vh))| {
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (&kh, &vh);
            let head = (bh / h) * ks[0] + (bh % h) * ks[1];
            for j in 0..nk {
                let row = &k[head + j * ks[2]..][..d];
                // SAFETY: the CPU has AVX512-BF16 (checked above); a key's row of d2
                // words holds its d bf16 values (the last half-word stays zero for odd d).
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    super::bf16::round_into(row, kh[j * d2..].as_mut_ptr() as *mut u16)
                };
                #[cfg(not(target_arch = "x86_64"))]
                let _ = row;
            }
            let head = (bh / h) * vs[0] + (bh % h) * vs[1];
            for t in 0..nk2 {
                let lo = &v[head + 2 * t * vs[2]..][..d];
                let hi = (2 * t + 1 < nk).then(|| &v[head + (2 * t + 1) * vs[2]..][..d]);
                // SAFETY: AVX-512 F and BW come with AVX512-BF16; d words at row t.
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    super::bf16::pack_pairs(lo, hi, vh[t * d..].as_mut_ptr())
                };
                #[cfg(not(target_arch = "x86_64"))]
                let _ = (lo, hi);
            }
        });
        let call = Call {
            // SAFETY: the start offset lies inside the buffer (check_bounds).
            q: unsafe { q.as_ptr().add(l1.start_offset()) },
            qs,
            kp,
            vp,
            out: SharedMut(out.as_mut_ptr()),
            heads: h,
            nq,
            nk,
            d,
            d2,
            scale2: self.scale * std::f32::consts::LOG2_E,
            causal: self.causal,
        };
        let tiles = nq.div_ceil(BR);
        (0..b * h * tiles).into_par_iter().for_each_init(
            || Scratch::new(d),
            |scr, t| {
                // SAFETY: the views were bounds-checked, the CPU has AVX512-BF16, and
                // tasks write disjoint output rows.
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    tile(&call, t / tiles, (t % tiles) * BR, scr)
                };
                #[cfg(not(target_arch = "x86_64"))]
                let _ = (scr, t, &call);
            },
        );
        Ok((CpuStorage::F32(out), out_shape))
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    pub(super) use super::super::bf16::bf16_bits;
    pub(super) use super::super::flash_attention;
    pub(super) use super::super::simd::{Avx512, Simd, EXP2_C, EXP2_MIN};
    pub(super) use std::arch::x86_64::*;

    /// Lanes of a zmm register.
    pub(super) const L: usize = 16;
    /// Query vectors per tile.
    pub(super) const NV: usize = super::BR / L;
}
#[cfg(target_arch = "x86_64")]
use x86::*;

/// One head (`bh` = batch * heads + head) and the queries `q0..q0 + BR` against all keys.
///
/// SAFETY: `c` describes valid buffers; `bh` and `q0` are in range; the CPU has
/// AVX512-BF16. Writes only output rows `q0..` of head `bh`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw,fma")]
unsafe fn tile(c: &Call, bh: usize, q0: usize, scr: &mut Scratch) {
    let (d, d2) = (c.d, c.d2);
    let nvalid = BR.min(c.nq - q0);
    let (b, h) = (bh / c.heads, bh % c.heads);
    // SAFETY (whole body): every pointer addresses an element of a checked view, of
    // this head's packed keys and values, or of a scratch buffer within its length.
    unsafe {
        let qp = c.q.add(b * c.qs[0] + h * c.qs[1]);
        let kp = c.kp.as_ptr().add(bh * c.nk * d2);
        let vp = c.vp.as_ptr().add(bh * c.nk.div_ceil(2) * d);
        let (qt, st, ot) = (scr.qt.as_mut_ptr(), scr.st.as_mut_ptr(), scr.ot.as_mut_ptr());
        let pt = scr.pt.as_mut_ptr();

        // Queries, pre-scaled and rounded, transposed into pair words; idle lanes zero.
        for i in 0..BR {
            let row = qp.add((q0 + i.min(nvalid - 1)) * c.qs[2]);
            for p in 0..d2 {
                let word = if i < nvalid {
                    let lo = *row.add(2 * p) * c.scale2;
                    let hi = if 2 * p + 1 < d { *row.add(2 * p + 1) * c.scale2 } else { 0.0 };
                    bf16_bits(lo) | (bf16_bits(hi) << 16)
                } else {
                    0
                };
                *qt.add(p * BR + i) = word;
            }
        }
        scr.ot.fill(0.0);
        scr.m.fill(f32::NEG_INFINITY);
        scr.l.fill(0.0);
        let (mp, lp, ap) = (scr.m.as_mut_ptr(), scr.l.as_mut_ptr(), scr.alpha.as_mut_ptr());

        let last_q = q0 + nvalid - 1;
        let mut j0 = 0;
        while j0 < c.nk {
            if c.causal && j0 > last_q {
                break;
            }
            let bc = BC.min(c.nk - j0);
            // Scores S^T = K Q^T for this key tile, 6 keys per register block; each
            // query's maximum over the tile is taken from the registers as they are
            // stored, so the softmax does not read the 32 KiB of scores an extra time.
            let mut tile_max = [_mm512_set1_ps(f32::NEG_INFINITY); NV];
            let mut j = 0;
            while j < bc {
                let rows = 6.min(bc - j);
                let k = kp.add((j0 + j) * d2);
                let s = st.add(j * BR);
                let mx = &mut tile_max;
                match rows {
                    1 => qk_block::<1>(k, d2, qt, s, mx),
                    2 => qk_block::<2>(k, d2, qt, s, mx),
                    3 => qk_block::<3>(k, d2, qt, s, mx),
                    4 => qk_block::<4>(k, d2, qt, s, mx),
                    5 => qk_block::<5>(k, d2, qt, s, mx),
                    _ => qk_block::<6>(k, d2, qt, s, mx),
                }
                j += rows;
            }
            // Masking lowers some scores after the fact: then the maximum is taken afresh.
            let tile_max = if c.causal {
                flash_attention::mask_future_keys(st, BR, bc, j0, q0);
                None
            } else {
                Some(tile_max)
            };
            softmax_step(st, bc, tile_max, mp, lp, ap, pt);
            // O^T = O^T * alpha + V^T P^T, 5 head dimensions per register block.
            let (v, bc2) = (vp.add(j0 / 2 * d), bc.div_ceil(2));
            let mut dd = 0;
            while dd < d {
                let rows = 5.min(d - dd);
                let (v, o) = (v.add(dd), ot.add(dd * BR));
                match rows {
                    1 => pv_block::<1>(v, d, pt, bc2, ap, o),
                    2 => pv_block::<2>(v, d, pt, bc2, ap, o),
                    3 => pv_block::<3>(v, d, pt, bc2, ap, o),
                    4 => pv_block::<4>(v, d, pt, bc2, ap, o),
                    _ => pv_block::<5>(v, d, pt, bc2, ap, o),
                }
                dd += rows;
            }
            j0 += bc;
        }

        // out[b, q0 + i, h, :] = O^T[:, i] / l[i]
        flash_attention::write_rows(c.out.get().add(((b * c.nq + q0) * c.heads + h) * d), c.heads * d, ot, lp, BR, nvalid, d);
    }
}

/// `st[r][lanes] = sum_p k[r][p] . qt[p][lanes]` (pair dot products) for R keys,
/// and `mx[v] = max(mx[v], st[r][v's lanes])` over those keys.
///
/// SAFETY: R key rows of `d2` words from `k`, `d2` rows of BR words at `qt`, R rows
/// of BR floats at `st`; AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn qk_block<const R: usize>(k: *const u32, d2: usize, qt: *const u32, st: *mut f32, mx: &mut [__m512; NV]) {
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NV]; R];
        for p in 0..d2 {
            let qv: [__m512bh; NV] =
                std::array::from_fn(|v| std::mem::transmute(_mm512_loadu_si512(qt.add(p * BR + v * L) as *const __m512i)));
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let kb: __m512bh = std::mem::transmute(_mm512_set1_epi32(*k.add(r * d2 + p) as i32));
                for (a, &q) in acc_r.iter_mut().zip(qv.iter()) {
                    *a = _mm512_dpbf16_ps(*a, kb, q);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (v, &a) in acc_r.iter().enumerate() {
                _mm512_storeu_ps(st.add(r * BR + v * L), a);
                mx[v] = _mm512_max_ps(mx[v], a);
            }
        }
    }
}

/// The online softmax over one tile of `bc` keys: the running maximum `m`, the
/// rescale factor `alpha` of the output so far, the running sum `l`, and the
/// probabilities rounded into pair words of keys (2t, 2t + 1) at `pt` (a missing
/// last key of an odd tile pairs as zero). `tile_max`, when given, is the maximum
/// of the tile's scores per query vector; else it is read from `st`.
///
/// SAFETY: `bc` rows of BR floats at `st`, BR floats at `m`, `l`, `alpha`,
/// `bc.div_ceil(2)` rows of BR words at `pt`; AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn softmax_step(
    st: *mut f32,
    bc: usize,
    tile_max: Option<[__m512; NV]>,
    m: *mut f32,
    l: *mut f32,
    alpha: *mut f32,
    pt: *mut u32,
) {
    unsafe {
        // Interleaves two rows' 16 bf16 values (low half-words, then high) into pair words.
        let zip: [u16; 32] = std::array::from_fn(|x| if x % 2 == 0 { (x / 2) as u16 } else { (16 + x / 2) as u16 });
        let zip = _mm512_loadu_si512(zip.as_ptr() as *const __m512i);
        let pairs = |lo: __m512, hi: __m512| -> __m512i {
            _mm512_permutexvar_epi16(zip, std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)))
        };
        for v in 0..NV {
            let o = v * L;
            let m_old = Avx512::load(m.add(o));
            let mx = match tile_max {
                Some(t) => Avx512::max(m_old, t[v]),
                None => (0..bc).fold(m_old, |mx, jj| Avx512::max(mx, Avx512::load(st.add(jj * BR + o)))),
            };
            let a = Avx512::exp2(Avx512::sub(m_old, mx));
            let mut sum = _mm512_setzero_ps();
            for t in 0..bc.div_ceil(2) {
                let p0 = exp2_nonpositive(Avx512::sub(Avx512::load(st.add(2 * t * BR + o)), mx));
                let p1 = if 2 * t + 1 < bc {
                    exp2_nonpositive(Avx512::sub(Avx512::load(st.add((2 * t + 1) * BR + o)), mx))
                } else {
                    _mm512_setzero_ps()
                };
                sum = Avx512::add(sum, Avx512::add(p0, p1));
                _mm512_storeu_si512(pt.add(t * BR + o) as *mut __m512i, pairs(p0, p1));
            }
            Avx512::store(l.add(o), Avx512::fmadd(Avx512::load(l.add(o)), a, sum));
            Avx512::store(m.add(o), mx);
            Avx512::store(alpha.add(o), a);
        }
    }
}

/// 2^x for the probabilities, where x = score - running maximum <= 0: a degree-5
/// Taylor polynomial on [-1/2, 1/2] (2.4e-6 relative error, a thousandth of the bf16
/// rounding the probabilities get next) and no clamp at the top, which x never
/// reaches: 10 vector operations where the full-range [`Simd::exp2`] takes 13. A NaN
/// (a query with every key masked so far: -inf - -inf) reads as -126, so as ~0.
/// `bench kernels --only attn_self`, alternated: 0.067 s with `Simd::exp2`, 0.065
/// with this, 0.062 with degree 4 (4e-5). SD 1.5's bf16 UNet error against f32 at 512
/// px (`bench speed`) read 8.7e-3, 8.1e-3 and 9.4e-3 with the three: that measure
/// moves by that much with any perturbation of the roundings, so degree 5 is kept
/// for its margin to the 1e-2 bar, not for a proven gain in accuracy.
///
/// SAFETY: AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn exp2_nonpositive(x: __m512) -> __m512 {
    // The first six of the full-range polynomial's Taylor coefficients.
    let c = &EXP2_C[..6];
    unsafe {
        let x = _mm512_max_ps(x, _mm512_set1_ps(EXP2_MIN));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let f = _mm512_sub_ps(x, n);
        let mut p = _mm512_set1_ps(c[5]);
        for &k in c[..5].iter().rev() {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(k));
        }
        _mm512_scalef_ps(p, n)
    }
}

/// `ot[r][lanes] = ot[r][lanes] * alpha[lanes] + sum_t v[t][r] . pt[t][lanes]`
/// for R head dimensions over `bc2` key pairs (`v` rows are `d` words apart).
///
/// SAFETY: `bc2` rows of `d` words from `v` (R used), `bc2` rows of BR words at `pt`,
/// R rows of BR floats at `ot`, BR floats at `alpha`; AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pv_block<const R: usize>(
    v: *const u32,
    d: usize,
    pt: *const u32,
    bc2: usize,
    alpha: *const f32,
    ot: *mut f32,
) {
    unsafe {
        let al: [__m512; NV] = std::array::from_fn(|i| _mm512_loadu_ps(alpha.add(i * L)));
        let mut acc: [[__m512; NV]; R] =
            std::array::from_fn(|r| std::array::from_fn(|i| _mm512_mul_ps(_mm512_loadu_ps(ot.add(r * BR + i * L)), al[i])));
        for t in 0..bc2 {
            let p: [__m512bh; NV] =
                std::array::from_fn(|i| std::mem::transmute(_mm512_loadu_si512(pt.add(t * BR + i * L) as *const __m512i)));
            let vrow = v.add(t * d);
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let vb: __m512bh = std::mem::transmute(_mm512_set1_epi32(*vrow.add(r) as i32));
                for (a, &pp) in acc_r.iter_mut().zip(p.iter()) {
                    *a = _mm512_dpbf16_ps(*a, vb, pp);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (i, &a) in acc_r.iter().enumerate() {
                _mm512_storeu_ps(ot.add(r * BR + i * L), a);
            }
        }
    }
}
