//! Winograd F(2x2, 3x3): the f32 3x3 convolution of large maps in 16 products per
//! 2x2 block of outputs instead of 36.
//!
//! The direct kernel ([`super::conv3x3`]) runs near the machine's FMA ceiling, so the
//! only way past it is fewer multiplications. Each 4x4 input patch `d` (stride 2) and
//! each 3x3 kernel `g` are transformed (`V = Bᵀ d B`, `U = G g Gᵀ`); a 2x2 output block
//! is then `Aᵀ (U ⊙ V) A`, and summed over input channels the elementwise product is
//! 16 independent matrix products `M[ξ] = U[ξ] V[ξ]` ([K x C] by [C x tiles]) that
//! run on the register-blocked GEMM. The transforms add and subtract only (and halve,
//! for `U`), so in f32 the result stays within a few ulps of the direct sum.
//!
//! Memory stays bounded: the transformed kernel (16/9 of the kernel) is made per call
//! and layers whose copy would pass [`U_MAX`] keep the direct kernel; the input is
//! transformed a chunk of tile rows at a time so the transformed input and the
//! products stay near [`CHUNK`] together. The memory estimator counts both
//! ([`scratch_bytes`]).
//!
//! Small maps keep the direct kernel: with few tiles each product is a thin GEMM and
//! the transforms' memory traffic is no longer small beside it.
//!
//! The layers' default is F(4x4, 3x3) ([`super::winograd43`]), which saves 4x
//! instead of 2.25x; this transform stays behind `BRUME_WINOGRAD=f2` to measure
//! against. This module also holds the switch between them ([`Mode`], [`choose`]).
//! Measured when this was the only one (`brume bench kernels --only conv3x3`, an Intel
//! Xeon with AVX-512, 2026-12-03): 320->320 at 64x64 0.040 s vs 0.040 direct; 640->640
//! at 32x32 0.050 vs 0.035. Inside a 320-channel call the 16 products took 26-34 ms
//! (110-130 GFLOP/s: the GEMM on [320 x 320] x [320 x 384] runs well below the direct
//! kernel's 190-250), the transforms 5 ms, and making the transformed kernel and the
//! chunk buffers (fresh pages) 6-25 ms.

use candle_core::Result;
use rayon::prelude::*;

use super::conv3x3::Dims;
use super::matmul::{gemm, BLayout};
use super::{require, Isa, SharedMut};

/// Most bytes of transformed kernel a call makes (the 320- and 640-channel levels of
/// an SD UNet fit; the 1280-channel ones, at 16x16 and 8x8, do not and are small maps).
const U_MAX: usize = 40 << 20;
/// Bytes of transformed input plus products per chunk of tile rows.
const CHUNK: usize = 16 << 20;
/// Smallest side, input and output channel count the transform pays for (measured with
/// `brume bench kernels --only conv3x3`; see the README's speed section).
const MIN_SIDE: usize = 16;
const MIN_CHANNELS: usize = 32;

/// How a Winograd convolution walks its map (all three transforms): `th x tw` tiles,
/// `rows` tile rows per chunk, so that a chunk's transformed input and products stay
/// near a byte budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(super) th: usize,
    pub(super) tw: usize,
    pub(super) rows: usize,
}

/// Which Winograd transforms the layers may take for f32 3x3 convolutions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The direct kernel everywhere.
    Off,
    /// F(4x4, 3x3) where it beats the direct kernel ([`super::winograd43::wins`]); the default.
    Auto,
    /// F(2x2, 3x3) on large maps (the earlier opt-in; slower than `Auto`, kept to measure).
    F2,
}

impl Mode {
    /// `off`, `auto` or `f2` (`on` and `1`, the old opt-in, mean `f2`).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "off" | "0" => Some(Self::Off),
            "auto" => Some(Self::Auto),
            "f2" | "on" | "1" => Some(Self::F2),
            _ => None,
        }
    }
}

/// 0: not yet decided (read `BRUME_WINOGRAD` on first use), else 1 + the mode's index.
static SWITCH: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
const MODES: [Mode; 3] = [Mode::Off, Mode::Auto, Mode::F2];

/// The layers' Winograd mode: [`set_mode`], else `BRUME_WINOGRAD` (`off`, `auto`, `f2`),
/// else [`Mode::Auto`]. An unreadable value is warned about once and means `auto`.
pub fn mode() -> Mode {
    use std::sync::atomic::Ordering;
    match SWITCH.load(Ordering::Relaxed) {
        0 => {
            let env = std::env::var("BRUME_WINOGRAD").ok();
            let m = match env.as_deref().map(Mode::parse) {
                None => Mode::Auto,
                Some(Some(m)) => m,
                Some(None) => {
                    tracing::warn!("BRUME_WINOGRAD={:?} is not off, auto or f2; using auto", env.unwrap_or_default());
                    Mode::Auto
                }
            };
            let i = MODES.iter().position(|&x| x == m).unwrap_or(1) as u8;
            let _ = SWITCH.compare_exchange(0, 1 + i, Ordering::Relaxed, Ordering::Relaxed);
            mode()
        }
        v => MODES[(v as usize - 1).min(MODES.len() - 1)],
    }
}

