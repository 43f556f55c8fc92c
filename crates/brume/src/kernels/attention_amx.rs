//! Fused attention on AMX tiles: bf16 products, f32 softmax and sums.
//!
//! The scheme of [`super::flash_attention`] (one head and a tile of queries per task,
//! keys streamed in tiles, an online softmax, no `n_q x n_k` buffer), with both
//! products on the tiles: scores S = Q K^T for 32 queries x 32 keys, then O += P V.
//! Queries are rounded to bf16 with the softmax scale and log2(e) folded in, K and
//! V once per call into per-head panels of 32 keys (each step's tile loads read 2 KiB
//! in a row); the probabilities P are rounded to bf16 as they become the left factor
//! of P V. Maximum, exponentials and sums stay f32 (AVX-512), as does the output,
//! kept in memory because a tile cannot be rescaled in place: each key tile's P V
//! lands in a scratch tile and is added to O after O is scaled by the maximum's growth.
//!
//! The head dimension is padded with zeros to a multiple of 32 (SD 1.5's 40 becomes
//! 64); keys past `n_k` and, for causal attention, keys after a query score -inf.
//! The probabilities are split into a bf16 value and the bf16 of what it rounded off,
//! and P V runs on both (a quarter more tile work): P's rounding alone took a bf16 SD
//! 1.5 step's error past 1e-2. `--compute bf16` runs it on CPUs with AMX (see
//! [`super::amx::attention_enabled`]); what is left is the rounding of q, k and v.

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::flash_attention::{checked_inputs, strides3};
use super::SharedMut;

/// Queries per task and keys per tile: one 2 x 2 block of 16 x 16 tiles.
const T: usize = 32;
/// Key tiles per softmax step (128 keys).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const G: usize = 4;

/// `softmax(q k^T * scale) v` on AMX tiles; the contract of
/// [`super::flash_attention::flash_attention`] (`q` [b, h, n_q, d], `k` and `v`
/// [b, h, n_k, d], f32 CPU tensors; the result a transposed view of a contiguous
/// [b, n_q, h, d] buffer).
pub fn attention_amx(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    if !super::amx::supported() {
        candle_core::bail!("AMX attention needs a CPU with AMX-BF16 and the OS's tile state");
    }
    let unit = |t: &Tensor| {
        if t.stride().last() == Some(&1) {
            Ok(t.clone())
        } else {
            t.contiguous()
        }
    };
    let (q, k, v) = (unit(q)?, unit(k)?, unit(v)?);
    q.apply_op3_no_bwd(&k, &v, &AmxAttention { scale: scale as f32, causal })?.transpose(1, 2)
}

struct AmxAttention {
    scale: f32,
    causal: bool,
}

/// One input's pointer (at its start offset) and batch, head and token strides.
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct View {
    p: *const f32,
    s: [usize; 3],
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl View {
    /// Row `i` of head `bh` (= batch * heads + head).
    ///
    /// SAFETY: the view was bounds-checked; b, h and i are in range.
    unsafe fn row(&self, heads: usize, bh: usize, i: usize) -> *const f32 {
        unsafe { self.p.add((bh / heads) * self.s[0] + (bh % heads) * self.s[1] + i * self.s[2]) }
    }
}

/// The sizes of one call.
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Dims {
    heads: usize,
    nq: usize,
    nk: usize,
    d: usize,
    /// d padded to whole K steps of 32.
    dp: usize,
    /// Key tiles of 32.
    kt: usize,
}

impl CustomOp3 for AmxAttention {
    fn name(&self) -> &'static str {
        "brume-amx-attention"
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
        // SAFETY (all three): start offsets lie inside their buffers (check_bounds).
        let (qv, kv, vv) = unsafe {
            (
                View { p: q.as_ptr().add(l1.start_offset()), s: strides3(l1, "q")? },
                View { p: k.as_ptr().add(l2.start_offset()), s: strides3(l2, "k")? },
                View { p: v.as_ptr().add(l3.start_offset()), s: strides3(l3, "v")? },
            )
        };
        let dims = Dims { heads: h, nq, nk, d, dp: d.div_ceil(T) * T, kt: nk.div_ceil(T) };
        let mut out = vec![0f32; out_shape.elem_count()];
        imp::run(qv, kv, vv, b * h, dims, self.scale * std::f32::consts::LOG2_E, self.causal, SharedMut(out.as_mut_ptr()));
        Ok((CpuStorage::F32(out), out_shape))
    }
}

