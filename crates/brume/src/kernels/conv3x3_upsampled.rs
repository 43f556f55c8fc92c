//! The 3x3 convolution (padding 1) of a nearest-neighbour 2x upsampled map, the
//! `Upsample2D` of a UNet's up blocks and a VAE decoder, computed by output phases on
//! the half-size map.
//!
//! Output pixel (2i + py, 2j + px) reads the doubled map's rows 2i + py - 1 ..= 2i + py + 1,
//! which are half-size rows (i - 1, i, i) for py = 0 and (i, i, i + 1) for py = 1, and
//! the same for columns. So each of the four phases (py, px) is a 2x2 convolution of the
//! half-size map whose taps are sums of the 3x3 kernel's (py = 0: row 0, rows 1 + 2;
//! py = 1: rows 0 + 1, row 2): 16 products per input channel and 2x2 block of outputs
//! where the conv of the doubled map makes 36, 2.25x fewer. SD's 1280-channel
//! upsamplers at 16x16 and 32x32 run on the direct kernel (Winograd does not win
//! there), and they were 9 % of the SD 1.5 UNet's and 7 % of SDXS's products.
//!
//! Each image's half-size map is copied once, zero-bordered, so every task reads its
//! rows in place. Summed taps do 2.25x less work per tap read than the 3x3 ones, so a
//! row-at-a-time schedule that streams the kernel for every row (as the direct kernel
//! does, at ~90 % of the FMA peak) would wait on memory. So a task takes a group of
//! [`G`] blocks of six output channels, one row parity and a run of rows, and sums over
//! the input channels [`KC`] at a time: the group's summed taps for those channels (2 x
//! 24 per channel and block, 196 KB) stay in L2 across every row of the run, each row's
//! input stays in L1 across the group's blocks, and partial sums wait in a per-task
//! buffer. No copy of the kernel is ever whole. Sums are reassociated, so outputs differ
//! from the doubled map's conv by f32 rounding.

use super::conv3x3::{Dims, OB};
use super::simd::{Portable, Simd};
use super::{Isa, SharedMut};
use candle_core::{CpuStorage, Result, Tensor};
use rayon::prelude::*;
use std::cell::RefCell;

/// Input channels per pass over a task's rows.
const KC: usize = 256;

/// Output channel blocks (of OB) per task: their summed taps for [`KC`] channels, 4 x 2 x
/// 256 x 24 floats, are 196 KB, in L2 beside a row's input.
const G: usize = 4;

/// Most partial sums a task keeps (floats): 128 KB, so that they stay in L2 too.
const SUMS_MAX: usize = 32 * 1024;

thread_local! {
    /// A task's summed taps and partial sums.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// 0: not yet decided (read `BRUME_UPSAMPLE_PHASES` on first use), 1: off, 2: on.
static SWITCH: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Whether the direct kernel's upsampled convs run by phases: [`set_enabled`], else
/// `BRUME_UPSAMPLE_PHASES=off` runs the 3x3 taps over the doubled rows instead (to
/// compare one with the other).
pub fn enabled() -> bool {
    use std::sync::atomic::Ordering;
    match SWITCH.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("BRUME_UPSAMPLE_PHASES").map_or(true, |v| v != "off");
            let _ = SWITCH.compare_exchange(0, 1 + on as u8, Ordering::Relaxed, Ordering::Relaxed);
            enabled()
        }
        v => v == 2,
    }
}

