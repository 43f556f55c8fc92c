//! [`Portable`] on aarch64: NEON intrinsics, which every aarch64 CPU has (Apple's
//! included), so no detection is needed and nothing here is behind a
//! `target_feature` gate.
//!
//! Why not leave it to the compiler: the plain-array lanes computed `a * b + c` as a
//! multiply and a separate add (Rust never contracts them into one fused
//! instruction), twice the arithmetic instructions of `fmla` in every kernel's inner
//! loop, and transposed element by element. Eight lanes are two 128-bit registers, so
//! the kernels' register blocks (6 rows x 2 vectors = 24 registers of accumulators)
//! fit NEON's 32 as they fit AVX-512's.

use std::arch::aarch64::*;

use super::{exp2_poly, transpose_tiled, Portable, Simd, TransposeTile, EXP2_MAX, EXP2_MIN};

/// Eight f32 lanes: lanes 0-3 and 4-7.
#[derive(Clone, Copy)]
pub(crate) struct N8(float32x4_t, float32x4_t);

#[inline(always)]
fn both(a: N8, b: N8, f: impl Fn(float32x4_t, float32x4_t) -> float32x4_t) -> N8 {
    N8(f(a.0, b.0), f(a.1, b.1))
}

impl Simd for Portable {
    const LANES: usize = 8;
    type V = N8;
    #[inline(always)]
    unsafe fn splat(x: f32) -> N8 {
        // SAFETY: NEON is part of every aarch64 CPU.
        unsafe {
            let v = vdupq_n_f32(x);
            N8(v, v)
        }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> N8 {
        // SAFETY: the caller passes 8 valid floats (`vld1q` needs no alignment).
        unsafe { N8(vld1q_f32(p), vld1q_f32(p.add(4))) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: N8) {
        // SAFETY: the caller passes room for 8 floats.
        unsafe {
            vst1q_f32(p, v.0);
            vst1q_f32(p.add(4), v.1);
        }
    }
    #[inline(always)]
    unsafe fn fmadd(a: N8, b: N8, c: N8) -> N8 {
        // SAFETY: NEON. `vfmaq_f32(c, a, b)` is c + a * b, rounded once.
        unsafe { N8(vfmaq_f32(c.0, a.0, b.0), vfmaq_f32(c.1, a.1, b.1)) }
    }
    #[inline(always)]
    unsafe fn add(a: N8, b: N8) -> N8 {
        // SAFETY: NEON.
        both(a, b, |x, y| unsafe { vaddq_f32(x, y) })
    }
    #[inline(always)]
    unsafe fn sub(a: N8, b: N8) -> N8 {
        // SAFETY: NEON.
        both(a, b, |x, y| unsafe { vsubq_f32(x, y) })
    }
    #[inline(always)]
    unsafe fn mul(a: N8, b: N8) -> N8 {
        // SAFETY: NEON.
        both(a, b, |x, y| unsafe { vmulq_f32(x, y) })
    }
    #[inline(always)]
    unsafe fn div(a: N8, b: N8) -> N8 {
        // SAFETY: NEON (aarch64 divides vectors).
        both(a, b, |x, y| unsafe { vdivq_f32(x, y) })
    }
    #[inline(always)]
    unsafe fn max(a: N8, b: N8) -> N8 {
        // `fmaxnm`: a NaN loses to a number, as with `f32::max`.
        // SAFETY: NEON.
        both(a, b, |x, y| unsafe { vmaxnmq_f32(x, y) })
    }
    /// 2^x, 0 below [`EXP2_MIN`] (and for NaN, as the AVX paths give): x = n + f with n
    /// the nearest integer, 2^f by the shared polynomial, 2^n built in the exponent bits.
    #[inline(always)]
    unsafe fn exp2(x: N8) -> N8 {
        // SAFETY: NEON.
        unsafe {
            let keep = |v| vcgeq_f32(v, vdupq_n_f32(EXP2_MIN));
            let keep = (keep(x.0), keep(x.1));
            let clamp = |v| vminq_f32(vmaxq_f32(v, vdupq_n_f32(EXP2_MIN)), vdupq_n_f32(EXP2_MAX));
            let x = N8(clamp(x.0), clamp(x.1));
            let n = N8(vrndnq_f32(x.0), vrndnq_f32(x.1));
            let p = exp2_poly::<Self>(Self::sub(x, n));
            let scaled = |p, n, keep| {
                let bits = vshlq_n_s32::<23>(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)));
                let r = vmulq_f32(p, vreinterpretq_f32_s32(bits));
                vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(r), keep))
            };
            N8(scaled(p.0, n.0, keep.0), scaled(p.1, n.1, keep.1))
        }
    }
    #[inline(always)]
    unsafe fn reduce_add(v: N8) -> f32 {
        // The order of the arrays' sum: ((v0 + v4) + (v1 + v5)) + ((v2 + v6) + (v3 + v7)).
        // SAFETY: NEON.
        unsafe {
            let s = vaddq_f32(v.0, v.1);
            (vgetq_lane_f32::<0>(s) + vgetq_lane_f32::<1>(s)) + (vgetq_lane_f32::<2>(s) + vgetq_lane_f32::<3>(s))
        }
    }
    /// By 4 x 4 tiles in registers, the ragged edges element by element: the GEMM
    /// transposes a linear layer's weight into its strips on every call, and for the
    /// text encoder's 77-row products one element at a time cost about as much as the
    /// product on AVX2 before its 8 x 8 tiles.
    #[inline(always)]
    unsafe fn transpose(src: *const f32, ld: usize, rows: usize, cols: usize, dst: *mut f32, ldd: usize) {
        // SAFETY: forwarded from the caller.
        unsafe { transpose_tiled::<Self>(src, ld, rows, cols, dst, ldd) }
    }
}

impl TransposeTile for Portable {
    const N: usize = 4;
    #[inline(always)]
    unsafe fn tile(src: *const f32, ld: usize, dst: *mut f32, ldd: usize) {
        // SAFETY: forwarded from the caller.
        unsafe { tile4(src, ld, dst, ldd) }
    }
}

/// One 4 x 4 tile: `dst[c * ldd + r] = src[r * ld + c]`. `trn1` / `trn2` pair the
/// rows' even and odd elements, then the same on 64-bit halves gathers each column.
///
/// SAFETY: NEON; both tiles lie in their buffers.
#[inline(always)]
unsafe fn tile4(src: *const f32, ld: usize, dst: *mut f32, ldd: usize) {
    unsafe {
        let r: [float32x4_t; 4] = std::array::from_fn(|i| vld1q_f32(src.add(i * ld)));
        // [r0[0], r1[0], r0[2], r1[2]], [r0[1], r1[1], r0[3], r1[3]], and rows 2, 3 alike.
        let t = [vtrn1q_f32(r[0], r[1]), vtrn2q_f32(r[0], r[1]), vtrn1q_f32(r[2], r[3]), vtrn2q_f32(r[2], r[3])];
        let d = |v: float32x4_t| vreinterpretq_f64_f32(v);
        let cols = [
            vtrn1q_f64(d(t[0]), d(t[2])),
            vtrn1q_f64(d(t[1]), d(t[3])),
            vtrn2q_f64(d(t[0]), d(t[2])),
            vtrn2q_f64(d(t[1]), d(t[3])),
        ];
        for (c, col) in cols.into_iter().enumerate() {
            vst1q_f32(dst.add(c * ldd), vreinterpretq_f32_f64(col));
        }
    }
}
