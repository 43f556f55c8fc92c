//! The direct 3x3 convolution with bf16 products and f32 sums (AVX512-BF16).
//!
//! `vdpbf16ps` multiplies pairs of bf16 values and adds both products into an f32
//! lane: twice the multiply-adds of an f32 FMA per instruction. Pairs run along the
//! input channels, so the three scratch rows hold, per pixel, one 32-bit word with
//! channel 2p in its low half and channel 2p + 1 in its high half, and each weight
//! broadcast is the matching (w[o][2p][tap], w[o][2p + 1][tap]) pair. Activations
//! stay f32 in memory: rows are rounded to bf16 (to nearest even) as they are copied
//! into the scratch, weights once per call into a half-size pair table, and sums are
//! f32 throughout, so the only error is bf16's rounding of the two factors (relative
//! 2^-9 each), as in PyTorch's and OpenVINO's bf16 modes.
//!
//! Otherwise the loop is [`super::conv3x3`]'s: 6 output channels x 2 vectors of 16
//! pixels in registers, 12 dot-products per 8 loads.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::cell::RefCell;

use candle_core::Result;
use rayon::prelude::*;

use super::conv3x3::{Dims, RowTasks};
use super::SharedMut;

const OB: usize = 6;
/// Pixels per vector (16 f32 lanes, each fed by one bf16 pair).
const L: usize = 16;
const XB: usize = 2 * L;

thread_local! {
    static ROWS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// Whether this CPU has the bf16 dot-product instructions.
pub fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// f32 -> bf16 bits, rounded to nearest even (finite inputs; NaN stays NaN).
pub(crate) fn bf16_bits(x: f32) -> u32 {
    let b = x.to_bits();
    if x.is_nan() {
        return (b >> 16) | 0x40;
    }
    (b.wrapping_add(0x7FFF + ((b >> 16) & 1))) >> 16
}

/// `out` [b, o, h, w] = conv(`x`, `weights` [o, c, 3, 3]) with bf16 products.
pub(crate) fn run(x: &[f32], d: Dims, weights: &[f32], out: &mut [f32]) -> Result<()> {
    if !supported() {
        candle_core::bail!("bf16 compute needs a CPU with AVX512-BF16");
    }
    let Dims { batch, in_ch: c, out_ch: o, h, w } = d;
    if x.len() != batch * c * h * w || weights.len() != o * c * 9 || out.len() != batch * o * h * w {
        candle_core::bail!("conv3x3 bf16: buffer sizes do not match {d:?}");
    }
    if batch * o * h * w == 0 {
        return Ok(());
    }
    let cp = c.div_ceil(2);
    // pairs[(oc * cp + p) * 9 + tap]: channel 2p low, 2p + 1 high (zero past c).
    let mut pairs = vec![0u32; o * cp * 9];
    pairs.par_chunks_mut(cp * 9).enumerate().for_each(|(oc, row)| {
        for p in 0..cp {
            for tap in 0..9 {
                let lo = bf16_bits(weights[(oc * c + 2 * p) * 9 + tap]);
                let hi = if 2 * p + 1 < c { bf16_bits(weights[(oc * c + 2 * p + 1) * 9 + tap]) } else { 0 };
                row[p * 9 + tap] = lo | (hi << 16);
            }
        }
    });
    let split = RowTasks::new(batch, h, o.div_ceil(OB));
    let dst = SharedMut(out.as_mut_ptr());
    let pairs = &pairs;
    (0..split.tasks()).into_par_iter().for_each(|task| {
        let Some((n, y, blocks)) = split.task(task) else { return };
        let img = &x[n * c * h * w..(n + 1) * c * h * w];
        ROWS.with(|cell| {
            let mut buf = cell.borrow_mut();
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has AVX512-BF16 (checked above); the task writes only row y
            // of image n for the channels of blocks first..last, disjoint from other tasks.
            unsafe {
                output_row(img, d, n, y, pairs, blocks.clone(), &mut buf, dst)
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (img, &mut buf, dst, n, y, &blocks);
        });
    });
    Ok(())
}

/// Fills `rows` with the bf16 pairs of input rows y - 1, y, y + 1 (zero borders).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn fill_rows(img: &[f32], d: Dims, y: usize, sw: usize, rows: &mut [u32]) {
    let (c, h, w) = (d.in_ch, d.h, d.w);
    let cp = c.div_ceil(2);
    unsafe {
        let round = _mm512_set1_epi32(0x7FFF);
        let one = _mm512_set1_epi32(1);
        let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        // bf16 of 16 floats, left in the high half of each 32-bit lane.
        let to_bf16_high = |v: __m512i| -> __m512i {
            let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(v), one);
            _mm512_and_si512(_mm512_add_epi32(v, _mm512_add_epi32(round, odd)), high)
        };
        for p in 0..cp {
            for ky in 0..3 {
                let r = &mut rows[(p * 3 + ky) * sw..(p * 3 + ky + 1) * sw];
                let iy = y as isize + ky as isize - 1;
                r.fill(0);
                if iy < 0 || iy >= h as isize {
                    continue;
                }
                let iy = iy as usize;
                let lo = &img[((2 * p) * h + iy) * w..((2 * p) * h + iy + 1) * w];
                let hi = (2 * p + 1 < c).then(|| &img[((2 * p + 1) * h + iy) * w..((2 * p + 1) * h + iy + 1) * w]);
                let mut x = 0;
                while x < w {
                    let m: __mmask16 = if w - x >= L { 0xFFFF } else { (1u16 << (w - x)) - 1 };
                    let a = _mm512_maskz_loadu_epi32(m, lo.as_ptr().add(x) as *const i32);
                    let b = match hi {
                        Some(hi) => _mm512_maskz_loadu_epi32(m, hi.as_ptr().add(x) as *const i32),
                        None => _mm512_setzero_si512(),
                    };
                    let pair = _mm512_or_si512(_mm512_srli_epi32::<16>(to_bf16_high(a)), to_bf16_high(b));
                    _mm512_mask_storeu_epi32(r.as_mut_ptr().add(1 + x) as *mut i32, m, pair);
                    x += L;
                }
            }
        }
    }
}