/// Sets whether upsampled convs run by phases (process-wide, as the Winograd mode).
pub fn set_enabled(on: bool) {
    SWITCH.store(1 + on as u8, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`run`] takes `d` (the output's sizes): even maps on the row layout with at
/// least one whole vector of half-size columns (narrower ones would waste most lanes).
pub(crate) fn takes(isa: Isa, d: Dims) -> bool {
    d.h.is_multiple_of(2) && d.w.is_multiple_of(2) && d.w / 2 >= isa.lanes() && d.in_ch > 0 && d.out_ch > 0
}

/// A register block's shape on `isa` for half-size rows `ws` wide: (vectors per row,
/// rows). Twelve accumulators either way, so that each broadcast tap feeds two vectors:
/// two vectors of one row, or one vector of two rows where the rows are narrower than
/// two vectors (SD's 16x16 outputs on AVX2, 32x32 on AVX-512).
fn shape(isa: Isa, ws: usize) -> (usize, usize) {
    if ws >= 2 * isa.lanes() {
        (2, 1)
    } else {
        (1, 2)
    }
}

/// Half-size columns per register block on `isa` for rows `ws` wide.
fn span(isa: Isa, ws: usize) -> usize {
    shape(isa, ws).0 * isa.lanes()
}

/// The zero-bordered half-size map's sizes: (rows, row stride). One row of zeros more
/// than the border, so that a two-row block past an odd last row reads inside it.
fn padded(isa: Isa, d: Dims) -> (usize, usize) {
    let span = span(isa, d.w / 2);
    (d.h / 2 + 3, (d.w / 2).div_ceil(span) * span + 2)
}

/// [`run`]'s tasks per row parity and group of blocks: runs of half-size rows, enough
/// tasks in all for every thread and each run's partial sums within [`SUMS_MAX`].
/// Returns (rows per run, runs).
fn split(isa: Isa, d: Dims) -> (usize, usize) {
    let (hs, ws) = (d.h / 2, d.w / 2);
    let rb = shape(isa, ws).1;
    let groups = d.out_ch.div_ceil(OB).div_ceil(G);
    let per_row = sums_per_row(isa, ws);
    let runs = (4 * rayon::current_num_threads()).div_ceil(2 * groups).max(hs.div_ceil((SUMS_MAX / per_row).max(1))).clamp(1, hs.div_ceil(rb));
    let rows = hs.div_ceil(runs).next_multiple_of(rb);
    (rows, hs.div_ceil(rows))
}

/// Partial sums per half-size row of a task: both column phases of its group's
/// channels over the row's register blocks.
fn sums_per_row(isa: Isa, ws: usize) -> usize {
    ws.div_ceil(span(isa, ws)) * span(isa, ws) * 2 * G * OB
}

/// Bytes [`run`] holds beyond its output while it runs, on `isa` where it takes `d`:
/// one image's zero-bordered half-size map, and per busy thread one task's summed taps
/// and partial sums (~0.3 MB). The memory estimator counts them with the upsampler's conv.
pub(crate) fn scratch_bytes(isa: Isa, d: Dims) -> usize {
    if !(enabled() && takes(isa, d)) {
        return 0;
    }
    let (prows, stride) = padded(isa, d);
    let (rows, runs) = split(isa, d);
    let tasks = 2 * d.out_ch.div_ceil(OB).div_ceil(G) * runs;
    let per_task = G * 2 * KC.min(d.in_ch) * 4 * OB + rows * sums_per_row(isa, d.w / 2);
    4 * (d.in_ch * prows * stride + per_task * rayon::current_num_threads().min(tasks))
}

/// The 3x3 conv (padding 1) of the nearest 2x upsampling of `x` [b, c, h, w] with `w`
/// [o, c, 3, 3] (f32 CPU tensors) on `isa`, by the direct kernel: by output phases
/// where [`takes`] allows and `phases` asks, else with the 3x3 taps over the doubled
/// rows, as `BRUME_UPSAMPLE_PHASES=off` runs it (to time or test one against the other).
/// It borrows the tensors' values where `winograd::on_tensors` copies them: the example
/// that times it would otherwise time a copy of SD's 59 MB kernel with every call.
pub fn conv3x3_upsampled_on(isa: Isa, x: &Tensor, w: &Tensor, phases: bool) -> Result<Tensor> {
    super::require(isa)?;
    let (b, c, h, wd) = x.dims4()?;
    let (o, wc, kh, kw) = w.dims4()?;
    if (kh, kw) != (3, 3) || wc != c {
        candle_core::bail!("conv3x3 (upsampled): kernel {:?} does not fit input {:?}", w.dims(), x.dims());
    }
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (candle_core::Storage::Cpu(CpuStorage::F32(xd)), candle_core::Storage::Cpu(CpuStorage::F32(wdata))) = (&*xs, &*ws) else {
        candle_core::bail!("conv3x3 (upsampled): f32 CPU tensors only");
    };
    let slice = |d: &'_ [f32], l: &candle_core::Layout| -> Result<std::ops::Range<usize>> {
        let (a, b) = l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("conv3x3 (upsampled): strided tensor".into()))?;
        Ok(a..b.min(d.len()))
    };
    let (xr, wr) = (slice(xd, xl)?, slice(wdata, wl)?);
    let d = Dims { batch: b, in_ch: c, out_ch: o, h: 2 * h, w: 2 * wd };
    let mut out = vec![0f32; b * o * 4 * h * wd];
    d.check_upsampled("conv3x3", &xd[xr.clone()], &wdata[wr.clone()], &out)?;
    if phases && takes(isa, d) {
        run(isa, &xd[xr], d, &wdata[wr], &mut out);
    } else if d.needs_compute(&mut out) {
        super::conv3x3::rows(isa, &xd[xr], d, &wdata[wr], &mut out, true);
    }
    drop((xs, ws));
    Tensor::from_vec(out, (b, o, 2 * h, 2 * wd), &candle_core::Device::Cpu)
}

