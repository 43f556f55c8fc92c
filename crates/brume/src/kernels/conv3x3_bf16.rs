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
//! pixels in registers, 12 dot-products per 8 loads, in its row layout or, for
//! narrow and odd-width maps, its flat one with its blocked schedule
//! ([`super::conv3x3::FlatTasks`]).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::cell::RefCell;

use candle_core::Result;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::bf16::pack_pairs;
use super::bf16::require;
#[cfg(target_arch = "x86_64")]
use super::conv3x3::{flat_task, FlatPanel};
#[cfg(target_arch = "x86_64")]
use super::matmul::{load_block, store_block};
#[cfg(target_arch = "x86_64")]
use super::simd::Avx512;
#[cfg(target_arch = "x86_64")]
use super::conv3x3::{AllLanes, TapLanes};
use super::conv3x3::{with_sums, Dims, EdgeLanes, Flat, FlatTasks, RowTasks, OB};
use super::SharedMut;

/// Pixels per vector (16 f32 lanes, each fed by one bf16 pair).
const L: usize = 16;
const XB: usize = 2 * L;

thread_local! {
    static ROWS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

pub use super::bf16::supported;

/// `out` [b, o, h, w] = conv(`x`, `weights` [o, c, 3, 3]) with bf16 products: on
/// AMX tiles where the CPU has them ([`super::amx`]), else with `vdpbf16ps`.
pub(crate) fn run(x: &[f32], d: Dims, weights: &[f32], out: &mut [f32]) -> Result<()> {
    if super::amx::supported() {
        return super::amx::conv3x3(x, d, weights, out);
    }
    run_vector(x, d, weights, out)
}

/// A 3x3 kernel [o, c, 3, 3] rounded to bf16 channel pairs for [`run_packed`]:
/// `pairs[(oc * cp + p) * 9 + tap]` holds channel 2p low and 2p + 1 high (zero past
/// c). Half the f32 kernel's bytes. The layers keep one per in-place weight (see
/// [`crate::layers::mapped`]): rounding a 1280-channel kernel on every call read
/// 59 MB and wrote 29 MB for a product of 1.9 GFLOP at 8x8, more time than the
/// product itself on two cores.
pub struct PackedConvPairs {
    pairs: Vec<u32>,
    out_ch: usize,
    in_ch: usize,
}

impl PackedConvPairs {
    pub fn new(weights: &[f32], out_ch: usize, in_ch: usize) -> Result<Self> {
        require()?;
        if weights.len() != out_ch * in_ch * 9 {
            candle_core::bail!("conv3x3 bf16: {} weights for [{out_ch}, {in_ch}, 3, 3]", weights.len());
        }
        Ok(Self { pairs: pack_kernel(weights, out_ch, in_ch), out_ch, in_ch })
    }

    pub fn bytes(&self) -> usize {
        self.pairs.len() * 4
    }
}

/// The pair table of [`PackedConvPairs`]. The caller checked AVX512-BF16 and the length.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn pack_kernel(weights: &[f32], o: usize, c: usize) -> Vec<u32> {
    let cp = c.div_ceil(2);
    let mut pairs = vec![0u32; o * cp * 9];
    if cp == 0 {
        return pairs;
    }
    pairs.par_chunks_mut(cp * 9).enumerate().for_each(|(oc, row)| {
        let src = &weights[oc * c * 9..(oc + 1) * c * 9];
        for p in 0..cp {
            let lo = &src[2 * p * 9..(2 * p + 1) * 9];
            let hi = (2 * p + 1 < c).then(|| &src[(2 * p + 1) * 9..(2 * p + 2) * 9]);
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX512-BF16 (checked by the caller) implies F and BW; the row has 9 words from p * 9.
            unsafe {
                pack_pairs(lo, hi, row.as_mut_ptr().add(p * 9))
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (lo, hi, &row);
        }
    });
    pairs
}

/// As [`run`] with `vdpbf16ps` on zmm registers, whatever else the CPU has.
pub(crate) fn run_vector(x: &[f32], d: Dims, weights: &[f32], out: &mut [f32]) -> Result<()> {
    run_packed(x, d, &PackedConvPairs::new(weights, d.out_ch, d.in_ch)?, out)
}

/// As [`run_vector`] with the kernel already rounded into pairs.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub(crate) fn run_packed(x: &[f32], d: Dims, kernel: &PackedConvPairs, out: &mut [f32]) -> Result<()> {
    require()?;
    let Dims { batch, in_ch: c, out_ch: o, h, w } = d;
    if x.len() != batch * c * h * w || (kernel.out_ch, kernel.in_ch) != (o, c) || out.len() != batch * o * h * w {
        candle_core::bail!("conv3x3 bf16: buffer sizes do not match {d:?} (kernel [{}, {}])", kernel.out_ch, kernel.in_ch);
    }
    if batch * o * h * w == 0 {
        return Ok(());
    }
    let cp = c.div_ceil(2);
    let pairs = &kernel.pairs;
    if let Some(flat) = Flat::plan(batch, cp, h, w, XB, true) {
        run_flat(x, d, pairs, out, flat);
        return Ok(());
    }
    let split = RowTasks::new(batch, h, o.div_ceil(OB));
    let dst = SharedMut(out.as_mut_ptr());
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
            // SAFETY: the row has sw >= w + 2 words; the CPU has the features (caller).
            unsafe { pack_pairs(lo, hi, r.as_mut_ptr().add(1)) };
        }
    }
}