/// Output row `y` of image `n` for channel blocks `blocks`.
///
/// SAFETY: the CPU has AVX512-BF16; `dst` is the whole [b, o, h, w] output, of which
/// this call writes only row `y` of image `n`'s channels in `blocks`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
#[allow(clippy::too_many_arguments)]
unsafe fn output_row(img: &[f32], d: Dims, n: usize, y: usize, pairs: &[u32], blocks: std::ops::Range<usize>, buf: &mut Vec<u32>, dst: SharedMut) {
    let (c, o, h, w) = (d.in_ch, d.out_ch, d.h, d.w);
    let cp = c.div_ceil(2);
    let wpad = w.div_ceil(XB) * XB;
    let sw = wpad + 2;
    let need = cp * 3 * sw;
    if buf.len() < need {
        buf.resize(need, 0);
    }
    let rows = &mut buf[..need];
    // SAFETY: forwarded; rows holds cp * 3 rows of sw words.
    unsafe { fill_rows(img, d, y, sw, rows) };
    let base = rows.as_ptr();
    let mut tail = [0f32; XB];
    for blk in blocks {
        let wrows: [*const u32; OB] = std::array::from_fn(|j| {
            let oc = (blk * OB + j).min(o - 1);
            // SAFETY: oc < o: the row lies inside `pairs` (o * cp * 9 words).
            unsafe { pairs.as_ptr().add(oc * cp * 9) }
        });
        let mut x0 = 0;
        while x0 < w {
            // SAFETY: loads read rows[p * 3 + ky][x0 + kx .. x0 + kx + 32] with
            // x0 + 32 <= wpad and kx <= 2: inside each sw = wpad + 2 row.
            let acc = unsafe { block(base, sw, cp, &wrows, x0) };
            let count = XB.min(w - x0);
            for (j, a) in acc.iter().enumerate() {
                let oc = blk * OB + j;
                if oc >= o {
                    break;
                }
                // SAFETY: image n, channel oc < o, row y, columns x0..x0 + count <= w.
                unsafe {
                    let p = dst.get().add(((n * o + oc) * h + y) * w + x0);
                    if count == XB {
                        _mm512_storeu_ps(p, a[0]);
                        _mm512_storeu_ps(p.add(L), a[1]);
                    } else {
                        _mm512_storeu_ps(tail.as_mut_ptr(), a[0]);
                        _mm512_storeu_ps(tail.as_mut_ptr().add(L), a[1]);
                        std::ptr::copy_nonoverlapping(tail.as_ptr(), p, count);
                    }
                }
            }
            x0 += XB;
        }
    }
}

/// Six output channels x 32 pixels from `x0`, summed over all channel pairs and taps.
///
/// SAFETY: AVX512-BF16; `rows` holds cp * 3 rows of `sw` words with x0 + 34 <= sw;
/// each `wrows[j]` points at cp * 9 words.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
#[inline]
unsafe fn block(rows: *const u32, sw: usize, cp: usize, wrows: &[*const u32; OB], x0: usize) -> [[__m512; 2]; OB] {
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 2]; OB];
        for p in 0..cp {
            let base = rows.add(p * 3 * sw + x0);
            for ky in 0..3 {
                let row = base.add(ky * sw);
                for kx in 0..3 {
                    let a: __m512bh = std::mem::transmute(_mm512_loadu_si512(row.add(kx) as *const __m512i));
                    let b: __m512bh = std::mem::transmute(_mm512_loadu_si512(row.add(kx + L) as *const __m512i));
                    let tap = p * 9 + ky * 3 + kx;
                    for j in 0..OB {
                        let wv: __m512bh = std::mem::transmute(_mm512_set1_epi32(*wrows[j].add(tap) as i32));
                        acc[j][0] = _mm512_dpbf16_ps(acc[j][0], a, wv);
                        acc[j][1] = _mm512_dpbf16_ps(acc[j][1], b, wv);
                    }
                }
            }
        }
        acc
    }
}

/// 3x3 / stride 1 / padding 1 convolution of `x` [b, c, h, w] with `w` [o, c, 3, 3]
/// (no bias), bf16 products and f32 sums; contiguous f32 CPU tensors (tests, benches).
pub fn conv3x3_bf16(x: &candle_core::Tensor, w: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    use candle_core::{CpuStorage, Storage};
    let (o, wc, kh, kw) = w.dims4()?;
    let (b, c, h, wd) = x.dims4()?;
    if (kh, kw) != (3, 3) || wc != c {
        candle_core::bail!("conv3x3 bf16: kernel {:?} does not fit input {:?}", w.dims(), x.dims());
    }
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let (sx, lx) = x.storage_and_layout();
    let (sw, lw) = w.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(xd)), Storage::Cpu(CpuStorage::F32(wdat))) = (&*sx, &*sw) else {
        candle_core::bail!("conv3x3 bf16: f32 CPU tensors only");
    };
    let (xa, xb) = lx.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("strided input".into()))?;
    let (wa, wb) = lw.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("strided kernel".into()))?;
    let mut out = vec![0f32; b * o * h * wd];
    run(&xd[xa..xb], Dims { batch: b, in_ch: c, out_ch: o, h, w: wd }, &wdat[wa..wb], &mut out)?;
    drop((sx, sw));
    candle_core::Tensor::from_vec(out, (b, o, h, wd), x.device())
}