/// `out` [b, o, h, w] = conv(nearest 2x upsampling of `x` [b, c, h / 2, w / 2],
/// `weights` [o, c, 3, 3]), padding 1, by phases. The caller checked the buffers'
/// sizes (`Dims::check_upsampled`) and [`takes`].
pub(crate) fn run(isa: Isa, x: &[f32], d: Dims, weights: &[f32], out: &mut [f32]) {
    let Dims { batch, in_ch: c, out_ch: o, h, w } = d;
    let (hs, ws) = (h / 2, w / 2);
    let (prows, stride) = padded(isa, d);
    let (rows, runs) = split(isa, d);
    let groups = o.div_ceil(OB).div_ceil(G);
    let mut pad = vec![0f32; c * prows * stride];
    let dst = SharedMut(out.as_mut_ptr());
    for n in 0..batch {
        let img = &x[n * c * hs * ws..(n + 1) * c * hs * ws];
        // Half-size row r of channel ci at padded row r + 1, columns 1 ..= ws.
        pad.par_chunks_mut(prows * stride).zip(img.par_chunks(hs * ws)).for_each(|(p, src)| {
            for (r, line) in src.chunks_exact(ws).enumerate() {
                p[(r + 1) * stride + 1..(r + 1) * stride + 1 + ws].copy_from_slice(line);
            }
        });
        let pad = &pad[..];
        (0..groups * 2 * runs).into_par_iter().for_each(|t| {
            let (group, py, run) = (t / (2 * runs), (t / runs) % 2, t % runs);
            let blks = group * G..((group + 1) * G).min(o.div_ceil(OB));
            let first = run * rows;
            let job = Job { d, n, blks, py, rows: first..(first + rows).min(hs) };
            SCRATCH.with(|cell| {
                let (taps, sums) = &mut *cell.borrow_mut();
                // SAFETY: the task writes only image n's output channels of its blocks in
                // rows of parity py from its half-size rows, disjoint from every other
                // task's, inside `out` (b x o x h x w, checked by the caller).
                unsafe { task_on(isa, pad, weights, &job, taps, sums, dst) };
            });
        });
    }
}

/// What one task computes: image `n`'s output channel blocks `blks`, rows 2i + py for
/// half-size rows i in `rows`.
struct Job {
    d: Dims,
    n: usize,
    blks: std::ops::Range<usize>,
    py: usize,
    rows: std::ops::Range<usize>,
}

