//! Winograd F(4x4, 3x3): the f32 3x3 convolution of large maps in 36 products per
//! 4x4 block of outputs instead of 144.
//!
//! F(2x2, 3x3) ([`super::winograd`]) saves 2.25x of the multiplications, which the
//! transforms' memory traffic and a GEMM slower than the direct kernel ate up. Tiles
//! of 4x4 outputs (6x6 input patches, stride 4) save 4x, enough to pay for both. The
//! transforms (Lavin & Gray's points 0, ±1, ±2, ∞) scale by up to 8 and 1/24, so the
//! sums round a little more than the direct ones: 1.3e-5 (256 channels) to 2.9e-5
//! (640) of the largest output in f32, where the direct kernel is ~3e-6 from candle's
//! (`tests/kernels_conv.rs`).
//!
//! Layout, per chunk of tile rows: the transformed kernel U [36][o][c] (made per
//! call, 4x the kernel, six of its matrices at a time where the whole passes 16 MiB;
//! counted as scratch by the memory estimator), the transformed input V, already in
//! the GEMM's strip layout, and the products M [36][o][tiles], each product
//! `M[ξ] = U[ξ] V[ξ]` on the register-blocked GEMM's 6 x 4-vector block, one task per
//! matrix and strip of tiles, nothing packed per product. Rows are walked in vector passes:
//! an input row is split by column phase (x mod 4) once, so both transforms run down
//! and across whole rows of tiles with no per-tile gathers.

use candle_core::Result;
use rayon::prelude::*;

use super::conv3x3::Dims;
use super::winograd::Plan;
use super::matmul::{block, load_wide, store_wide, MR};
use super::simd::{Portable, Simd};
use super::{require, Isa, SharedMut};

/// Values of k per pass of a product: a 4-vector strip of 128 rows (32 KiB) stays in
/// L1 while every row block of U goes past it. Alternated on the Intel Xeon host
/// (320 -> 320 at 64x64, 5 runs each, twice): 128 took 8.5-8.9 ms for the 36
/// products, the whole k (320) 8.9-11.3, 64 and 96 in between.
const KC: usize = 128;
/// Bytes of transformed input plus products per chunk of tile rows.
const CHUNK: usize = 16 << 20;

/// The chunking of an F(4x4, 3x3) call: per tile, 36 values of transformed input per
/// input channel and 36 products per output channel, f32.
fn plan(c: usize, o: usize, h: usize, w: usize) -> Plan {
    Plan::new(4, 36 * 4 * (c + o), h, w, CHUNK)
}

/// Transform rows of U (six matrices of [o, c] each) held at once.
fn u_rows_per_group(c: usize, o: usize) -> usize {
    (U_CHUNK / (6 * o * c * 4).max(1)).clamp(1, 6)
}

/// Bytes a call allocates beyond its output: the transformed kernel it holds at once
/// and one chunk's transformed input and products.
pub(crate) fn scratch_bytes(d: Dims) -> usize {
    let isa = super::isa();
    if super::winograd43_strips::wins_on(isa, d) {
        return super::winograd43_strips::scratch_bytes(isa, d);
    }
    let p = plan(d.in_ch, d.out_ch, d.h, d.w);
    6 * u_rows_per_group(d.in_ch, d.out_ch) * d.in_ch * d.out_ch * 4 + 36 * 4 * (d.in_ch + d.out_ch) * p.tiles()
}

/// Fewest tiles per call, fewest channels each way and most values in one of U's 36
/// matrices where F(4x4, 3x3) beats the direct kernel (see [`wins`]).
const MIN_TILES: usize = 256;
const MIN_CHANNELS: usize = 256;
const MAX_U_MATRIX: usize = 640 * 640;
/// The same on AVX2, whose direct kernel (8 lanes, 16 registers) does less per
/// multiplication than AVX-512's, so the 4x saving repays U over fewer tiles (a 32x32
/// map) and a larger matrix: see [`wins_on`].
const AVX2_MIN_TILES: usize = 64;
const AVX2_MAX_U_MATRIX: usize = 960 * 640;
/// Most bytes of transformed kernel held at once: U is made a transform row (six of
/// its 36 matrices) at a time where the whole would pass this.
const U_CHUNK: usize = 16 << 20;