/// Sets the layers' Winograd mode (process-wide, as [`super::set_mode`]).
pub fn set_mode(m: Mode) {
    let i = MODES.iter().position(|&x| x == m).unwrap_or(1) as u8;
    SWITCH.store(1 + i, std::sync::atomic::Ordering::Relaxed);
}

/// How the layers run a 3x3 convolution of `d` in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Choice {
    Direct,
    F2(Plan),
    F4,
}

/// The layers' choice for `d` under the current [`mode`].
pub(crate) fn choose(d: Dims) -> Choice {
    match mode() {
        Mode::Off => Choice::Direct,
        Mode::Auto if super::winograd43::wins(d) => Choice::F4,
        Mode::Auto => Choice::Direct,
        Mode::F2 => plan(d).map_or(Choice::Direct, Choice::F2),
    }
}

/// The F(2x2, 3x3) plan for `d` when its size rules allow it, else `None`.
pub(crate) fn plan(d: Dims) -> Option<Plan> {
    let Dims { batch, in_ch: c, out_ch: o, h, w } = d;
    if batch == 0 || h.min(w) < MIN_SIDE || c.min(o) < MIN_CHANNELS || u_bytes(c, o) > U_MAX {
        return None;
    }
    Some(Plan::new(2, 16 * 4 * (c + o), h, w, CHUNK))
}

impl Plan {
    /// Tiles of `side` x `side` outputs over an h x w map, each chunk at most `budget`
    /// bytes at `per_tile` bytes per tile (at least one tile row).
    pub(super) fn new(side: usize, per_tile: usize, h: usize, w: usize, budget: usize) -> Self {
        let (th, tw) = (h.div_ceil(side), w.div_ceil(side));
        Self { th, tw, rows: (budget / (per_tile * tw).max(1)).clamp(1, th.max(1)) }
    }

    /// Tiles per chunk (the products' column count).
    pub(super) fn tiles(&self) -> usize {
        self.rows * self.tw
    }

    /// Each chunk's tile rows.
    pub(super) fn chunks(&self) -> impl Iterator<Item = std::ops::Range<usize>> {
        let (th, rows) = (self.th, self.rows.max(1));
        (0..th).step_by(rows).map(move |t| t..(t + rows).min(th))
    }
}

fn u_bytes(c: usize, o: usize) -> usize {
    16 * c * o * 4
}

/// Bytes a Winograd call for `d` allocates beyond its output (the transformed kernel,
/// and one chunk's transformed input and products); `None` when the layers run `d` on
/// the direct kernel.
pub(crate) fn scratch_bytes(d: Dims) -> Option<usize> {
    match choose(d) {
        Choice::Direct => None,
        Choice::F2(p) => Some(u_bytes(d.in_ch, d.out_ch) + 16 * 4 * (d.in_ch + d.out_ch) * p.tiles()),
        Choice::F4 => Some(super::winograd43::scratch_bytes(d)),
    }
}

/// 3x3 / stride 1 / padding 1 convolution of `x` [b, c, h, w] with `w` [o, c, 3, 3]
/// (no bias) by Winograd whatever the sizes, on the instruction set `isa` (tests and
/// benches; the layers go through [`super::conv3x3::run_best`]).
pub fn conv3x3_on(isa: Isa, x: &candle_core::Tensor, w: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    on_tensors("winograd conv3x3", x, w, |xs, d, ws, out| run(isa, xs, d, ws, out))
}

/// A padding-1 3x3 convolution of tensors `x` [b, c, h, w] and `w` [o, c, 3, 3] by
/// `run` on their f32 values, into a new [b, o, h, w] tensor (the tests' and benches'
/// entry points; `what` names the kernel in the error for a kernel of another shape).
pub(crate) fn on_tensors(
    what: &str,
    x: &candle_core::Tensor,
    w: &candle_core::Tensor,
    run: impl FnOnce(&[f32], Dims, &[f32], &mut [f32]) -> Result<()>,
) -> Result<candle_core::Tensor> {
    let (b, c, h, wd) = x.dims4()?;
    let (o, wc, kh, kw) = w.dims4()?;
    if (kh, kw) != (3, 3) || wc != c {
        candle_core::bail!("{what}: kernel {:?} does not fit input {:?}", w.dims(), x.dims());
    }
    let xs = x.flatten_all()?.to_vec1::<f32>()?;
    let ws = w.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0f32; b * o * h * wd];
    run(&xs, Dims { batch: b, in_ch: c, out_ch: o, h, w: wd }, &ws, &mut out)?;
    candle_core::Tensor::from_vec(out, (b, o, h, wd), x.device())
}