/// The summed taps of the job's blocks for input channels `k0 .. k0 + kc`: block gb
/// of the job, column parity px, channel ci - k0, 2x2 tap (a, b) and block-local
/// channel j at `(((gb * 2 + px) * kc + ci - k0) * 4 + a * 2 + b) * OB + j`, so that a
/// block reads one run of memory. Channels past `o` repeat the last one (computed,
/// never stored).
fn summed_taps(weights: &[f32], job: &Job, k0: usize, kc: usize, taps: &mut Vec<f32>) {
    let (c, o, py) = (job.d.in_ch, job.d.out_ch, job.py);
    taps.clear();
    taps.resize(job.blks.len() * 2 * kc * 4 * OB, 0.0);
    for (gb, blk) in job.blks.clone().enumerate() {
        for j in 0..OB {
            let oc = (blk * OB + j).min(o - 1);
            let kernel = &weights[(oc * c + k0) * 9..(oc * c + k0 + kc) * 9];
            for (ci, k) in kernel.chunks_exact(9).enumerate() {
                // Parity 0 sums kernel rows (0), (1, 2); parity 1 rows (0, 1), (2).
                let rows: [[f32; 3]; 2] = if py == 0 {
                    [[k[0], k[1], k[2]], [k[3] + k[6], k[4] + k[7], k[5] + k[8]]]
                } else {
                    [[k[0] + k[3], k[1] + k[4], k[2] + k[5]], [k[6], k[7], k[8]]]
                };
                for (a, r) in rows.iter().enumerate() {
                    // Then their columns, the same way for column parity px.
                    for (px, cols) in [[r[0], r[1] + r[2]], [r[0] + r[1], r[2]]].into_iter().enumerate() {
                        for (b, v) in cols.into_iter().enumerate() {
                            taps[(((gb * 2 + px) * kc + ci) * 4 + a * 2 + b) * OB + j] = v;
                        }
                    }
                }
            }
        }
    }
}

