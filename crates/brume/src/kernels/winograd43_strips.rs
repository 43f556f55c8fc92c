//! Winograd F(4x4, 3x3) one strip of tiles at a time: for few channels on large maps
//! (the tiny VAE decoder's 64 at 128-512 px).
//!
//! [`super::winograd43`] transforms a whole chunk of tile rows (up to 16 MiB of
//! transformed input and products), then runs the 36 products over it, then the output
//! transform: three passes through memory. With many channels the products dwarf the
//! passes; with 64 they do not (36 products per tile of 64 x 64 multiply-adds against
//! 36 values written and read back per channel each way), and at 64 -> 64 the chunked
//! schedule ran slower than the direct kernel at 256x256 and level with it at 512x512.
//! Here a task takes one tile row's strip of tiles (the products' strip width, 16 on
//! AVX2) through all three steps at once: its transformed input and products (36 x c
//! x 16 and 36 x o x 16 values, 147 KB each at 64 channels) stay in the core's L2, and
//! the transformed kernel U (36 x o x c, 590 KB at 64 channels) is read from L3 by
//! every strip. The arithmetic is [`super::winograd43`]'s: the same U, the same
//! product kernel and the same transforms, vectorised across a strip's tiles.
//!
//! Measured on the AMD EPYC Zen 3 host (AVX2, 2 cores), 2026-12-07, against the direct
//! kernel in the same run (`brume bench kernels --python none --only conv3x3_64`, and
//! `conv3x3_128_512`): 64 -> 64 at 256x256 0.60-0.61x its time, at 512x512 0.61-0.63x;
//! 128 -> 128 at 512x512 0.54-0.56x. The tiny VAE decoder to 512x512 (`brume bench
//! speed --components taesd-sdxs@512`, alternated with the previous binary, twice):
//! 0.91-0.98 s -> 0.61-0.64 s, against OpenVINO f32's 0.76-0.93 in the same runs.
//! Two things mattered beyond the schedule: V's and M's 36 matrices are a cache line
//! more than 4 KiB apart ([`padded`]), worth ~10 %; and the transforms run inside
//! `target_feature` functions with no closures ([`inputs`], [`outputs`]), where the
//! first version, compiled for SSE2, spent twice the products' time in them.

use rayon::prelude::*;

use super::conv3x3::Dims;
use super::winograd43::{make_u, strip_width, Product};
use super::{Isa, SharedMut};

/// Tiles per group in the transforms: a strip is cut into groups of this many tiles,
/// each transformed as whole arrays of this length (two AVX2 vectors).
const G: usize = 16;

/// Most values in U (36 x o x c) for the strips schedule: every strip reads all of it.
const MAX_U: usize = 36 * 128 * 128;
/// Fewest tiles per image (a 128x128 map): fewer do not keep two cores busy with strips.
const MIN_TILES: usize = 32 * 32;
/// Fewest channels each way: below, the transforms outweigh the 4x saving.
const MIN_CHANNELS: usize = 32;

/// Whether the layers run `d` by F(4x4, 3x3) in strips on `isa`. AVX2 only: it is what
/// was measured (AMD EPYC Zen 3, 2026-12-07; see [`super::winograd43::wins_on`]).
pub(crate) fn wins_on(isa: Isa, d: Dims) -> bool {
    let tiles = d.h.div_ceil(4) * d.w.div_ceil(4);
    matches!(isa, Isa::Avx2) && d.batch > 0 && tiles >= MIN_TILES && d.in_ch.min(d.out_ch) >= MIN_CHANNELS && 36 * d.in_ch * d.out_ch <= MAX_U
}

/// Bytes a call allocates beyond its output: U, and per thread one strip's
/// transformed input and products.
pub(crate) fn scratch_bytes(isa: Isa, d: Dims) -> usize {
    let nr = strip_width(isa);
    36 * d.in_ch * d.out_ch * 4 + rayon::current_num_threads() * 36 * (padded(d.in_ch * nr) + padded(d.out_ch * nr)) * 4
}

/// `x` [b, c, h, w] with `w` [o, c, 3, 3], padding 1, by F(4x4, 3x3) in strips
/// whatever the sizes, on `isa` (tests and benches).
pub fn conv3x3_on(isa: Isa, x: &candle_core::Tensor, w: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
    super::winograd::on_tensors("winograd F(4x4, 3x3) in strips", x, w, |xs, d, ws, out| {
        super::require(isa)?;
        if d.check("winograd F(4x4, 3x3) in strips", xs, ws, out)? {
            run_on(isa, xs, d, ws, out, false);
        }
        Ok(())
    })
}

