//! Winograd F(2x2, 3x3) with bf16 products and f32 sums (AVX512-BF16): the bf16 3x3
//! convolution of large maps in 16 products per 2x2 block of outputs instead of 36.
//!
//! The direct bf16 kernel ([`super::conv3x3_bf16`]) runs at ~93 % of the machine's
//! `vdpbf16ps` ceiling, so, as in f32, only fewer multiplications go faster. F(4x4, 3x3)
//! is no use here: its transforms scale by up to 8 and 1/24, and rounding the
//! transformed values to bf16 gives ~6e-2 of the largest output where the direct bf16
//! kernel gives ~2.3e-3. F(2x2, 3x3)'s transforms only add, subtract and halve: rounded
//! once to bf16 (the input's `Bᵀ d B` made in f32 from the f32 activations, the
//! kernel's `G g Gᵀ` in f32 from the f32 weights), its error is ~1.6x the direct
//! kernel's (3.6e-3 to 4.1e-3 against 2.2e-3 to 2.5e-3 for 320 to 1280 channels, random
//! 32x32 maps, float64 emulation of both); sums and both inverse transforms stay f32.
//!
//! Layout: the transformed kernel is 16 pair tables [o][c / 2] ([`PackedPairRows`]),
//! made once per weight and kept by its layer (16/9 of the direct kernel's pair table);
//! per chunk of tile rows the transformed input is written straight into the bf16
//! GEMM's strip layout ([`StripsRef`]: nothing is rounded or packed per product), the
//! 16 products `M[ξ] = U[ξ] V[ξ]` run on the bf16 GEMM's 6 x 4-vector block, and the
//! output transform is the f32 one ([`super::winograd::output_transform`]).

use std::cell::RefCell;

use candle_core::Result;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::bf16::pack_pairs;
use super::bf16::{bf16_bits, require};
use super::conv3x3::Dims;
use super::matmul_bf16::{gemm_packed_both, PackedPairRows, StripsRef};
use super::winograd::{input_transform, kernel_transform, output_transform, Plan, Rows};
use super::SharedMut;

/// Bytes of transformed input plus products per chunk of tile rows.
const CHUNK: usize = 16 << 20;
/// Tiles per strip of the GEMM's right factor.
const NR: usize = 64;

/// The transformed kernel `U[ξ] = G g Gᵀ` of a [o, c, 3, 3] kernel, rounded to bf16
/// pairs: 16 tables [o][ceil(c / 2)].
pub struct PackedWinogradPairs {
    u: Vec<PackedPairRows>,
    out_ch: usize,
    in_ch: usize,
}

impl PackedWinogradPairs {
    pub fn new(weights: &[f32], out_ch: usize, in_ch: usize) -> Result<Self> {
        require()?;
        let (o, c) = (out_ch, in_ch);
        if weights.len() != o * c * 9 {
            candle_core::bail!("winograd bf16: {} weights for [{o}, {c}, 3, 3]", weights.len());
        }
        // Each (output, input-channel pair)'s two transforms are made once and rounded
        // straight into their words of the 16 tables (the scalar rule of the vector
        // rounding the activations take), with no f32 copy of the transform.
        let cp = c.div_ceil(2);
        let mut words: Vec<Vec<u32>> = (0..16).map(|_| vec![0u32; o * cp]).collect();
        let rows: Vec<SharedMut> = words.iter_mut().map(|t| SharedMut(t.as_mut_ptr() as *mut f32)).collect();
        let rows = &rows;
        weights.par_chunks(9 * c.max(1)).take(o).enumerate().for_each(|(k, wk)| {
            for p in 0..cp {
                let lo = kernel_transform(&wk[18 * p..18 * p + 9]);
                let hi = if 2 * p + 1 < c { kernel_transform(&wk[18 * p + 9..18 * p + 18]) } else { [0.0; 16] };
                for (xi, table) in rows.iter().enumerate() {
                    // SAFETY: word (k, p) of table ξ, inside its o * cp words; task k
                    // writes only row k.
                    unsafe { *(table.get() as *mut u32).add(k * cp + p) = bf16_bits(lo[xi]) | (bf16_bits(hi[xi]) << 16) };
                }
            }
        });
        let u = words.into_iter().map(|data| PackedPairRows::from_words(data, o, c)).collect::<Result<Vec<_>>>()?;
        Ok(Self { u, out_ch, in_ch })
    }