/// The input as `planes` zero-bordered planes of bf16 pair words per image in the flat
/// layout `flat` (channel 2p low, 2p + 1 high; planes past the channels stay zero):
/// what this kernel's flat path and the AMX conv read.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub(super) fn pack_flat_pairs(x: &[f32], d: Dims, flat: Flat, planes: usize) -> Vec<u32> {
    let Dims { in_ch: c, h, w, batch, .. } = d;
    let cp = c.div_ceil(2);
    let mut padded = vec![0u32; batch * planes * flat.plane];
    padded.par_chunks_mut(flat.plane).enumerate().for_each(|(plane, dst)| {
        let (n, p) = (plane / planes, plane % planes);
        if p >= cp {
            return;
        }
        let img = &x[n * c * h * w..(n + 1) * c * h * w];
        for y in 0..h {
            let lo = &img[((2 * p) * h + y) * w..((2 * p) * h + y + 1) * w];
            let hi = (2 * p + 1 < c).then(|| &img[((2 * p + 1) * h + y) * w..((2 * p + 1) * h + y + 1) * w]);
            let at = (y + 1) * flat.pitch + 1;
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the callers checked AVX512-BF16, which implies F and BW; the plane
            // has (h + 2) * pitch <= plane words, so w words from `at` fit.
            unsafe {
                pack_pairs(lo, hi, dst.as_mut_ptr().add(at))
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (lo, hi, at, &dst);
        }
    });
    padded
}

/// The flat layout (see [`Flat`]): the input once as zero-bordered planes of bf16
/// pairs, then the blocked schedule of [`FlatTasks`] (a panel is PANEL channel pairs).
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn run_flat(x: &[f32], d: Dims, pairs: &[u32], out: &mut [f32], flat: Flat) {
    let cp = d.in_ch.div_ceil(2);
    let padded = pack_flat_pairs(x, d, flat, cp);
    let tasks = FlatTasks::new(d.batch, d.out_ch, flat);
    let dst = SharedMut(out.as_mut_ptr());
    let masks = flat.edge_masks(XB);
    let panel = PairPanel { img: &padded, pairs, d, f: flat, masks: &masks };
    (0..tasks.tasks()).into_par_iter().for_each(|t| {
        let Some((obs, q)) = tasks.task(t) else { return };
        with_sums(|sums| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX512-BF16 (checked by `run_packed`); task t writes only the
            // positions of blocks q for the channels of obs, disjoint from other tasks.
            unsafe {
                flat_pairs(&panel, obs, q, sums, dst)
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (&panel, obs, q, sums, dst);
        });
    });
}