/// Whether the layers run `d` by F(4x4, 3x3) on this CPU's kernels ([`super::isa`]).
pub(crate) fn wins(d: Dims) -> bool {
    wins_on(super::isa(), d)
}

/// Whether F(4x4, 3x3) beats the direct kernel for `d` on `isa`.
///
/// AVX-512 (and the portable path): at least 256 tiles of 4x4 outputs (a 64x64 map)
/// and 256..640 channels each way. U is made per call, so its cost must be spread over
/// many tiles; each product streams one of U's matrices past a strip of tiles, so a
/// matrix must stay in a core's L2 (2 MiB there; 640 x 640 is 1.6 MiB). Intel Xeon
/// host, 2026-12-04, time against the direct kernel: `brume bench kernels --only
/// conv3x3_` 320 -> 320 at 64x64 0.77-0.93; in whole models (`bench speed --modes fast
/// --modes direct`, alternated in one process) the SD 1.5 UNet at 512 px 0.95 and its
/// VAE decoder 0.79 with the 32x32 maps taken too, but the UNet at 256 px (32x32 maps
/// only) 1.09 and SDXS at 512 px 1.04: 64 tiles do not repay U. Not taken either:
/// 1280 -> 1280 and 1920 -> 640 at 32x32 (1.5-1.6x: 6.5 and 4.9 MiB matrices read from
/// memory), 64 -> 64 at 256x256 (1.2-1.3x: the transforms' memory passes outweigh what
/// so few channels save).
///
/// AVX2 also takes the 32x32 maps (64 tiles) up to 960 x 640 channels. AMD EPYC Zen 3
/// host, 2026-12-07, `brume bench kernels --python none --only _32` twice, F(4x4, 3x3)
/// against the direct kernel at 32x32: 320 -> 320 0.71-0.76x the time, 320 -> 640
/// 0.72-0.77, 640 -> 640 0.68, 960 -> 640 0.64-0.72; about level at 1280 -> 1280
/// (0.95-1.10) and 1920 -> 640 (0.97), which stay direct. And AVX2 takes 32-128
/// channels on maps from 128x128 one strip of tiles at a time
/// ([`super::winograd43_strips`]), where this chunked schedule lost (64 -> 64 at
/// 256x256 1.24x the direct kernel's time).
pub(crate) fn wins_on(isa: Isa, d: Dims) -> bool {
    let tiles = d.batch * d.h.div_ceil(4) * d.w.div_ceil(4);
    let (min_tiles, max_u) = match isa {
        Isa::Avx2 => (AVX2_MIN_TILES, AVX2_MAX_U_MATRIX),
        _ => (MIN_TILES, MAX_U_MATRIX),
    };
    (tiles >= min_tiles && d.in_ch.min(d.out_ch) >= MIN_CHANNELS && d.in_ch * d.out_ch <= max_u) || super::winograd43_strips::wins_on(isa, d)
}

/// `x` [b, c, h, w] with `w` [o, c, 3, 3], padding 1, by F(4x4, 3x3) whatever the
/// sizes, on `isa` (tests and benches).
pub fn conv3x3_on(isa: Isa, x: &candle_core::Tensor, w: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    super::winograd::on_tensors("winograd F(4x4, 3x3)", x, w, |xs, d, ws, out| run(isa, xs, d, ws, out, false))
}