    pub fn bytes(&self) -> usize {
        self.u.iter().map(PackedPairRows::bytes).sum()
    }
}

/// The chunking of a call: per tile, 16 values of transformed input as half a pair
/// word per input channel, and 16 f32 products per output channel.
fn plan(c: usize, o: usize, h: usize, w: usize, budget: usize) -> Plan {
    Plan::new(2, 16 * (2 * c + 4 * o), h, w, budget)
}

/// Bytes a call for `d` allocates beyond its output and the packed kernel: one chunk's
/// transformed input and products, and each thread's f32 rows of two channels.
pub(crate) fn scratch_bytes(d: Dims) -> usize {
    let p = plan(d.in_ch, d.out_ch, d.h, d.w, CHUNK);
    let tiles = p.tiles();
    16 * StripsRef::words(d.in_ch, tiles) * 4 + 16 * d.out_ch * tiles * 4 + rayon::current_num_threads() * 2 * 16 * tiles * 4
}

/// Smallest side: at 8x8 (16 tiles) each product is too thin (a 1280-channel conv took
/// 2x the direct kernel's time; at 16x16 0.58x, at 32x32 0.51x).
const MIN_SIDE: usize = 16;
/// Largest side for every conv with [`MIN_CHANNELS`].
const MAX_SIDE: usize = 32;
/// Largest side for a conv with at least [`WIDE_MIN_IN`] input channels. At SD 1.5's
/// 64x64 level (512 px) each conv makes about the same error in isolation (3.8e-3 to
/// 4.4e-3 of its largest output, `bench kernels`), but the level feeds the output
/// directly and the UNet's bf16 error against PyTorch f32 is held to 1e-2, so the
/// transform goes where it saves most per error it adds: `bench speed --components
/// unet-sd15@512`, error with each choice at 64x64: none 8.78e-3, every conv 1.05e-2,
/// only the 320 -> 320 ones (down block 0, each up-block-3 resnet's second conv)
/// 1.03e-2, only those with >= 640 input channels (the last upsampler's 640 -> 640,
/// the up-block-3 resnets' first convs over 960 or 640 concatenated channels, three
/// fifths of the level's products) 8.98e-3. Those run in 0.64x and 0.67x the direct
/// kernel's time (`bench kernels --only _64`: 640 -> 640 0.073 -> 0.047 s, 960 -> 320
/// 0.054 -> 0.036 s); the 320 -> 320 ones would gain least (0.73x). The SD VAE
/// decoder's 512-channel convs at 64x64 stay out too: with them its bf16 error at
/// 512 px went from 9.25e-3 to 1.16e-2 (`bench speed --components vae-sd15@512`).
const WIDE_SIDE: usize = 64;
/// See [`WIDE_SIDE`].
const WIDE_MIN_IN: usize = 640;
/// Fewest channels each way: at 64 (TAESD's 256x256 level) the transforms outweigh
/// the saving (1.33x the direct kernel's time).
const MIN_CHANNELS: usize = 256;

/// Whether the layers run `d` in bf16 by this transform rather than the direct kernel
/// (measured with `brume bench kernels --compute bf16 --only conv3x3_` and `brume bench
/// speed --modes bf16 --modes bf16-direct`; see the README's speed section), never on
/// AMX, whose tiles run the direct kernel, nor under `BRUME_WINOGRAD=off`.
pub(crate) fn wins(d: Dims) -> bool {
    if super::amx::supported() || super::winograd::mode() == super::winograd::Mode::Off {
        return false;
    }
    let side = d.h.max(d.w);
    let fits = side <= MAX_SIDE || (side <= WIDE_SIDE && d.in_ch >= WIDE_MIN_IN);
    d.batch > 0 && d.h.min(d.w) >= MIN_SIDE && fits && d.in_ch.min(d.out_ch) >= MIN_CHANNELS
}