/// SAFETY: as [`flat_task`]; AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
unsafe fn flat_pairs(panel: &PairPanel, obs: std::ops::Range<usize>, q: std::ops::Range<usize>, sums: &mut Vec<f32>, dst: SharedMut) {
    // SAFETY: forwarded from the caller.
    unsafe { flat_task(panel, panel.d, panel.f, panel.d.in_ch.div_ceil(2), obs, q, sums, dst) }
}

/// The bf16 kernel's panel: every image's zero-bordered pair planes (`img`, cp planes
/// of `f.plane` words per image), the kernel's pair table and, per position block,
/// the lanes its kx = 0 and kx = 2 taps may load ([`Flat::edge_masks`]).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct PairPanel<'a> {
    img: &'a [u32],
    pairs: &'a [u32],
    d: Dims,
    f: Flat,
    masks: &'a [EdgeLanes],
}

#[cfg(target_arch = "x86_64")]
impl FlatPanel for PairPanel<'_> {
    const XB: usize = XB;

    #[inline(always)]
    unsafe fn panel(&self, n: usize, blk: usize, ob: usize, p0: usize, pc: usize, sums: *mut f32) {
        let (cp, o, f) = (self.d.in_ch.div_ceil(2), self.d.out_ch, self.f);
        let wrows: [*const u32; OB] = std::array::from_fn(|j| {
            let oc = (ob * OB + j).min(o - 1);
            // SAFETY: oc < o and p0 < cp: inside `pairs` (o * cp * 9 words).
            unsafe { self.pairs.as_ptr().add((oc * cp + p0) * 9) }
        });
        // SAFETY: the caller's contract: `sums` holds OB x XB floats, image n's planes
        // p0..p0 + pc lie in `img`; loads read plane[blk * XB + ky * pitch + kx ..][..XB],
        // inside each plane (blocks * XB + 2 * pitch + 2 words).
        unsafe {
            let mut acc = if p0 > 0 { load_block::<Avx512>(sums, XB, OB, XB) } else { [[_mm512_setzero_ps(); 2]; OB] };
            let planes = self.img.as_ptr().add((n * cp + p0) * f.plane);
            if f.dense {
                block(&mut acc, planes, f.plane, f.pitch, pc, &wrows, blk * XB, self.masks[blk]);
            } else {
                block(&mut acc, planes, f.plane, f.pitch, pc, &wrows, blk * XB, AllLanes);
            }
            store_block::<Avx512>(&acc, sums, XB, OB, XB);
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
            let mut acc = [[_mm512_setzero_ps(); 2]; OB];
            // SAFETY: loads read rows[p * 3 + ky][x0 + kx .. x0 + kx + 32] with
            // x0 + 32 <= wpad and kx <= 2: inside each sw = wpad + 2 row.
            unsafe { block(&mut acc, base, 3 * sw, sw, cp, &wrows, x0, AllLanes) };
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

/// Adds to `acc` six output channels x 32 pixels from `x0`, summed over `cp` channel
/// pairs and the taps: pair p's tap row ky starts `p * chan + ky * pitch` words into
/// `rows`, and its weights at `wrows[j] + p * 9`. Each tap's loads read the lanes
/// `taps` says (a dense flat layout's border columns read zero).
///
/// SAFETY: AVX512-BF16; for every p < cp and ky < 3, `rows` holds 34 words from
/// `p * chan + ky * pitch + x0` (those of the lanes `taps` loads); each `wrows[j]`
/// points at cp * 9 words.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn block<T: TapLanes>(acc: &mut [[__m512; 2]; OB], rows: *const u32, chan: usize, pitch: usize, cp: usize, wrows: &[*const u32; OB], x0: usize, taps: T) {
    // A macro, not a closure: a closure would not inherit this function's target
    // features, and its intrinsics would become calls.
    macro_rules! load {
        ($p:expr, $kx:expr, $first:expr) => {{
            let v = if T::ALL {
                _mm512_loadu_si512($p as *const __m512i)
            } else {
                _mm512_maskz_loadu_epi32(taps.lanes($kx, $first) as __mmask16, $p as *const i32)
            };
            std::mem::transmute::<__m512i, __m512bh>(v)
        }};
    }
    unsafe {
        let mut r = *acc;
        for p in 0..cp {
            let base = rows.add(p * chan + x0);
            for ky in 0..3 {
                let row = base.add(ky * pitch);
                for kx in 0..3 {
                    let a = load!(row.add(kx), kx, 0);
                    let b = load!(row.add(kx + L), kx, L);
                    let tap = p * 9 + ky * 3 + kx;
                    for j in 0..OB {
                        let wv: __m512bh = std::mem::transmute(_mm512_set1_epi32(*wrows[j].add(tap) as i32));
                        r[j][0] = _mm512_dpbf16_ps(r[j][0], a, wv);
                        r[j][1] = _mm512_dpbf16_ps(r[j][1], b, wv);
                    }
                }
            }
        }
        *acc = r;
    }
}

/// 3x3 / stride 1 / padding 1 convolution of `x` [b, c, h, w] with `w` [o, c, 3, 3]
/// (no bias), bf16 products and f32 sums with `vdpbf16ps` (the AMX kernel is
/// [`super::amx::conv3x3_amx`]); contiguous f32 CPU tensors (tests, benches).
pub fn conv3x3_bf16(x: &candle_core::Tensor, w: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    use candle_core::{CpuStorage, Storage};
    let (o, wc, kh, kw) = w.dims4()?;
    let c = x.dim(1)?;
    if (kh, kw) != (3, 3) || wc != c {
        candle_core::bail!("conv3x3 bf16: kernel {:?} does not fit input {:?}", w.dims(), x.dims());
    }
    let w = w.contiguous()?;
    let (sw, lw) = w.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(wdat)) = &*sw else {
        candle_core::bail!("conv3x3 bf16: f32 CPU tensors only");
    };
    let (wa, wb) = lw.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("strided kernel".into()))?;
    let kernel = PackedConvPairs::new(&wdat[wa..wb], o, c)?;
    drop(sw);
    conv3x3_bf16_packed(x, &kernel)
}