/// The whole convolution (sizes checked, `isa` confirmed); `up` as in
/// [`super::winograd43::run`].
pub(crate) fn run_on(isa: Isa, x: &[f32], d: Dims, weights: &[f32], out: &mut [f32], up: bool) {
    let Dims { batch, in_ch: c, out_ch: o, h, w } = d;
    let nr = strip_width(isa);
    let (th, tw) = (h.div_ceil(4), w.div_ceil(4));
    let strips = tw.div_ceil(nr);
    let mut u = Vec::new();
    make_u(isa, weights, c, o, 0..6, &mut u);
    let u = &u[..];
    let plane_len = if up { (h / 2) * (w / 2) } else { h * w };
    let dst = SharedMut(out.as_mut_ptr());
    let (vs, ms) = (padded(c * nr), padded(o * nr));
    (0..batch * th * strips).into_par_iter().for_each_init(
        || (vec![0f32; 36 * vs], vec![0f32; 36 * ms]),
        |(v, m), t| {
            let (n, ty, s) = (t / (th * strips), t / strips % th, t % strips);
            let img = &x[n * c * plane_len..(n + 1) * c * plane_len];
            let tx0 = s * nr;
            // SAFETY: `isa` was confirmed before any task ran.
            unsafe { inputs(isa, img, plane_len, h, w, up, ty, tx0, nr, vs, v) };
            for xi in 0..36 {
                let job = Product { a: &u[xi * o * c..(xi + 1) * o * c], strip: &v[xi * vs..xi * vs + c * nr], o, c };
                // SAFETY: M[ξ] is o rows of nr values inside m (36 ms long); `isa` was confirmed.
                unsafe { job.run(isa, m.as_mut_ptr().add(xi * ms), nr, nr) };
            }
            // SAFETY: this task alone writes rows 4 ty.. and the columns of its strip's
            // tiles in image n's planes; `isa` was confirmed.
            unsafe { outputs(isa, m, o, nr, ms, h, w, ty, tx0, nr.min(tw - tx0), dst.get().add(n * o * h * w)) };
        },
    );
}

/// The distance between consecutive ξ in a strip's V or M: `len` values and one cache
/// line more. At 64 channels their 36 matrices of 64 x 16 values lie exactly 4 KiB
/// apart, so a transform's 36 writes (or reads) of one channel all map to the same L1
/// set, of which there are eight ways.
fn padded(len: usize) -> usize {
    len + 16
}

on_isa_fn! {
    /// The transformed input of one task's strip (tiles tx0.. of tile row ty) for every
    /// channel plane of `img`, into V [36][c][nr] (ξ `vs` apart).
    ///
    /// SAFETY: the CPU runs `isa`.
    unsafe fn inputs(img: &[f32], plane_len: usize, h: usize, w: usize, up: bool, ty: usize, tx0: usize, nr: usize, vs: usize, v: &mut [f32]) {
        for (ci, plane) in img.chunks_exact(plane_len).enumerate() {
            for g0 in (0..nr).step_by(G) {
                input_group(plane, h, w, up, ty, tx0 + g0, v, ci * nr + g0, vs);
            }
        }
    }
}

on_isa_fn! {
    /// The outputs of one task's strip from its products M [36][o][nr] (ξ `ms` apart),
    /// for the first `live` tiles, into image `out`'s o planes of h x w.
    ///
    /// SAFETY: the CPU runs `isa`; `out` holds o planes of h x w values, of which no one
    /// else writes these tiles' meanwhile.
    unsafe fn outputs(m: &[f32], o: usize, nr: usize, ms: usize, h: usize, w: usize, ty: usize, tx0: usize, live: usize, out: *mut f32) {
        for k in 0..o {
            for g0 in (0..live).step_by(G) {
                // SAFETY: plane k lies in `out`, and these tiles' outputs are this task's
                // alone (the caller's contract).
                unsafe { output_group(m, ms, k, nr, g0, h, w, ty, tx0 + g0, out.add(k * h * w)) };
            }
        }
    }
}