/// `out` [b, o, h, w] = conv(`x` [b, c, h, w], the kernel `u` was made from), padding 1,
/// by Winograd F(2x2, 3x3) with bf16 products, whatever the sizes.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub(crate) fn run_packed(x: &[f32], d: Dims, u: &PackedWinogradPairs, out: &mut [f32]) -> Result<()> {
    require()?;
    let Dims { batch, in_ch: c, out_ch: o, h, w } = d;
    if x.len() != batch * c * h * w || (u.out_ch, u.in_ch) != (o, c) || out.len() != batch * o * h * w {
        candle_core::bail!("winograd bf16: buffer sizes do not match {d:?} (kernel [{}, {}])", u.out_ch, u.in_ch);
    }
    if !d.needs_compute(out) {
        return Ok(());
    }
    planned(x, d, u, plan(c, o, h, w, CHUNK), out)
}

/// [`run_packed`]'s work on checked buffers, a chunk of `p.rows` tile rows at a time.
fn planned(x: &[f32], d: Dims, u: &PackedWinogradPairs, p: Plan, out: &mut [f32]) -> Result<()> {
    let (c, o) = (d.in_ch, d.out_ch);
    let most = p.tiles();
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut held) => {
            let (v, m) = &mut *held;
            grow(v, 16 * StripsRef::words(c, most));
            grow(m, 16 * o * most);
            chunks(x, d, u, p, v, m, out)
        }
        // Not reached (nothing here calls back into this kernel); fresh buffers if it were.
        Err(_) => chunks(x, d, u, p, &mut vec![0; 16 * StripsRef::words(c, most)], &mut vec![0.0; 16 * o * most], out),
    })
}