/// [`conv3x3_bf16`] with the kernel rounded into pairs beforehand, as a conv layer
/// keeps it: what `--compute bf16` runs per call (benches; packing a 1280-channel
/// kernel costs about as much as its product at 8x8).
pub fn conv3x3_bf16_packed(x: &candle_core::Tensor, kernel: &PackedConvPairs) -> Result<candle_core::Tensor> {
    use candle_core::{CpuStorage, Storage};
    let (b, c, h, wd) = x.dims4()?;
    let o = kernel.out_ch;
    if c != kernel.in_ch {
        candle_core::bail!("conv3x3 bf16: kernel [{o}, {}, 3, 3] does not fit input {:?}", kernel.in_ch, x.dims());
    }
    let x = x.contiguous()?;
    let (sx, lx) = x.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(xd)) = &*sx else {
        candle_core::bail!("conv3x3 bf16: f32 CPU tensors only");
    };
    let (xa, xb) = lx.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("strided input".into()))?;
    let mut out = vec![0f32; b * o * h * wd];
    run_packed(&xd[xa..xb], Dims { batch: b, in_ch: c, out_ch: o, h, w: wd }, kernel, &mut out)?;
    drop(sx);
    candle_core::Tensor::from_vec(out, (b, o, h, wd), x.device())
}
