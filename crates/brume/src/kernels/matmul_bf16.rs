//! The layers' matrix product with bf16 products and f32 sums (AVX512-BF16).
//!
//! [`super::matmul`]'s block (6 rows of A x 2 vectors of B's columns in registers)
//! with `vdpbf16ps`: pairs run along k, so A is rounded once per call into a table
//! of (A[i][2p], A[i][2p + 1]) words — adjacent values, half A's f32 size — and each
//! task packs B's panel as pairs (B[2p][j], B[2p + 1][j]) per column. Sums are f32;
//! the error is bf16's rounding of the two factors, as in [`super::conv3x3_bf16`].

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::cell::RefCell;

use candle_core::Result;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::bf16::{pack_pairs, round_into};
use super::bf16::supported;
use super::matmul::{check, BLayout, Split};
use super::SharedMut;

/// Rows of A per register block (as in [`super::matmul`], whose task split this uses).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const MR: usize = 6;
const L: usize = 16;
const NR: usize = 2 * L;
/// Pairs of k per packed panel: 128 x 32 words = 16 KB, an L1-resident panel.
const KCP: usize = 128;

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

/// As [`gemm`] with `vdpbf16ps` on zmm registers, whatever else the CPU has.
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub(crate) fn gemm_vector(m: usize, n: usize, k: usize, a: &[f32], lda: usize, b: &[f32], bl: BLayout, dst: &mut [f32]) -> Result<()> {
    if !supported() {
        candle_core::bail!("bf16 compute needs a CPU with AVX512-BF16");
    }
    if !check(m, n, k, a, lda, b, bl, dst)? {
        return Ok(());
    }
    let kp = k.div_ceil(2);
    // A as bf16 pairs along k, zero past k.
    let mut ap = vec![0u32; m * kp];
    ap.par_chunks_mut(kp).enumerate().for_each(|(i, row)| {
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
    let split = Split::new(m, n, NR);
    let out = SharedMut(dst.as_mut_ptr());
    let ap = &ap;
    (0..split.tasks()).into_par_iter().for_each(|t| {
        let (rows, cols) = split.task(t);
        if cols.is_empty() {
            return;
        }
        PANEL.with(|cell| {
            let mut panel = cell.borrow_mut();
            if panel.len() < KCP * NR {
                panel.resize(KCP * NR, 0);
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX512-BF16 checked above; the task writes only dst rows `rows` x
            // columns `cols`, disjoint from other tasks and inside dst.
            unsafe {
                task(m, n, k, ap, b, bl, rows, cols, &mut panel, out)
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (rows, cols, &mut panel, out);
        });
    });
    Ok(())
}

/// SAFETY: AVX512-BF16; `out` is the m x n output of which only `rows` x `cols` is written.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
#[allow(clippy::too_many_arguments)]
unsafe fn task(
    m: usize,
    n: usize,
    k: usize,
    ap: &[u32],
    b: &[f32],
    bl: BLayout,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    panel: &mut [u32],
    out: SharedMut,
) {
    let kp = k.div_ceil(2);
    let mut tail = [0f32; NR];
    let mut j0 = cols.start;
    while j0 < cols.end {
        let w = NR.min(n - j0);
        let mut p0 = 0;
        while p0 < kp {
            let pc = KCP.min(kp - p0);
            let panel = &mut panel[..pc * NR];
            // panel[pp * NR + j] = (B[2p][j0 + j], B[2p + 1][j0 + j]) for p = p0 + pp, zeros past w / k.
            match bl {
                BLayout::KN { ld } => {
                    for pp in 0..pc {
                        let (kk, dst) = (2 * (p0 + pp), &mut panel[pp * NR..(pp + 1) * NR]);
                        let lo = &b[kk * ld + j0..kk * ld + j0 + w];
                        let hi = (kk + 1 < k).then(|| &b[(kk + 1) * ld + j0..(kk + 1) * ld + j0 + w]);
                        // SAFETY: AVX-512 F and BW (the caller's features); dst has NR >= w words.
                        unsafe { pack_pairs(lo, hi, dst.as_mut_ptr()) };
                        dst[w..].fill(0);
                    }
                }
                BLayout::NK { ld } => {
                    // Column j of B is row j0 + j of the [n, k] matrix: its k values
                    // 2 p0.. are adjacent, so they round straight into pair words.
                    let mut col = [0u32; KCP];
                    let (k0, k1) = (2 * p0, (2 * (p0 + pc)).min(k));
                    if w < NR {
                        panel.fill(0);
                    }
                    for j in 0..w {
                        let at = (j0 + j) * ld;
                        col[..pc].fill(0);
                        // SAFETY: AVX512-BF16 (the caller's); col holds 2 * KCP >= k1 - k0 values.
                        unsafe { round_into(&b[at + k0..at + k1], col.as_mut_ptr() as *mut u16) };
                        for (pp, &v) in col[..pc].iter().enumerate() {
                            panel[pp * NR + j] = v;
                        }
                    }
                }
            }
            let strip = panel.as_ptr();
            let mut i0 = rows.start;
            while i0 < rows.end {
                let arows: [*const u32; MR] = std::array::from_fn(|i| {
                    let r = (i0 + i).min(m - 1);
                    // SAFETY: r < m; row r of the pair table has kp words, p0 < kp.
                    unsafe { ap.as_ptr().add(r * kp + p0) }
                });
                let live = MR.min(rows.end - i0);
                // SAFETY: rows i0..i0 + live < m, columns j0..j0 + w <= n: inside the output.
                let row_ptr = |i: usize| unsafe { out.get().add((i0 + i) * n + j0) };
                let mut acc = [[_mm512_setzero_ps(); 2]; MR];
                if p0 > 0 {
                    for (i, a) in acc.iter_mut().enumerate().take(live) {
                        // SAFETY: as for row_ptr; a short row goes through `tail`.
                        unsafe {
                            if w == NR {
                                *a = [_mm512_loadu_ps(row_ptr(i)), _mm512_loadu_ps(row_ptr(i).add(L))];
                            } else {
                                std::ptr::copy_nonoverlapping(row_ptr(i), tail.as_mut_ptr(), w);
                                *a = [_mm512_loadu_ps(tail.as_ptr()), _mm512_loadu_ps(tail.as_ptr().add(L))];
                            }
                        }
                    }
                }
                // SAFETY: the strip holds pc pair-rows of NR words; each A pointer pc words.
                unsafe { block(&mut acc, &arows, strip, pc) };
                for (i, a) in acc.iter().enumerate().take(live) {
                    // SAFETY: as for row_ptr.
                    unsafe {
                        let d = row_ptr(i);
                        if w == NR {
                            _mm512_storeu_ps(d, a[0]);
                            _mm512_storeu_ps(d.add(L), a[1]);
                        } else {
                            _mm512_storeu_ps(tail.as_mut_ptr(), a[0]);
                            _mm512_storeu_ps(tail.as_mut_ptr().add(L), a[1]);
                            std::ptr::copy_nonoverlapping(tail.as_ptr(), d, w);
                        }
                    }
                }
                i0 += MR;
            }
            p0 += pc;
        }
        j0 += NR;
    }
}

/// SAFETY: AVX512-BF16; each `a[i]` points at `pc` pair words, `b` at pc x NR words.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
#[inline]
unsafe fn block(acc: &mut [[__m512; 2]; MR], a: &[*const u32; MR], b: *const u32, pc: usize) {
    unsafe {
        let mut r = *acc;
        for pp in 0..pc {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(pp * NR) as *const __m512i));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(pp * NR + L) as *const __m512i));
            for i in 0..MR {
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a[i].add(pp) as i32));
                r[i][0] = _mm512_dpbf16_ps(r[i][0], b0, av);
                r[i][1] = _mm512_dpbf16_ps(r[i][1], b1, av);
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