/// `out` [b, o, h, w] = conv(`x` [b, c, h, w], `weights` [o, c, 3, 3]), padding 1;
/// with `up`, `x` is [b, c, h / 2, w / 2] and the conv reads its nearest-neighbour 2x
/// upsampling in place (a decoder's upsampler: the doubled map is never formed).
pub(crate) fn run(isa: Isa, x: &[f32], d: Dims, weights: &[f32], out: &mut [f32], up: bool) -> Result<()> {
    require(isa)?;
    let what = "winograd F(4x4, 3x3)";
    let work = if up {
        d.check_upsampled(what, x, weights, out)?;
        d.needs_compute(out)
    } else {
        d.check(what, x, weights, out)?
    };
    if !work {
        return Ok(());
    }
    if super::winograd43_strips::wins_on(isa, d) {
        super::winograd43_strips::run_on(isa, x, d, weights, out, up);
    } else {
        run_on(isa, x, d, weights, out, up);
    }
    Ok(())
}

/// Columns of V per product strip on `isa`: 4 vectors on AVX-512, else 2.
pub(super) fn strip_width(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 => 4 * isa.lanes(),
        _ => 2 * isa.lanes(),
    }
}

/// The whole convolution (sizes checked, `isa` confirmed).
fn run_on(isa: Isa, x: &[f32], d: Dims, weights: &[f32], out: &mut [f32], up: bool) {
    let Dims { batch, in_ch: c, out_ch: o, h, w } = d;
    let nr = strip_width(isa);
    let p = plan(c, o, h, w);
    // U's rows i of the 6x6 transform (6 values of ξ each) in groups of `per` (all six
    // when they fit in U_CHUNK); made once when one group holds them all, else per
    // group per chunk of tiles.
    let per = u_rows_per_group(c, o);
    let groups = 6usize.div_ceil(per);
    let mut u: Vec<f32> = Vec::with_capacity(6 * per * c * o);
    let mut u_rows: Option<std::ops::Range<usize>> = None;
    let most = p.tiles();
    // V [36][strip][c][nr]: each product's B already in the GEMM's strip layout, so
    // nothing is packed per product. M [36][o][tiles]. Both are written whole (V's
    // padding lanes past the last tile too) before they are read, and the first chunk
    // is the largest, so neither is zeroed first.
    let mut v: Vec<f32> = Vec::with_capacity(36 * c * most.div_ceil(nr) * nr);
    let mut m: Vec<f32> = Vec::with_capacity(36 * o * most);
    for n in 0..batch {
        let plane_len = if up { (h / 2) * (w / 2) } else { h * w };
        let img = &x[n * c * plane_len..(n + 1) * c * plane_len];
        let dst = &mut out[n * o * h * w..(n + 1) * o * h * w];
        for tys in p.chunks() {
            let (ty0, ty1) = (tys.start, tys.end);
            let tiles = (ty1 - ty0) * p.tw;
            let strips = tiles.div_ceil(nr);
            let vshare = SharedMut(v.as_mut_ptr());
            img.par_chunks(plane_len).enumerate().for_each_init(
                || (Phases::new(p.tw), vec![0f32; 36 * tiles]),
                // SAFETY: channel ci writes only its rows of V's strips; `isa` was confirmed.
                |(ph, rows), (ci, plane)| unsafe { input_to_strips(isa, plane, h, w, up, p.tw, ty0..ty1, ph, rows, tiles, strips, c, ci, nr, vshare.get()) },
            );
            // SAFETY: the tasks above wrote V's first 36 strips c nr values.
            unsafe { v.set_len(v.len().max(36 * strips * c * nr)) };
            let mshare = SharedMut(m.as_mut_ptr());
            let v = &v[..36 * strips * c * nr];
            for g in 0..groups {
                let rows = g * per..((g + 1) * per).min(6);
                if u_rows.as_ref() != Some(&rows) {
                    make_u(isa, weights, c, o, rows.clone(), &mut u);
                    u_rows = Some(rows.clone());
                }
                let (x0, nx) = (6 * rows.start, 6 * rows.len());
                let u = &u[..nx * o * c];
                (0..nx * strips).into_par_iter().for_each(|t| {
                    let (xl, s) = (t / strips, t % strips);
                    let xi = x0 + xl;
                    let job = Product { a: &u[xl * o * c..(xl + 1) * o * c], strip: &v[(xi * strips + s) * c * nr..][..c * nr], o, c };
                    let (j0, width) = (s * nr, nr.min(tiles - s * nr));
                    // SAFETY: the task writes only M[ξ][..][j0..j0 + width] (rows `tiles` apart), disjoint
                    // from the other tasks' and inside m's capacity (36 o tiles); `isa` was confirmed.
                    unsafe { job.run(isa, mshare.get().add(xi * o * tiles + j0), tiles, width) };
                });
            }
            // SAFETY: the products wrote M's first 36 o tiles values.
            unsafe { m.set_len(m.len().max(36 * o * tiles)) };
            let m = &m[..36 * o * tiles];
            dst.par_chunks_mut(h * w).enumerate().for_each_init(
                || Phases::new(p.tw),
                // SAFETY: `isa` was confirmed.
                |z, (k, plane)| unsafe { output_on(isa, m, o, k, tiles, h, w, p.tw, ty0..ty1, z, plane) },
            );
        }
    }
}