thread_local! {
    /// The calling thread's transformed input and products, kept between calls: fresh
    /// pages for them cost a third of a 320-channel layer's time at 64x64.
    static SCRATCH: RefCell<(Vec<u32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    /// A worker's f32 transforms of two input channels.
    static PAIR: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

fn grow<T: Copy + Default>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}

/// The convolution, a chunk of tile rows at a time, in the scratch `v` (strip words)
/// and `m` (products).
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn chunks(x: &[f32], d: Dims, u: &PackedWinogradPairs, p: Plan, v: &mut [u32], m: &mut [f32], out: &mut [f32]) -> Result<()> {
    let Dims { batch, in_ch: c, out_ch: o, h, w } = d;
    let cp = c.div_ceil(2);
    for n in 0..batch {
        let img = &x[n * c * h * w..(n + 1) * c * h * w];
        let dst = &mut out[n * o * h * w..(n + 1) * o * h * w];
        for tys in p.chunks() {
            let (ty0, ty1) = (tys.start, tys.end);
            let tiles = (ty1 - ty0) * p.tw;
            let vw = StripsRef::words(c, tiles);
            let vshare = SharedMut(v.as_mut_ptr() as *mut f32);
            (0..cp).into_par_iter().for_each_init(
                || Rows::new(p.tw),
                |rows, pi| PAIR.with(|pair| {
                    let mut pair = pair.borrow_mut();
                    let (lo, hi) = &mut *pair;
                    grow(lo, 16 * tiles);
                    grow(hi, 16 * tiles);
                    let plane = |ci: usize| &img[ci * h * w..(ci + 1) * h * w];
                    // SAFETY: lo and hi hold 16 tile rows' worth (stride `tiles`) for ξ < 16.
                    unsafe { input_transform(plane(2 * pi), h, w, p.tw, ty0..ty1, rows, lo.as_mut_ptr(), tiles) };
                    let odd = 2 * pi + 1 < c;
                    if odd {
                        // SAFETY: as above.
                        unsafe { input_transform(plane(2 * pi + 1), h, w, p.tw, ty0..ty1, rows, hi.as_mut_ptr(), tiles) };
                    }
                    for xi in 0..16 {
                        for s in 0..tiles.div_ceil(NR) {
                            let (t0, t1) = (s * NR, ((s + 1) * NR).min(tiles));
                            let lo = &lo[xi * tiles + t0..xi * tiles + t1];
                            let hi = odd.then(|| &hi[xi * tiles + t0..xi * tiles + t1]);
                            #[cfg(target_arch = "x86_64")]
                            // SAFETY: AVX512-BF16 (checked above) implies F and BW; pair row pi of
                            // strip s of matrix ξ holds NR >= t1 - t0 words inside v, written by
                            // this task alone.
                            unsafe {
                                pack_pairs(lo, hi, (vshare.get() as *mut u32).add(xi * vw + (s * cp + pi) * NR))
                            }
                            #[cfg(not(target_arch = "x86_64"))]
                            let _ = (lo, hi, vshare);
                        }
                    }
                }),
            );
            for (xi, ui) in u.u.iter().enumerate() {
                let b = StripsRef::new(&v[xi * vw..(xi + 1) * vw], c, tiles)?;
                gemm_packed_both(ui, b, &mut m[xi * o * tiles..(xi + 1) * o * tiles])?;
            }
            let mm = &m[..16 * o * tiles];
            dst.par_chunks_mut(h * w).enumerate().for_each(|(k, plane)| {
                output_transform(mm, o, k, tiles, h, w, p.tw, ty0..ty1, plane);
            });
        }
    }
    Ok(())
}

/// `out` = conv(`x`, `weights` [o, c, 3, 3]) by this transform, the kernel transformed
/// per call (weights the layers do not keep; tests).
pub(crate) fn run(x: &[f32], d: Dims, weights: &[f32], out: &mut [f32]) -> Result<()> {
    run_packed(x, d, &PackedWinogradPairs::new(weights, d.out_ch, d.in_ch)?, out)
}

/// 3x3 / stride 1 / padding 1 convolution of `x` [b, c, h, w] with `w` [o, c, 3, 3]
/// (no bias) by this transform whatever the sizes (tests and benches).
pub fn conv3x3_winograd_bf16(x: &candle_core::Tensor, w: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    super::winograd::on_tensors("winograd bf16 conv3x3", x, w, run)
}

/// As [`conv3x3_winograd_bf16`] with the kernel already transformed (the layers' path).
pub fn conv3x3_winograd_bf16_packed(x: &candle_core::Tensor, u: &PackedWinogradPairs) -> Result<candle_core::Tensor> {
    let (b, c, h, w) = x.dims4()?;
    let xs = x.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0f32; b * u.out_ch * h * w];
    run_packed(&xs, Dims { batch: b, in_ch: c, out_ch: u.out_ch, h, w }, u, &mut out)?;
    candle_core::Tensor::from_vec(out, (b, u.out_ch, h, w), x.device())
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Chunks of one tile row (several per image, a short strip at each chunk's end)
    /// give the same values, to the bit, as the default plan's whole image.
    #[test]
    fn chunked_plan_matches_the_whole_image() {
        if !super::super::bf16::supported() {
            return;
        }
        let d = Dims { batch: 2, in_ch: 7, out_ch: 5, h: 13, w: 11 };
        let x: Vec<f32> = (0..d.batch * d.in_ch * d.h * d.w).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        let k: Vec<f32> = (0..d.out_ch * d.in_ch * 9).map(|i| ((i * 13 % 29) as f32 - 14.0) / 9.0).collect();
        let u = PackedWinogradPairs::new(&k, d.out_ch, d.in_ch).unwrap();
        let mut whole = vec![0f32; d.batch * d.out_ch * d.h * d.w];
        run_packed(&x, d, &u, &mut whole).unwrap();
        let mut rows = vec![f32::NAN; whole.len()];
        let p = plan(d.in_ch, d.out_ch, d.h, d.w, 1);
        assert_eq!(p.rows, 1);
        planned(&x, d, &u, p, &mut rows).unwrap();
        assert_eq!(whole, rows);
    }

    /// The rule on SD 1.5's shapes at 512 px (where the CPU would take it at all).
    #[test]
    fn the_rule_takes_the_measured_shapes() {
        if super::super::amx::supported() || super::super::winograd::mode() == super::super::winograd::Mode::Off {
            return;
        }
        let d = |c, o, side| Dims { batch: 1, in_ch: c, out_ch: o, h: side, w: side };
        for yes in [d(1280, 1280, 16), d(640, 640, 32), d(1920, 640, 32), d(640, 640, 64), d(960, 320, 64), d(640, 320, 64)] {
            assert!(wins(yes), "{yes:?}");
        }
        // 8x8 maps are too thin, 320 -> 320 at 64x64 costs the UNet's error budget, 64
        // channels cost more to transform than they save, and 128x128 maps are not measured.
        for no in [d(1280, 1280, 8), d(320, 320, 64), d(64, 64, 32), d(640, 640, 128), d(640, 128, 32), Dims { batch: 0, ..d(640, 640, 32) }] {
            assert!(!wins(no), "{no:?}");
        }
    }
}