// SAFETY: the views are only read, each task reading rows of its own heads; the
// buffers outlive the parallel loops.
unsafe impl Send for View {}
// SAFETY: as above.
unsafe impl Sync for View {}

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::arch::x86_64::*;

    use rayon::prelude::*;

    use super::super::amx::imp::{step, store, zero, Tiles};
    use super::super::bf16::{pack_pairs, round_into};
    use super::super::simd::{Avx512, Simd};
    use super::super::SharedMut;
    use super::{Dims, View, G, T};

    /// Every head's K as the right factor of Q K^T, per key tile: dp / 2 rows of 32
    /// words (K[j][2p], K[j][2p + 1]) for the tile's keys j; and V as the right factor
    /// of P V, per key tile and per 32 columns of d: 16 rows of 32 words (V[2p][c],
    /// V[2p + 1][c]). Zeros past n_k and d.
    fn pack_kv(k: View, v: View, bh: usize, g: Dims) -> (Vec<u32>, Vec<u32>) {
        let (half, passes) = (g.dp / 2, g.dp / T);
        let kpanel = half * T;
        let vpanel = passes * 16 * T;
        let mut kp = vec![0u32; bh * g.kt * kpanel];
        let mut vp = vec![0u32; bh * g.kt * vpanel];
        kp.par_chunks_mut(kpanel).zip(vp.par_chunks_mut(vpanel)).enumerate().for_each(|(t, (kpan, vpan))| {
            let (head, jt) = (t / g.kt, t % g.kt);
            let keys = T.min(g.nk - jt * T);
            let mut words = vec![0u32; half];
            for jj in 0..keys {
                // SAFETY: key jt * 32 + jj < nk of head `head` (< bh); d values per row;
                // AVX512-BF16 was checked by `amx::supported`; `words` holds dp >= d values.
                unsafe {
                    let row = std::slice::from_raw_parts(k.row(g.heads, head, jt * T + jj), g.d);
                    words.fill(0);
                    round_into(row, words.as_mut_ptr() as *mut u16);
                }
                for (p, &w) in words.iter().enumerate() {
                    kpan[p * T + jj] = w;
                }
            }
            for p in 0..keys.div_ceil(2) {
                let (j0, j1) = (jt * T + 2 * p, jt * T + 2 * p + 1);
                for pass in 0..passes {
                    let (c0, cols) = (pass * T, T.min(g.d.saturating_sub(pass * T)));
                    if cols == 0 {
                        continue;
                    }
                    // SAFETY: keys j0 (and j1 when < nk) exist; columns c0..c0 + cols <= d;
                    // the panel row has 32 >= cols words; AVX-512 F and BW.
                    unsafe {
                        let lo = std::slice::from_raw_parts(v.row(g.heads, head, j0).add(c0), cols);
                        let hi = (j1 < g.nk).then(|| std::slice::from_raw_parts(v.row(g.heads, head, j1).add(c0), cols));
                        pack_pairs(lo, hi, vpan.as_mut_ptr().add((pass * 16 + p) * T));
                    }
                }
            }
        });
        (kp, vp)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(q: View, k: View, v: View, bh: usize, g: Dims, scale2: f32, causal: bool, out: SharedMut) {
        let (kp, vp) = pack_kv(k, v, bh, g);
        let qtiles = g.nq.div_ceil(T);
        let (kp, vp) = (&kp, &vp);
        (0..bh * qtiles).into_par_iter().for_each(|t| {
            let (head, qt) = (t / qtiles, t % qtiles);
            // SAFETY: AMX was granted (`amx::supported`, checked by the caller); the task
            // reads head `head`'s rows and writes only its output rows of queries qt * 32...
            unsafe { task(q, kp, vp, g, head, qt * T, scale2, causal, out) };
        });
    }

    /// Head `head`, queries q0..q0 + 32 against every key tile.
    ///
    /// SAFETY: AMX tiles granted; AVX-512; `kp`, `vp` packed by `pack_kv` for `g`;
    /// `out` the [b, n_q, heads, d] output, of which only this task's rows are written.
    #[target_feature(enable = "avx512f,avx512bf16,avx512bw,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn task(q: View, kp: &[u32], vp: &[u32], g: Dims, head: usize, q0: usize, scale2: f32, causal: bool, out: SharedMut) {
        let (half, passes, ks) = (g.dp / 2, g.dp / T, g.dp / T);
        let nvalid = T.min(g.nq - q0);
        // Q's panel: K step s is 32 rows of 32 bf16 at (s * 32 + r) * 32, scaled.
        let mut qpan = vec![0u16; ks * T * T];
        let mut row = vec![0f32; g.dp];
        let mut rq = vec![0u16; g.dp];
        for r in 0..nvalid {
            // SAFETY: query q0 + r < nq of this head; d values.
            let src = unsafe { std::slice::from_raw_parts(q.row(g.heads, head, q0 + r), g.d) };
            for (o, &x) in row.iter_mut().zip(src) {
                *o = x * scale2;
            }
            // SAFETY: AVX512-BF16; rq holds dp values.
            unsafe { round_into(&row[..g.d], rq.as_mut_ptr()) };
            for s in 0..ks {
                qpan[(s * T + r) * T..(s * T + r + 1) * T].copy_from_slice(&rq[s * T..(s + 1) * T]);
            }
        }
        // Scores and probabilities for G key tiles at a time: the softmax's reductions,
        // the rescale of O and the hand-over between tile stores and vector loads then
        // happen once per 128 keys, and P V accumulates four K steps in the tiles.
        let mut st = vec![0f32; T * G * T];
        let mut pt = vec![0u16; T * G * T];
        // What bf16 rounded off P: P V runs on both halves, so P's rounding never reaches O.
        let mut pl = vec![0u16; T * G * T];
        let mut ct = [0f32; T * T];
        let mut ot = vec![0f32; T * g.dp];
        let mut m = [f32::NEG_INFINITY; T];
        let mut l = [0f32; T];
        let mut alpha = [0f32; T];
        let last_q = q0 + nvalid - 1;
        let row = G * T;
        // SAFETY: the caller's grant.
        let _tiles = unsafe { Tiles::configure() };
        let mut jt0 = 0;
        while jt0 < g.kt {
            let j0 = jt0 * T;
            if causal && j0 > last_q {
                break;
            }
            let tiles = G.min(g.kt - jt0);
            // S = Q K^T for these key tiles.
            for t in 0..tiles {
                // SAFETY: the Q panel holds ks steps of 2 KiB; K's panel of tile jt0 + t holds
                // dp / 2 rows of 128 bytes (16 per step); st holds 32 rows of G * 32 f32.
                unsafe {
                    zero();
                    let kpan = kp.as_ptr().add((head * g.kt + jt0 + t) * half * T) as *const u8;
                    for s in 0..ks {
                        step((qpan.as_ptr() as *const u8).add(s * T * T * 2), T * 2, kpan.add(s * 16 * T * 4), T * 4);
                    }
                    store(st.as_mut_ptr().add(t * T) as *mut u8, row * 4);
                }
            }
            let keys = (tiles * T).min(g.nk - j0);
            // Online softmax per query row over these keys.
            for r in 0..T {
                // Keys past n_k, and causally after query q0 + r, are masked.
                let visible = if causal { keys.min((q0 + r + 1).saturating_sub(j0)) } else { keys };
                // SAFETY: st and pt hold 32 rows of G * 32; AVX-512 F, BF16 and BW.
                unsafe {
                    let sr = st.as_ptr().add(r * row);
                    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
                    let mut v = [ninf; 2 * G];
                    let mut mxv = ninf;
                    for (i, x) in v.iter_mut().enumerate().take(2 * tiles) {
                        let live = visible.saturating_sub(i * 16).min(16);
                        let mask: __mmask16 = if live == 16 { 0xFFFF } else { (1u16 << live) - 1 };
                        *x = _mm512_mask_loadu_ps(ninf, mask, sr.add(i * 16));
                        mxv = _mm512_max_ps(mxv, *x);
                    }
                    let mx = _mm512_reduce_max_ps(mxv).max(m[r]);
                    let prow = pt.as_mut_ptr().add(r * row);
                    if mx == f32::NEG_INFINITY {
                        // Nothing visible yet (cannot happen for a real query: key 0 is
                        // always visible); keep the row empty rather than make NaNs.
                        alpha[r] = 1.0;
                        std::ptr::write_bytes(prow, 0, row);
                        std::ptr::write_bytes(pl.as_mut_ptr().add(r * row), 0, row);
                        continue;
                    }
                    let mv = _mm512_set1_ps(mx);
                    let mut sum = _mm512_setzero_ps();
                    for i in 0..tiles {
                        let p0 = Avx512::exp2(_mm512_sub_ps(v[2 * i], mv));
                        let p1 = Avx512::exp2(_mm512_sub_ps(v[2 * i + 1], mv));
                        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
                        let hi = _mm512_cvtne2ps_pbh(p1, p0);
                        let bf: __m512i = std::mem::transmute(hi);
                        _mm512_storeu_si512(prow.add(i * T) as *mut __m512i, bf);
                        // hi back to f32 (bf16 is f32's top half), and the remainders.
                        let h0 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(bf))));
                        let h1 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64::<1>(bf))));
                        let lo: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(_mm512_sub_ps(p1, h1), _mm512_sub_ps(p0, h0)));
                        _mm512_storeu_si512(pl.as_mut_ptr().add(r * row + i * T) as *mut __m512i, lo);
                    }
                    let a = if m[r] == f32::NEG_INFINITY { 0.0 } else { (m[r] - mx).exp2() };
                    l[r] = l[r] * a + _mm512_reduce_add_ps(sum);
                    m[r] = mx;
                    alpha[r] = a;
                }
            }
            // O = O * alpha + P V, 32 columns of d at a time, the key tiles summed in the tiles.
            for pass in 0..passes {
                // SAFETY: P's step t is 32 rows of 64 bytes, G * 64 bytes apart; V's panel of
                // tile jt0 + t, pass `pass` is 16 rows of 128 bytes; ct holds 32 x 32 f32; ot
                // rows of dp hold columns pass * 32 + 32.
                unsafe {
                    zero();
                    for t in 0..tiles {
                        let vpan = vp.as_ptr().add(((head * g.kt + jt0 + t) * passes + pass) * 16 * T) as *const u8;
                        step((pt.as_ptr() as *const u8).add(t * T * 2), row * 2, vpan, T * 4);
                        step((pl.as_ptr() as *const u8).add(t * T * 2), row * 2, vpan, T * 4);
                    }
                    store(ct.as_mut_ptr() as *mut u8, T * 4);
                    for r in 0..T {
                        let o = ot.as_mut_ptr().add(r * g.dp + pass * T);
                        let av = _mm512_set1_ps(alpha[r]);
                        for half16 in 0..2 {
                            let op = o.add(half16 * 16);
                            let c = _mm512_loadu_ps(ct.as_ptr().add(r * T + half16 * 16));
                            _mm512_storeu_ps(op, _mm512_fmadd_ps(_mm512_loadu_ps(op), av, c));
                        }
                    }
                }
            }
            jt0 += tiles;
        }
        // out[b, q0 + r, h, :] = O[r, :d] / l[r]
        let (b, h) = (head / g.heads, head % g.heads);
        for r in 0..nvalid {
            let inv = 1.0 / l[r];
            // SAFETY: row (b, q0 + r, h) of d values lies inside the [b, nq, heads, d] output;
            // only this task writes it.
            unsafe {
                let dst = out.get().add(((b * g.nq + q0 + r) * g.heads + h) * g.d);
                for dd in 0..g.d {
                    *dst.add(dd) = ot[r * g.dp + dd] * inv;
                }
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod imp {
    use super::super::SharedMut;
    use super::{Dims, View};

    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(_: View, _: View, _: View, _: usize, _: Dims, _: f32, _: bool, _: SharedMut) {
        unreachable!("AMX is x86-64 only; `amx::supported` is false here")
    }
}