/// `Bᵀ d B` of one channel for the G tiles of tile row `ty` from tile `t0`, as in
/// [`super::winograd43`]: value ξ of tile t0 + i goes to `v[at + ξ * stride + i]`.
/// Tiles past the map's edge read zeros.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn input_group(plane: &[f32], h: usize, w: usize, up: bool, ty: usize, t0: usize, v: &mut [f32], at: usize, stride: usize) {
    // d[r][j][i]: patch row r, column j of tile t0 + i, input (4 ty - 1 + r, 4 (t0 + i) - 1 + j).
    let mut d = [[[0f32; G]; 6]; 6];
    let x0 = 4 * t0 as isize - 1;
    for (r, dr) in d.iter_mut().enumerate() {
        let Some(iy) = (4 * ty + r).checked_sub(1).filter(|&y| y < h) else { continue };
        // Input columns x0 .. x0 + 4 G + 2 of row iy, zero outside [0, w).
        let mut row = [0f32; 4 * G + 2];
        let lo = (-x0).max(0) as usize;
        let hi = ((w as isize - x0).max(0) as usize).min(row.len());
        if lo < hi {
            let first = (x0 + lo as isize) as usize;
            if up {
                let src = &plane[(iy / 2) * (w / 2)..(iy / 2 + 1) * (w / 2)];
                for (q, slot) in row[lo..hi].iter_mut().enumerate() {
                    *slot = src[(first + q) / 2];
                }
            } else {
                row[lo..hi].copy_from_slice(&plane[iy * w + first..iy * w + first + (hi - lo)]);
            }
        }
        for (j, col) in dr.iter_mut().enumerate() {
            for (i, x) in col.iter_mut().enumerate() {
                *x = row[4 * i + j];
            }
        }
    }
    // Down each column j, then across each transformed row s.
    // (Plain loops and indexing here: `std::array::from_fn`'s closures were left as
    // calls, compiled without the vector instruction set.)
    for j in 0..6 {
        let t = bt([d[0][j], d[1][j], d[2][j], d[3][j], d[4][j], d[5][j]]);
        for (r, tr) in t.into_iter().enumerate() {
            d[r][j] = tr;
        }
    }
    for (s, ds) in d.iter().enumerate() {
        for (j, t) in bt(*ds).into_iter().enumerate() {
            let xi = 6 * s + j;
            v[at + xi * stride..at + xi * stride + G].copy_from_slice(&t);
        }
    }
}

/// `Aᵀ M A` for output channel `k` of the G tiles from strip position `g0` (tile
/// `t0` of row `ty`), M being [36][o][nr]; writes their 4x4 outputs inside the map.
/// Only those outputs are borrowed: other tasks write the rest of the plane meanwhile.
///
/// SAFETY: `plane` holds h x w values, of which no one else touches these tiles' outputs.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn output_group(m: &[f32], ms: usize, k: usize, nr: usize, g0: usize, h: usize, w: usize, ty: usize, t0: usize, plane: *mut f32) {
    // Across each patch row s (six products to four columns), then down each column q.
    let mut z = [[[0f32; G]; 4]; 6];
    for (s, zs) in z.iter_mut().enumerate() {
        let mut row = [[0f32; G]; 6];
        for (j, r) in row.iter_mut().enumerate() {
            let from = (6 * s + j) * ms + k * nr + g0;
            r.copy_from_slice(&m[from..from + G]);
        }
        *zs = at(row);
    }
    let mut ys = [[[0f32; G]; 4]; 4];
    for (q, yq) in ys.iter_mut().enumerate() {
        *yq = at([z[0][q], z[1][q], z[2][q], z[3][q], z[4][q], z[5][q]]);
    }
    // Row r of the tiles' outputs: column 4 i + q of the group is ys[q][r][i].
    let x0 = 4 * t0;
    let n = (4 * G).min(w.saturating_sub(x0));
    for r in 0..4 {
        let oy = 4 * ty + r;
        if oy >= h || n == 0 {
            break;
        }
        let mut row = [0f32; 4 * G];
        for i in 0..G {
            for q in 0..4 {
                row[4 * i + q] = ys[q][r][i];
            }
        }
        // SAFETY: row oy < h, columns x0..x0 + n <= w: inside the plane, and this group's.
        unsafe { std::slice::from_raw_parts_mut(plane.add(oy * w + x0), n) }.copy_from_slice(&row[..n]);
    }
}

/// `Bᵀ d` on G tiles at once: [`super::winograd43`]'s transform, tile by tile.
#[inline(always)]
fn bt(d: [[f32; G]; 6]) -> [[f32; G]; 6] {
    per_tile(d, super::winograd43::bt)
}

/// `Aᵀ m`, six values to four, on G tiles at once: [`super::winograd43`]'s transform.
#[inline(always)]
fn at(m: [[f32; G]; 6]) -> [[f32; G]; 4] {
    per_tile(m, super::winograd43::at)
}

/// `f` (six values to N) on each of G tiles: tile i's values are `x[..][i]`.
#[inline(always)]
fn per_tile<const N: usize>(x: [[f32; G]; 6], f: impl Fn([f32; 6]) -> [f32; N]) -> [[f32; G]; N] {
    let mut y = [[0f32; G]; N];
    for i in 0..G {
        let col = f([x[0][i], x[1][i], x[2][i], x[3][i], x[4][i], x[5][i]]);
        for (yr, v) in y.iter_mut().zip(col) {
            yr[i] = v;
        }
    }
    y
}