/// One task with the register block that fits the half-size rows ([`shape`]).
///
/// SAFETY: the CPU runs `isa`; as [`task`].
unsafe fn task_on(isa: Isa, pad: &[f32], weights: &[f32], job: &Job, taps: &mut Vec<f32>, sums: &mut Vec<f32>, dst: SharedMut) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => task_avx512(pad, weights, job, taps, sums, dst),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => task_avx2(pad, weights, job, taps, sums, dst),
            _ => match shape(isa, job.d.w / 2) {
                (2, _) => task::<Portable, 2, 1>(pad, weights, job, taps, sums, dst),
                _ => task::<Portable, 1, 2>(pad, weights, job, taps, sums, dst),
            },
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn task_avx512(pad: &[f32], weights: &[f32], job: &Job, taps: &mut Vec<f32>, sums: &mut Vec<f32>, dst: SharedMut) {
    use super::simd::Avx512;
    // SAFETY: forwarded from the caller.
    unsafe {
        match shape(Isa::Avx512, job.d.w / 2) {
            (2, _) => task::<Avx512, 2, 1>(pad, weights, job, taps, sums, dst),
            _ => task::<Avx512, 1, 2>(pad, weights, job, taps, sums, dst),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn task_avx2(pad: &[f32], weights: &[f32], job: &Job, taps: &mut Vec<f32>, sums: &mut Vec<f32>, dst: SharedMut) {
    use super::simd::Avx2;
    // SAFETY: forwarded from the caller.
    unsafe {
        match shape(Isa::Avx2, job.d.w / 2) {
            (2, _) => task::<Avx2, 2, 1>(pad, weights, job, taps, sums, dst),
            _ => task::<Avx2, 1, 2>(pad, weights, job, taps, sums, dst),
        }
    }
}

/// The job's output rows, by register blocks of R half-size rows x NV * LANES
/// half-size columns: per pass of [`KC`] input channels, the group's summed taps, then
/// every register block of every row, both column phases of every block of the group,
/// added to the partial sums; then the partial sums interleaved into the output rows.
///
/// SAFETY: the CPU has `S`'s features; `pad` is image n's zero-bordered half-size map
/// ([`padded`]'s sizes); `dst` points at the whole [b, o, h, w] output, of which this
/// call writes only the job's rows of image n's channels in its blocks.
#[inline(always)]
unsafe fn task<S: Simd, const NV: usize, const R: usize>(pad: &[f32], weights: &[f32], job: &Job, taps: &mut Vec<f32>, sums: &mut Vec<f32>, dst: SharedMut) {
    let Dims { in_ch: c, out_ch: o, h, w, .. } = job.d;
    let (hs, ws, py) = (h / 2, w / 2, job.py);
    let span = NV * S::LANES;
    let nt = ws.div_ceil(span);
    let stride = nt * span + 2;
    let plane = (hs + 3) * stride;
    debug_assert!(pad.len() >= c * plane);
    let nb = job.blks.len();
    // Partial sums of register block (ii, t), block gb, column parity px: OB x R x NV
    // vectors at ((ii * nt + t) * nb + gb) * 2 + px.
    let acc_len = OB * R * NV * S::LANES;
    let row_blocks = job.rows.len().div_ceil(R);
    sums.clear();
    sums.resize(row_blocks * nt * nb * 2 * acc_len, 0.0);
    for k0 in (0..c).step_by(KC) {
        let kc = KC.min(c - k0);
        summed_taps(weights, job, k0, kc, taps);
        for ii in 0..row_blocks {
            let i = job.rows.start + ii * R;
            for t in 0..nt {
                // SAFETY: output row 2i + py reads padded rows i + py + a + r (a < 2,
                // r < R: at most hs + 2 < hs + 3) from column t * span (+ px + b <= 2),
                // span values: inside the padded rows of nt * span + 2, from channel k0.
                let base = unsafe { pad.as_ptr().add(k0 * plane + (i + py) * stride + t * span) };
                for gb in 0..nb {
                    for px in 0..2 {
                        let at = (((ii * nt + t) * nb + gb) * 2 + px) * acc_len;
                        let acc_at = sums[at..at + acc_len].as_mut_ptr();
                        // SAFETY: `acc_at` holds acc_len = OB * R * NV * LANES values;
                        // the taps of (gb, px) are kc * 4 * OB values inside `taps`.
                        unsafe {
                            let mut acc: [[[S::V; NV]; R]; OB] = std::array::from_fn(|j| std::array::from_fn(|r| std::array::from_fn(|v| S::load(acc_at.add(((j * R + r) * NV + v) * S::LANES)))));
                            block::<S, NV, R>(&mut acc, base.add(px), stride, plane, kc, taps.as_ptr().add((gb * 2 + px) * kc * 4 * OB));
                            for (j, rows) in acc.iter().enumerate() {
                                for (r, vs) in rows.iter().enumerate() {
                                    for (v, &x) in vs.iter().enumerate() {
                                        S::store(acc_at.add(((j * R + r) * NV + v) * S::LANES), x);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    let out = dst.get();
    for ii in 0..row_blocks {
        for r in 0..R {
            let i = job.rows.start + ii * R + r;
            if i >= job.rows.end {
                break;
            }
            let y = 2 * i + py;
            for t in 0..nt {
                let (x0, count) = (2 * t * span, span.min(ws - t * span));
                for (gb, blk) in job.blks.clone().enumerate() {
                    let at = (((ii * nt + t) * nb + gb) * 2) * acc_len;
                    let (even, odd) = (&sums[at..at + acc_len], &sums[at + acc_len..at + 2 * acc_len]);
                    for j in 0..OB.min(o - blk * OB) {
                        let line = ((j * R + r) * NV) * S::LANES;
                        // SAFETY: image n, channel blk * OB + j < o, row y < h, columns
                        // x0 .. x0 + 2 * count <= w: inside the [b, o, h, w] output, and
                        // only this task writes these rows of these channels.
                        unsafe {
                            let dst = out.add(((job.n * o + blk * OB + j) * h + y) * w + x0);
                            for l in 0..count {
                                *dst.add(2 * l) = even[line + l];
                                *dst.add(2 * l + 1) = odd[line + l];
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Adds to `acc` one column phase of six output channels x R rows x NV vectors of
/// half-size positions over `c` input channels: 2x2 tap (a, b) of channel ci reads
/// padded row a + r from column b of `base`'s channel ci plane, weighted by
/// `taps[(ci * 4 + a * 2 + b) * OB + j]`.
///
/// SAFETY: the CPU has `S`'s features; every read lies inside the caller's padded map
/// and the c * 4 * OB taps.
#[inline(always)]
unsafe fn block<S: Simd, const NV: usize, const R: usize>(acc: &mut [[[S::V; NV]; R]; OB], base: *const f32, stride: usize, plane: usize, c: usize, taps: *const f32) {
    unsafe {
        let mut s = *acc;
        for ci in 0..c {
            let p = base.add(ci * plane);
            let tw = taps.add(ci * 4 * OB);
            for a in 0..2 {
                for b in 0..2 {
                    let xs: [[S::V; NV]; R] = std::array::from_fn(|r| std::array::from_fn(|v| S::load(p.add((a + r) * stride + b + v * S::LANES))));
                    let tap = tw.add((a * 2 + b) * OB);
                    for (j, sj) in s.iter_mut().enumerate() {
                        let wv = S::splat(*tap.add(j));
                        for r in 0..R {
                            for v in 0..NV {
                                sj[r][v] = S::fmadd(xs[r][v], wv, sj[r][v]);
                            }
                        }
                    }
                }
            }
        }
        *acc = s;
    }
}

#[cfg(test)]
mod tests {
    use super::super::conv3x3::{self, Dims};
    use super::super::Isa;

    /// The phases equal the direct kernel on the doubled map up to f32 rounding: blocks
    /// of two vectors of one row and of one vector of two rows (an odd last row too),
    /// half-size rows a whole number of blocks wide and not, output channels that fill
    /// no last block, batches, one input channel and many, one block split into runs of
    /// rows, and border rows and columns of every phase.
    #[test]
    fn phases_equal_the_conv_of_the_doubled_map() {
        let mut rng = crate::samplers::Rng::new(31);
        // (in, out, batch, h, w) of the half-size input.
        let cases = [(1, 1, 1, 8, 8), (3, 7, 2, 8, 16), (5, 13, 1, 5, 24), (16, 6, 2, 16, 40), (40, 9, 1, 9, 16), (700, 14, 1, 4, 8), (8, 3, 1, 1, 32), (12, 8, 1, 7, 8), (9, 13, 2, 8, 12), (4, 5, 1, 33, 16), (4, 5, 1, 31, 8), (3, 6, 1, 1, 8)];
        for isa in Isa::all_supported() {
            for &(c, o, b, h, w) in &cases {
                let d = Dims { batch: b, in_ch: c, out_ch: o, h: 2 * h, w: 2 * w };
                if !super::takes(isa, d) {
                    continue;
                }
                let flat = |t: candle_core::Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let xt = rng.randn(&[b, c, h, w], &candle_core::Device::Cpu).unwrap();
                let (x, up) = (flat(xt.clone()), flat(xt.upsample_nearest2d(2 * h, 2 * w).unwrap()));
                let k = flat(rng.randn(&[o, c, 3, 3], &candle_core::Device::Cpu).unwrap());
                let mut want = vec![0f32; b * o * 4 * h * w];
                conv3x3::run(isa, &up, d, &k, &mut want).unwrap();
                let mut got = vec![f32::NAN; want.len()];
                super::run(isa, &x, d, &k, &mut got);
                let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                // NaN marks an output the phases never wrote (f32::max would skip it).
                assert!(got.iter().all(|v| v.is_finite()), "{isa:?} {c}->{o} b{b} {h}x{w}: outputs left unwritten");
                let err = got.iter().zip(&want).fold(0f32, |m, (g, w)| m.max((g - w).abs()));
                eprintln!("{isa:?} {c}->{o} b{b} {h}x{w}: max error {err:.2e} of {scale:.2e}");
                assert!(err <= 2e-6 * scale.max(1.0) * (c as f32).sqrt(), "{isa:?} {c}->{o} b{b} {h}x{w}: max error {err} of {scale}");
            }
        }
    }
}