/// Rows `rows` of U (ξ = 6 i + j for i in `rows`), [ξ][o][c], into `u` (replaced).
pub(super) fn make_u(isa: Isa, weights: &[f32], c: usize, o: usize, rows: std::ops::Range<usize>, u: &mut Vec<f32>) {
    let n = 6 * rows.len() * o * c;
    u.clear();
    u.reserve(n);
    let ushare = SharedMut(u.as_mut_ptr());
    let x0 = 6 * rows.start;
    weights.par_chunks(9 * c).enumerate().for_each_init(
        || vec![0f32; 9 * (c + 16)],
        |taps, (k, wk)| {
            let rows = rows.clone();
            let row = |xi: usize| ushare.get().wrapping_add(((xi - x0) * o + k) * c);
            // SAFETY: task k writes only U[ξ][k][..] (c values for each ξ of `rows`), inside
            // u's capacity; the CPU runs `isa` (confirmed by `require`).
            unsafe {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => kernel_rows_avx512(wk, taps, c, rows, row),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => kernel_rows_avx2(wk, taps, c, rows, row),
                    _ => kernel_rows::<Portable>(wk, taps, c, rows, row),
                }
            }
        },
    );
    // SAFETY: the o tasks above wrote all 6 rows.len() o c values.
    unsafe { u.set_len(n) };
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn kernel_rows_avx512(wk: &[f32], taps: &mut [f32], c: usize, rows: std::ops::Range<usize>, row: impl Fn(usize) -> *mut f32) {
    // SAFETY: forwarded from the caller.
    unsafe { kernel_rows::<super::simd::Avx512>(wk, taps, c, rows, row) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_rows_avx2(wk: &[f32], taps: &mut [f32], c: usize, rows: std::ops::Range<usize>, row: impl Fn(usize) -> *mut f32) {
    // SAFETY: forwarded from the caller.
    unsafe { kernel_rows::<super::simd::Avx2>(wk, taps, c, rows, row) }
}

on_isa_fn! {
    /// Channel `ci`'s transformed input for the chunk's tile rows `tys` ([`input_transform`]
    /// into `rows`, 36 rows of `tiles` values), copied into its row of each of V's strips
    /// (V [36][strips][c][nr] at `v`; padding lanes past the last tile zeroed).
    ///
    /// SAFETY: the CPU runs `isa`; `v` holds V, whose rows for channel ci no one else writes.
    unsafe fn input_to_strips(plane: &[f32], h: usize, w: usize, up: bool, tw: usize, tys: std::ops::Range<usize>, ph: &mut Phases, rows: &mut [f32], tiles: usize, strips: usize, c: usize, ci: usize, nr: usize, v: *mut f32) {
        // SAFETY: rows holds 36 rows of `tiles` values.
        unsafe { input_transform(plane, h, w, up, tw, tys, ph, rows.as_mut_ptr(), tiles) };
        for (xi, row) in rows[..36 * tiles].chunks_exact(tiles).enumerate() {
            for s in 0..strips {
                let run = &row[s * nr..((s + 1) * nr).min(tiles)];
                // SAFETY: V[ξ][s][ci][..nr] lies inside V (the caller's contract).
                unsafe {
                    let at = v.add(((xi * strips + s) * c + ci) * nr);
                    std::ptr::copy_nonoverlapping(run.as_ptr(), at, run.len());
                    std::ptr::write_bytes(at.add(run.len()), 0, nr - run.len());
                }
            }
        }
    }
}

on_isa_fn! {
    /// [`output_transform`] compiled for `isa`.
    ///
    /// SAFETY: the CPU runs `isa`.
    unsafe fn output_on(m: &[f32], o: usize, k: usize, tiles: usize, h: usize, w: usize, tw: usize, tys: std::ops::Range<usize>, z: &mut Phases, plane: &mut [f32]) {
        output_transform(m, o, k, tiles, h, w, tw, tys, z, plane)
    }
}

/// One product's share: all `o` rows of `U[ξ]` ([o, c]) against one strip of V
/// (c rows of the strip width).
pub(super) struct Product<'a> {
    pub(super) a: &'a [f32],
    pub(super) strip: &'a [f32],
    pub(super) o: usize,
    pub(super) c: usize,
}

impl Product<'_> {
    /// Writes `o` rows of `width` products at `dst`, rows `ld` apart.
    ///
    /// SAFETY: the CPU runs `isa`; `dst` holds those rows and no one else writes them.
    pub(super) unsafe fn run(&self, isa: Isa, dst: *mut f32, ld: usize, width: usize) {
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => self.avx512(dst, ld, width),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => self.avx2(dst, ld, width),
                _ => self.on::<Portable, 2>(dst, ld, width),
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn avx512(&self, dst: *mut f32, ld: usize, width: usize) {
        unsafe { self.on::<super::simd::Avx512, 4>(dst, ld, width) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2(&self, dst: *mut f32, ld: usize, width: usize) {
        unsafe { self.on::<super::simd::Avx2, 2>(dst, ld, width) }
    }

    #[inline(always)]
    unsafe fn on<S: Simd, const NV: usize>(&self, dst: *mut f32, ld: usize, width: usize) {
        let Self { a, strip, o, c } = *self;
        assert!(strip.len() >= c * NV * S::LANES && a.len() >= o * c && width <= NV * S::LANES);
        let mut k0 = 0;
        while k0 < c {
            let kc = KC.min(c - k0);
            let mut i0 = 0;
            while i0 < o {
                let arows: [*const f32; MR] = std::array::from_fn(|i| a[(i0 + i).min(o - 1) * c + k0..].as_ptr());
                let live = MR.min(o - i0);
                // SAFETY: the strip holds c rows of NV vectors and every A row c values (asserted);
                // the caller owns dst's rows.
                unsafe {
                    let at = dst.add(i0 * ld);
                    let mut acc = if k0 > 0 { load_wide::<S, NV>(at, ld, live, width) } else { [[S::splat(0.0); NV]; MR] };
                    block::<S, NV>(&mut acc, &arows, strip.as_ptr().add(k0 * NV * S::LANES), kc);
                    store_wide::<S, NV>(&acc, at, ld, live, width);
                }
                i0 += MR;
            }
            k0 += kc;
        }
    }
}

/// One output channel's `G g Gᵀ` for all `c` input channels: `wk` is its [c, 3, 3]
/// kernel, `taps` scratch of 9 (c + LANES) values; row ξ (c values) of each transform
/// row i in `rows` (ξ = 6 i + j) goes to `row(ξ)`.
/// The taps are split into nine rows first, so the transform runs on whole vectors of
/// input channels, with
/// G = [[¼, 0, 0], [-⅙, -⅙, -⅙], [-⅙, ⅙, -⅙], [1/24, 1/12, ⅙], [1/24, -1/12, ⅙], [0, 0, 1]].
///
/// SAFETY: the CPU runs `S`; each `row(ξ)` points at c writable floats, distinct for
/// every ξ and apart from `wk` and `taps`.
#[inline(always)]
unsafe fn kernel_rows<S: Simd>(wk: &[f32], taps: &mut [f32], c: usize, rows: std::ops::Range<usize>, row: impl Fn(usize) -> *mut f32) {
    let cp = c.div_ceil(S::LANES) * S::LANES;
    assert!(taps.len() >= 9 * cp && wk.len() >= 9 * c);
    taps.fill(0.0);
    for (ci, g) in wk.chunks_exact(9).enumerate() {
        for (t, &x) in g.iter().enumerate() {
            taps[t * cp + ci] = x;
        }
    }
    // The six rows of G applied to three vectors.
    #[inline(always)]
    unsafe fn g6<S: Simd>(a: S::V, b: S::V, d: S::V) -> [S::V; 6] {
        unsafe {
            let (q, s, e) = (S::splat(0.25), S::splat(-1.0 / 6.0), S::splat(1.0 / 24.0));
            let ad = S::add(a, d);
            // 1/24 a + 1/6 d and 1/12 b
            let p = S::fmadd(S::splat(1.0 / 6.0), d, S::mul(e, a));
            let b12 = S::mul(S::splat(1.0 / 12.0), b);
            [S::mul(q, a), S::mul(s, S::add(ad, b)), S::mul(s, S::sub(ad, b)), S::add(p, b12), S::sub(p, b12), d]
        }
    }
    let mut tail = [[0f32; 16]; 36];
    let mut ci = 0;
    while ci < c {
        // (Plain loops, no closures: a closure is compiled without the caller's target
        // features, and the intrinsics in it would become calls.)
        // SAFETY: the CPU runs S; taps holds 9 rows of cp >= ci + LANES values (asserted).
        let mut g = [unsafe { S::splat(0.0) }; 9];
        for (t, gv) in g.iter_mut().enumerate() {
            *gv = unsafe { S::load(taps.as_ptr().add(t * cp + ci)) };
        }
        // t = G g down each column j of the kernel, then (t Gᵀ) across each row i.
        let mut cols = [[unsafe { S::splat(0.0) }; 6]; 3];
        for (j, col) in cols.iter_mut().enumerate() {
            *col = unsafe { g6::<S>(g[j], g[3 + j], g[6 + j]) };
        }
        let live = S::LANES.min(c - ci);
        for i in rows.clone() {
            // SAFETY: the CPU runs S.
            let r = unsafe { g6::<S>(cols[0][i], cols[1][i], cols[2][i]) };
            for (j, &x) in r.iter().enumerate() {
                let xi = 6 * i + j;
                // SAFETY: row(ξ) holds c values, of which ci..ci + live are written here.
                unsafe {
                    if live == S::LANES {
                        S::store(row(xi).add(ci), x);
                    } else {
                        S::store(tail[xi].as_mut_ptr(), x);
                        std::ptr::copy_nonoverlapping(tail[xi].as_ptr(), row(xi).add(ci), live);
                    }
                }
            }
        }
        ci += S::LANES;
    }
}

/// Per-thread rows of one channel, reused across tile rows: `ph[r][p][i]` holds
/// column 4i - 1 + p of patch row r (zero outside the image), i in 0..=tw, so the
/// six columns of tile tx are (p, i) = (0..4, tx) and (0..2, tx + 1). The output
/// transform reuses the same shape for its six across-sums of each patch row.
struct Phases {
    ph: [[Vec<f32>; 4]; 6],
}

impl Phases {
    fn new(tw: usize) -> Self {
        Self { ph: std::array::from_fn(|_| std::array::from_fn(|_| vec![0f32; tw + 1])) }
    }
}

/// `Bᵀ d`, one column of 6 values, with
/// Bᵀ = [[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
///       [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]].
#[inline(always)]
pub(super) fn bt(d: [f32; 6]) -> [f32; 6] {
    let [d0, d1, d2, d3, d4, d5] = d;
    [
        4.0 * d0 - 5.0 * d2 + d4,
        -4.0 * (d1 + d2) + d3 + d4,
        4.0 * (d1 - d2) - d3 + d4,
        -2.0 * (d1 - d3) - d2 + d4,
        2.0 * (d1 - d3) - d2 + d4,
        4.0 * d1 - 5.0 * d3 + d5,
    ]
}

/// `Aᵀ m`, 6 values to 4, with
/// Aᵀ = [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]].
#[inline(always)]
pub(super) fn at(m: [f32; 6]) -> [f32; 4] {
    let [m0, m1, m2, m3, m4, m5] = m;
    let (s12, d12, s34, d34) = (m1 + m2, m1 - m2, m3 + m4, m3 - m4);
    [m0 + s12 + s34, d12 + 2.0 * d34, s12 + 4.0 * s34, d12 + 8.0 * d34 + m5]
}

/// `Bᵀ d B` for every tile of rows `tys` of one channel's plane, into `vc`: value ξ of
/// the tiles at `vc + ξ * stride`; patch (i, j) of tile (ty, tx) is input
/// (4 ty - 1 + i, 4 tx - 1 + j). With `up`, `plane` is the (h / 2) x (w / 2) map whose
/// 2x upsampling is the input.
///
/// SAFETY: `vc + ξ * stride` holds `tys.len() * tw` values for every ξ < 36, written
/// by no one else meanwhile.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn input_transform(plane: &[f32], h: usize, w: usize, up: bool, tw: usize, tys: std::ops::Range<usize>, rows: &mut Phases, vc: *mut f32, stride: usize) {
    for (ri, ty) in tys.enumerate() {
        for r in 0..6 {
            let [p0, p1, p2, p3] = &mut rows.ph[r];
            let (p0, p1, p2, p3) = (&mut p0[..tw + 1], &mut p1[..tw + 1], &mut p2[..tw + 1], &mut p3[..tw + 1]);
            p0.fill(0.0);
            p1.fill(0.0);
            p2.fill(0.0);
            p3.fill(0.0);
            let Some(iy) = (4 * ty + r).checked_sub(1).filter(|&y| y < h) else { continue };
            if up {
                let src = &plane[(iy / 2) * (w / 2)..(iy / 2 + 1) * (w / 2)];
                // Columns 4i - 1 + p: the upsampled row's x is src[x / 2].
                for (x, &v) in src.iter().flat_map(|v| [v, v]).enumerate() {
                    let q = x + 1;
                    [&mut *p0, &mut *p1, &mut *p2, &mut *p3][q % 4][q / 4] = v;
                }
                continue;
            }
            let src = &plane[iy * w..(iy + 1) * w];
            // Columns 4i.. of the row are phases 1, 2, 3 of i and phase 0 of i + 1.
            let quads = src.chunks_exact(4);
            let rest = quads.remainder();
            let full = w / 4;
            for (i, q) in quads.enumerate() {
                p1[i] = q[0];
                p2[i] = q[1];
                p3[i] = q[2];
                p0[i + 1] = q[3];
            }
            for (j, &x) in rest.iter().enumerate() {
                [&mut *p1, &mut *p2, &mut *p3][j][full] = x;
            }
        }
        // Down the patch rows, phase by phase.
        for p in 0..4 {
            for i in 0..=tw {
                let d: [f32; 6] = std::array::from_fn(|r| rows.ph[r][p][i]);
                for (r, t) in bt(d).into_iter().enumerate() {
                    rows.ph[r][p][i] = t;
                }
            }
        }
        // Across each transformed row: the six columns of tile tx.
        for s in 0..6 {
            let [p0, p1, p2, p3] = &rows.ph[s];
            // SAFETY: the caller's rows ξ = 6 s + j; tile row ri's tw values are inside them.
            let row = |j: usize| unsafe { std::slice::from_raw_parts_mut(vc.add((6 * s + j) * stride + ri * tw), tw) };
            let (v0, v1, v2, v3, v4, v5) = (row(0), row(1), row(2), row(3), row(4), row(5));
            for tx in 0..tw {
                let t = bt([p0[tx], p1[tx], p2[tx], p3[tx], p0[tx + 1], p1[tx + 1]]);
                v0[tx] = t[0];
                v1[tx] = t[1];
                v2[tx] = t[2];
                v3[tx] = t[3];
                v4[tx] = t[4];
                v5[tx] = t[5];
            }
        }
    }
}

/// `Aᵀ M A` for every tile of rows `tys`, output channel k, into its plane; `m` is
/// [36][o][tiles]; `z` is scratch (its first four phases of each row hold the across-sums).
/// Inlined into [`output_on`], so compiled for its instruction set.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn output_transform(m: &[f32], o: usize, k: usize, tiles: usize, h: usize, w: usize, tw: usize, tys: std::ops::Range<usize>, z: &mut Phases, plane: &mut [f32]) {
    let row = |xi: usize, ri: usize| &m[(xi * o + k) * tiles + ri * tw..][..tw];
    for (ri, ty) in tys.enumerate() {
        // Across: patch row s's six products of tile tx to four columns.
        for s in 0..6 {
            let mm: [&[f32]; 6] = std::array::from_fn(|j| row(6 * s + j, ri));
            let [z0, z1, z2, z3] = &mut z.ph[s];
            for tx in 0..tw {
                let q = at(std::array::from_fn(|j| mm[j][tx]));
                z0[tx] = q[0];
                z1[tx] = q[1];
                z2[tx] = q[2];
                z3[tx] = q[3];
            }
        }
        // Down, column by column, then out to the plane's rows (phases interleaved).
        for q in 0..4 {
            for tx in 0..tw {
                let y = at(std::array::from_fn(|s| z.ph[s][q][tx]));
                for (r, yv) in y.into_iter().enumerate() {
                    z.ph[r][q][tx] = yv;
                }
            }
        }
        for r in 0..4 {
            let oy = 4 * ty + r;
            if oy >= h {
                break;
            }
            let [y0, y1, y2, y3] = &z.ph[r];
            let dst = &mut plane[oy * w..(oy + 1) * w];
            let mut quads = dst.chunks_exact_mut(4);
            for (tx, q) in (&mut quads).enumerate() {
                q[0] = y0[tx];
                q[1] = y1[tx];
                q[2] = y2[tx];
                q[3] = y3[tx];
            }
            let full = w / 4;
            for (j, x) in quads.into_remainder().iter_mut().enumerate() {
                *x = [y0, y1, y2, y3][j][full];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{wins_on, Dims, Isa};

    /// The rule on the measured shapes, per ISA: AVX2 takes the 32x32 maps up to 960 x
    /// 640 channels and 32-128 channels on maps from 128x128, AVX-512 and the portable
    /// path only 256-640 channels at 64x64 and up.
    #[test]
    fn the_rule_takes_the_measured_shapes() {
        let d = |c, o, side| Dims { batch: 1, in_ch: c, out_ch: o, h: side, w: side };
        let everywhere = [d(320, 320, 64), d(640, 640, 64), d(960, 320, 64)];
        // The 32x32 maps, and few channels on large maps (in strips: winograd43_strips).
        let avx2_only = [d(320, 320, 32), d(320, 640, 32), d(640, 640, 32), d(960, 640, 32), d(64, 64, 256), d(64, 64, 128), d(128, 128, 512)];
        let nowhere = [d(1280, 1280, 32), d(1920, 640, 32), d(1280, 1280, 16), d(128, 128, 64), d(64, 3, 512), d(16, 16, 512), Dims { batch: 0, ..d(640, 640, 64) }];
        for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
            for yes in everywhere {
                assert!(wins_on(isa, yes), "{isa:?} {yes:?}");
            }
            for shape in avx2_only {
                assert_eq!(wins_on(isa, shape), isa == Isa::Avx2, "{isa:?} {shape:?}");
            }
            for no in nowhere {
                assert!(!wins_on(isa, no), "{isa:?} {no:?}");
            }
        }
    }
}