/// `out` [b, o, h, w] = conv(`x` [b, c, h, w], `weights` [o, c, 3, 3]), padding 1, by
/// Winograd whatever the sizes (the layers ask [`plan`] first).
pub(crate) fn run(isa: Isa, x: &[f32], d: Dims, weights: &[f32], out: &mut [f32]) -> Result<()> {
    require(isa)?;
    if !d.check("winograd conv3x3", x, weights, out)? {
        return Ok(());
    }
    let Dims { batch, in_ch: c, out_ch: o, h, w } = d;
    let p = Plan::new(2, 16 * 4 * (c + o), h, w, CHUNK);
    // U [16][o][c] and V [16][c][tiles]: every product reads whole rows. (With ξ
    // inside, rows 16c apart put the GEMM's six rows of A in one cache set: 110
    // GFLOP/s instead of 190.)
    let mut u = vec![0f32; 16 * c * o];
    let ushare = SharedMut(u.as_mut_ptr());
    weights.par_chunks(9 * c).enumerate().for_each(|(k, wk)| {
        for (ci, g) in wk.chunks_exact(9).enumerate() {
            for (xi, v) in kernel_transform(g).into_iter().enumerate() {
                // SAFETY: task k writes only U[ξ][k][..], inside u (16 o c values).
                unsafe { *ushare.get().add((xi * o + k) * c + ci) = v };
            }
        }
    });
    let most = p.tiles();
    // V [c][16][tiles] and M [16][o][tiles] for one chunk.
    let mut v = vec![0f32; 16 * c * most];
    let mut m = vec![0f32; 16 * o * most];
    for n in 0..batch {
        let img = &x[n * c * h * w..(n + 1) * c * h * w];
        let dst = &mut out[n * o * h * w..(n + 1) * o * h * w];
        for tys in p.chunks() {
            let (ty0, ty1) = (tys.start, tys.end);
            let tiles = (ty1 - ty0) * p.tw;
            let v = &mut v[..16 * c * tiles];
            let m = &mut m[..16 * o * tiles];
            let vshare = SharedMut(v.as_mut_ptr());
            img.par_chunks(h * w).enumerate().for_each_init(
                || Rows::new(p.tw),
                // SAFETY: channel ci writes only V[ξ][ci][..], inside v (16 c tiles values).
                |rows, (ci, plane)| unsafe { input_transform(plane, h, w, p.tw, ty0..ty1, rows, vshare.get().add(ci * tiles), c * tiles) },
            );
            for xi in 0..16 {
                let (a, b) = (&u[xi * o * c..(xi + 1) * o * c], &v[xi * c * tiles..(xi + 1) * c * tiles]);
                gemm(isa, o, tiles, c, a, c, b, BLayout::KN { ld: tiles }, &mut m[xi * o * tiles..(xi + 1) * o * tiles])?;
            }
            let m = &*m;
            dst.par_chunks_mut(h * w).enumerate().for_each(|(k, plane)| {
                output_transform(m, o, k, tiles, h, w, p.tw, ty0..ty1, plane);
            });
        }
    }
    Ok(())
}

/// `G g Gᵀ` for one 3x3 kernel `g` (row-major), as 16 values ξ = 4 i + j.
pub(super) fn kernel_transform(g: &[f32]) -> [f32; 16] {
    // Rows first: t = G g, G = [[1, 0, 0], [½, ½, ½], [½, -½, ½], [0, 0, 1]].
    let mut t = [[0f32; 3]; 4];
    for j in 0..3 {
        let (g0, g1, g2) = (g[j], g[3 + j], g[6 + j]);
        t[0][j] = g0;
        t[1][j] = 0.5 * (g0 + g1 + g2);
        t[2][j] = 0.5 * (g0 - g1 + g2);
        t[3][j] = g2;
    }
    let mut u = [0f32; 16];
    for (i, r) in t.iter().enumerate() {
        u[4 * i] = r[0];
        u[4 * i + 1] = 0.5 * (r[0] + r[1] + r[2]);
        u[4 * i + 2] = 0.5 * (r[0] - r[1] + r[2]);
        u[4 * i + 3] = r[2];
    }
    u
}

/// One input channel's rows split by column parity, reused across tile rows:
/// `even[r][i]` = input column 2i - 1 and `odd[r][i]` = column 2i of patch row r
/// (zero outside the image), i in 0..=tw, then combined down the patch rows.
pub(super) struct Rows {
    even: [Vec<f32>; 4],
    odd: [Vec<f32>; 4],
}

impl Rows {
    pub(super) fn new(tw: usize) -> Self {
        let row = || vec![0f32; tw + 1];
        Self { even: std::array::from_fn(|_| row()), odd: std::array::from_fn(|_| row()) }
    }
}

/// `Bᵀ d B` for every tile of rows `tys` of one channel's plane, into `vc`: value ξ of
/// the tiles at `vc + ξ * stride`; patch (i, j) of tile (ty, tx) is input
/// (2 ty - 1 + i, 2 tx - 1 + j).
///
/// SAFETY: `vc + ξ * stride` holds `tys.len() * tw` values for every ξ < 16, written
/// by no one else meanwhile.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn input_transform(plane: &[f32], h: usize, w: usize, tw: usize, tys: std::ops::Range<usize>, rows: &mut Rows, vc: *mut f32, stride: usize) {
    for (ri, ty) in tys.enumerate() {
        for r in 0..4 {
            let (even, odd) = (&mut rows.even[r][..tw + 1], &mut rows.odd[r][..tw + 1]);
            even.fill(0.0);
            odd.fill(0.0);
            let Some(iy) = (2 * ty + r).checked_sub(1).filter(|&y| y < h) else { continue };
            let src = &plane[iy * w..(iy + 1) * w];
            let pairs = src.chunks_exact(2);
            if let [last] = pairs.remainder() {
                odd[w / 2] = *last;
            }
            for (i, p) in pairs.enumerate() {
                odd[i] = p[0];
                even[i + 1] = p[1];
            }
        }
        // Down the patch rows (Bᵀ d): t0 = d0 - d2, t1 = d1 + d2, t2 = d2 - d1, t3 = d1 - d3.
        for half in [&mut rows.even, &mut rows.odd] {
            let [d0, d1, d2, d3] = half;
            for i in 0..=tw {
                let (a, b, c, e) = (d0[i], d1[i], d2[i], d3[i]);
                d0[i] = a - c;
                d1[i] = b + c;
                d2[i] = c - b;
                d3[i] = b - e;
            }
        }
        // Across (… B): columns (a, b, c, e) = (even[tx], odd[tx], even[tx + 1], odd[tx + 1]).
        for r in 0..4 {
            let (even, odd) = (&rows.even[r], &rows.odd[r]);
            // SAFETY: the caller's rows ξ = 4 r + j; tile row ri's tw values are inside them.
            let row = |j: usize| unsafe { std::slice::from_raw_parts_mut(vc.add((4 * r + j) * stride + ri * tw), tw) };
            let (v0, v1, v2, v3) = (row(0), row(1), row(2), row(3));
            for tx in 0..tw {
                let (a, b, c, e) = (even[tx], odd[tx], even[tx + 1], odd[tx + 1]);
                v0[tx] = a - c;
                v1[tx] = b + c;
                v2[tx] = c - b;
                v3[tx] = b - e;
            }
        }
    }
}

/// `Aᵀ M A` for every tile of rows `tys`, output channel k, into its plane:
/// `m` is [16][o][tiles].
#[allow(clippy::too_many_arguments)]
pub(super) fn output_transform(m: &[f32], o: usize, k: usize, tiles: usize, h: usize, w: usize, tw: usize, tys: std::ops::Range<usize>, plane: &mut [f32]) {
    let row = |xi: usize, ri: usize| &m[(xi * o + k) * tiles + ri * tw..][..tw];
    let mut y = [vec![0f32; tw], vec![0f32; tw], vec![0f32; tw], vec![0f32; tw]];
    for (ri, ty) in tys.enumerate() {
        let mm: [&[f32]; 16] = std::array::from_fn(|xi| row(xi, ri));
        let [y00, y01, y10, y11] = &mut y;
        for tx in 0..tw {
            let at = |xi: usize| mm[xi][tx];
            // Down (Aᵀ M, Aᵀ = [[1, 1, 1, 0], [0, 1, -1, -1]]), then across.
            let s0: [f32; 4] = std::array::from_fn(|j| at(j) + at(4 + j) + at(8 + j));
            let s1: [f32; 4] = std::array::from_fn(|j| at(4 + j) - at(8 + j) - at(12 + j));
            y00[tx] = s0[0] + s0[1] + s0[2];
            y01[tx] = s0[1] - s0[2] - s0[3];
            y10[tx] = s1[0] + s1[1] + s1[2];
            y11[tx] = s1[1] - s1[2] - s1[3];
        }
        for (dy, (left, right)) in [(&*y00, &*y01), (&*y10, &*y11)].into_iter().enumerate() {
            let oy = 2 * ty + dy;
            if oy >= h {
                break;
            }
            let dst = &mut plane[oy * w..(oy + 1) * w];
            let mut pairs = dst.chunks_exact_mut(2);
            for (tx, p) in (&mut pairs).enumerate() {
                p[0] = left[tx];
                p[1] = right[tx];
            }
            if let [last] = pairs.into_remainder() {
                *last = left[w / 2];
            }
        }
    }
}
