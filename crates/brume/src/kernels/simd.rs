//! A small vector abstraction the kernels are written once against, with one
//! implementation per instruction set. Every method is `#[inline(always)]` and the
//! kernels are instantiated inside `#[target_feature]` entry points, so the
//! intrinsics inline into code compiled for the detected CPU.
//!
//! All methods are `unsafe`: the x86 ones need the CPU feature (guaranteed by
//! [`super::isa`] before an entry point is called) and loads/stores take raw
//! pointers to `LANES` valid floats.

/// Taylor coefficients of 2^f = e^(f ln 2) on [-0.5, 0.5]; degree 6 keeps the
/// relative error under 1.3e-7, below f32 rounding of the attention sums.
pub(crate) const EXP2_C: [f32; 7] = [
    1.0,
    std::f32::consts::LN_2,
    0.240_226_5,
    0.055_504_11,
    0.009_618_129,
    0.001_333_355_8,
    0.000_154_035_3,
];

/// Below this, 2^x is under the smallest normal f32 and exp2 returns 0 (so a
/// masked score of -inf weighs exactly nothing).
pub(crate) const EXP2_MIN: f32 = -126.0;
const EXP2_MAX: f32 = 127.0;

pub(crate) trait Simd: Copy {
    const LANES: usize;
    type V: Copy;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    /// a * b + c
    unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// 2^x, 0 below -126.
    unsafe fn exp2(x: Self::V) -> Self::V;
    unsafe fn reduce_add(v: Self::V) -> f32;

    /// `LANES` floats from `p`, lane i read only where bit i of `lanes` is set and 0
    /// elsewhere (a dense flat conv's border columns). Lane by lane here; AVX-512
    /// masks the load itself.
    ///
    /// SAFETY: every lane whose bit is set may be read at `p + i`.
    #[inline(always)]
    unsafe fn load_lanes(p: *const f32, lanes: u64) -> Self::V {
        let mut v = [0f32; 64];
        for (i, x) in v.iter_mut().enumerate().take(Self::LANES) {
            if lanes >> i & 1 == 1 {
                // SAFETY: the caller's contract for set lanes.
                *x = unsafe { *p.add(i) };
            }
        }
        // SAFETY: v holds 64 >= LANES floats.
        unsafe { Self::load(v.as_ptr()) }
    }

    /// `dst[c * ldd + r] = src[r * ld + c]` for r < rows, c < cols: packing a linear
    /// layer's [n, k] weight into a GEMM strip. One element at a time here; AVX-512
    /// moves 16 x 16 tiles through registers (the compiler made this loop a scatter,
    /// ~10 % of a 4096 x 320 x 320 product).
    ///
    /// SAFETY: `src` holds `rows` rows of `cols` floats `ld` apart, `dst` `cols` rows
    /// of `rows` floats `ldd` apart, and they do not overlap.
    #[inline(always)]
    unsafe fn transpose(src: *const f32, ld: usize, rows: usize, cols: usize, dst: *mut f32, ldd: usize) {
        unsafe { transpose_scalar(src, ld, 0, rows, 0, cols, dst, ldd) }
    }

    /// x * sigmoid(x) = x / (1 + e^-x).
    #[inline(always)]
    unsafe fn silu(x: Self::V) -> Self::V {
        let e = Self::exp2(Self::mul(x, Self::splat(-std::f32::consts::LOG2_E)));
        Self::div(x, Self::add(Self::splat(1.0), e))
    }
}

/// [`Simd::transpose`] of rows r0..r1 x columns c0..c1, one element at a time.
///
/// SAFETY: as [`Simd::transpose`], for those rows and columns.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn transpose_scalar(src: *const f32, ld: usize, r0: usize, r1: usize, c0: usize, c1: usize, dst: *mut f32, ldd: usize) {
    for r in r0..r1 {
        for c in c0..c1 {
            unsafe { *dst.add(c * ldd + r) = *src.add(r * ld + c) };
        }
    }
}

/// The polynomial part of exp2 on f in [-0.5, 0.5], in Horner form (the vector
/// paths; the plain-array one runs the same polynomial per lane in `exp2_scalar`).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
unsafe fn exp2_poly<S: Simd>(f: S::V) -> S::V {
    let mut p = S::splat(EXP2_C[6]);
    for &c in EXP2_C[..6].iter().rev() {
        p = S::fmadd(p, f, S::splat(c));
    }
    p
}

/// The square tile an instruction set transposes in registers.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
trait TransposeTile {
    const N: usize;
    /// One N x N tile: `dst[c * ldd + r] = src[r * ld + c]`.
    ///
    /// SAFETY: the CPU has the instruction set; both tiles lie in their buffers.
    unsafe fn tile(src: *const f32, ld: usize, dst: *mut f32, ldd: usize);
}

/// [`Simd::transpose`] by whole tiles of `T` in registers, the ragged edges element by element.
///
/// SAFETY: as [`Simd::transpose`], and the CPU has `T`'s instruction set.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
unsafe fn transpose_tiled<T: TransposeTile>(src: *const f32, ld: usize, rows: usize, cols: usize, dst: *mut f32, ldd: usize) {
    let (rt, ct) = (rows / T::N * T::N, cols / T::N * T::N);
    unsafe {
        for r in (0..rt).step_by(T::N) {
            for c in (0..ct).step_by(T::N) {
                T::tile(src.add(r * ld + c), ld, dst.add(c * ldd + r), ldd);
            }
        }
        transpose_scalar(src, ld, 0, rt, ct, cols, dst, ldd);
        transpose_scalar(src, ld, rt, rows, 0, cols, dst, ldd);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{exp2_poly, transpose_tiled, Simd, TransposeTile, EXP2_MAX, EXP2_MIN};

    impl TransposeTile for Avx512 {
        const N: usize = 16;
        #[inline(always)]
        unsafe fn tile(src: *const f32, ld: usize, dst: *mut f32, ldd: usize) {
            // SAFETY: forwarded from the caller.
            unsafe { transpose16(src, ld, dst, ldd) }
        }
    }

    impl TransposeTile for Avx2 {
        const N: usize = 8;
        #[inline(always)]
        unsafe fn tile(src: *const f32, ld: usize, dst: *mut f32, ldd: usize) {
            // SAFETY: forwarded from the caller.
            unsafe { transpose8(src, ld, dst, ldd) }
        }
    }

    /// One 16 x 16 tile: `dst[c * ldd + r] = src[r * ld + c]`, in 16 loads, 64
    /// shuffles and 16 stores (32-bit, then 64-bit interleaves within 128-bit lanes,
    /// then two rounds of 128-bit lane selection).
    ///
    /// SAFETY: the CPU has AVX-512F; both tiles lie in their buffers.
    #[inline(always)]
    unsafe fn transpose16(src: *const f32, ld: usize, dst: *mut f32, ldd: usize) {
        unsafe {
            let r: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(src.add(i * ld)));
            // t[2i], t[2i + 1]: rows 2i and 2i + 1 interleaved (elements 0-1, 2-3 of each lane).
            let t: [__m512; 16] = std::array::from_fn(|i| {
                let (a, b) = (r[i & !1], r[i | 1]);
                if i % 2 == 0 { _mm512_unpacklo_ps(a, b) } else { _mm512_unpackhi_ps(a, b) }
            });
            // u[4g + e]: column 4L + e of rows 4g..4g + 4, in lane L.
            let u: [__m512; 16] = std::array::from_fn(|i| {
                let (g, e) = (i / 4, i % 4);
                let (a, b) = (_mm512_castps_pd(t[4 * g + e / 2]), _mm512_castps_pd(t[4 * g + 2 + e / 2]));
                _mm512_castpd_ps(if e % 2 == 0 { _mm512_unpacklo_pd(a, b) } else { _mm512_unpackhi_pd(a, b) })
            });
            for e in 0..4 {
                // Lanes 0, 2 (0x88) and 1, 3 (0xDD) of row groups 0 and 1, then 2 and 3.
                let v1 = _mm512_shuffle_f32x4::<0x88>(u[e], u[4 + e]);
                let v2 = _mm512_shuffle_f32x4::<0xDD>(u[e], u[4 + e]);
                let w1 = _mm512_shuffle_f32x4::<0x88>(u[8 + e], u[12 + e]);
                let w2 = _mm512_shuffle_f32x4::<0xDD>(u[8 + e], u[12 + e]);
                _mm512_storeu_ps(dst.add(e * ldd), _mm512_shuffle_f32x4::<0x88>(v1, w1));
                _mm512_storeu_ps(dst.add((4 + e) * ldd), _mm512_shuffle_f32x4::<0x88>(v2, w2));
                _mm512_storeu_ps(dst.add((8 + e) * ldd), _mm512_shuffle_f32x4::<0xDD>(v1, w1));
                _mm512_storeu_ps(dst.add((12 + e) * ldd), _mm512_shuffle_f32x4::<0xDD>(v2, w2));
            }
        }
    }

    #[derive(Clone, Copy)]
    pub(crate) struct Avx512;

    impl Simd for Avx512 {
        const LANES: usize = 16;
        type V = __m512;
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn load_lanes(p: *const f32, lanes: u64) -> __m512 {
            _mm512_maskz_loadu_ps(lanes as __mmask16, p)
        }
        #[inline(always)]
        unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: __m512, b: __m512) -> __m512 {
            _mm512_sub_ps(a, b)
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn div(a: __m512, b: __m512) -> __m512 {
            _mm512_div_ps(a, b)
        }
        #[inline(always)]
        unsafe fn max(a: __m512, b: __m512) -> __m512 {
            _mm512_max_ps(a, b)
        }
        #[inline(always)]
        unsafe fn exp2(x: __m512) -> __m512 {
            let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP2_MIN));
            let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP2_MIN)), _mm512_set1_ps(EXP2_MAX));
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
            let p = exp2_poly::<Self>(_mm512_sub_ps(x, n));
            let r = _mm512_scalef_ps(p, n);
            _mm512_mask_mov_ps(r, under, _mm512_setzero_ps())
        }
        #[inline(always)]
        unsafe fn reduce_add(v: __m512) -> f32 {
            _mm512_reduce_add_ps(v)
        }
        #[inline(always)]
        unsafe fn transpose(src: *const f32, ld: usize, rows: usize, cols: usize, dst: *mut f32, ldd: usize) {
            // SAFETY: forwarded from the caller.
            unsafe { transpose_tiled::<Self>(src, ld, rows, cols, dst, ldd) }
        }
    }

    #[derive(Clone, Copy)]
    pub(crate) struct Avx2;

    impl Simd for Avx2 {
        const LANES: usize = 8;
        type V = __m256;
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            _mm256_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            _mm256_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: __m256, b: __m256) -> __m256 {
            _mm256_sub_ps(a, b)
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            _mm256_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn div(a: __m256, b: __m256) -> __m256 {
            _mm256_div_ps(a, b)
        }
        #[inline(always)]
        unsafe fn max(a: __m256, b: __m256) -> __m256 {
            _mm256_max_ps(a, b)
        }
        #[inline(always)]
        unsafe fn exp2(x: __m256) -> __m256 {
            let keep = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(EXP2_MIN));
            let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP2_MIN)), _mm256_set1_ps(EXP2_MAX));
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
            let p = exp2_poly::<Self>(_mm256_sub_ps(x, n));
            let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
            let r = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
            _mm256_and_ps(r, keep)
        }
        #[inline(always)]
        unsafe fn reduce_add(v: __m256) -> f32 {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
            _mm_cvtss_f32(s)
        }
        #[inline(always)]
        unsafe fn transpose(src: *const f32, ld: usize, rows: usize, cols: usize, dst: *mut f32, ldd: usize) {
            // SAFETY: forwarded from the caller.
            unsafe { transpose_tiled::<Self>(src, ld, rows, cols, dst, ldd) }
        }
    }

    /// One 8 x 8 tile: `dst[c * ldd + r] = src[r * ld + c]`, in 8 loads, 24 shuffles and
    /// 8 stores. A linear layer's [out, in] weight is transposed into the GEMM's strips on
    /// every call, and for the text encoder's 77-row products one element at a time that
    /// was a cost of the order of the product itself.
    ///
    /// SAFETY: the CPU has AVX; both tiles lie in their buffers.
    #[inline(always)]
    unsafe fn transpose8(src: *const f32, ld: usize, dst: *mut f32, ldd: usize) {
        unsafe {
            let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * ld)));
            // t[2i], t[2i + 1]: rows 2i and 2i + 1 interleaved (elements 0-1, 2-3 of each half).
            let t: [__m256; 8] = std::array::from_fn(|i| {
                let (a, b) = (r[i & !1], r[i | 1]);
                if i % 2 == 0 { _mm256_unpacklo_ps(a, b) } else { _mm256_unpackhi_ps(a, b) }
            });
            // u[4g + e]: columns e and 4 + e of rows 4g..4g + 4, in the low and high halves.
            let u: [__m256; 8] = std::array::from_fn(|i| {
                let (g, e) = (i / 4, i % 4);
                let (a, b) = (t[4 * g + e / 2], t[4 * g + 2 + e / 2]);
                if e % 2 == 0 { _mm256_shuffle_ps::<0x44>(a, b) } else { _mm256_shuffle_ps::<0xEE>(a, b) }
            });
            for e in 0..4 {
                _mm256_storeu_ps(dst.add(e * ldd), _mm256_permute2f128_ps::<0x20>(u[e], u[4 + e]));
                _mm256_storeu_ps(dst.add((4 + e) * ldd), _mm256_permute2f128_ps::<0x31>(u[e], u[4 + e]));
            }
        }
    }
}

/// The eight-lane path every CPU of the target has: NEON intrinsics on aarch64
/// (`simd/neon.rs`), plain Rust arrays elsewhere (an x86-64 without AVX2, where the
/// loops vectorise to SSE2).
#[derive(Clone, Copy)]
pub(crate) struct Portable;

#[cfg(target_arch = "aarch64")]
mod neon;

#[cfg(not(target_arch = "aarch64"))]
mod arrays {
    use super::{Portable, Simd, EXP2_C, EXP2_MAX, EXP2_MIN};

    type P8 = [f32; 8];

    #[inline(always)]
    fn map2(a: P8, b: P8, f: impl Fn(f32, f32) -> f32) -> P8 {
        std::array::from_fn(|i| f(a[i], b[i]))
    }

    /// Scalar 2^x with the same polynomial as the vector paths.
    /// Branch-free apart from the final select, so the lane loops vectorise.
    #[inline(always)]
    fn exp2_scalar(x: f32) -> f32 {
        let under = x < EXP2_MIN;
        let x = x.clamp(EXP2_MIN, EXP2_MAX);
        // Round to nearest by the 1.5 * 2^23 trick (|x| <= 127), which vectorises.
        const MAGIC: f32 = 12_582_912.0;
        let n = (x + MAGIC) - MAGIC;
        let f = x - n;
        let mut p = EXP2_C[6];
        for &c in EXP2_C[..6].iter().rev() {
            p = p.mul_add(f, c);
        }
        let r = p * f32::from_bits((((n as i32) + 127) as u32) << 23);
        if under {
            0.0
        } else {
            r
        }
    }

    impl Simd for Portable {
        const LANES: usize = 8;
        type V = P8;
        #[inline(always)]
        unsafe fn splat(x: f32) -> P8 {
            [x; 8]
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> P8 {
            // SAFETY: the caller passes 8 valid floats.
            unsafe { std::ptr::read_unaligned(p as *const P8) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: P8) {
            // SAFETY: the caller passes room for 8 floats.
            unsafe { std::ptr::write_unaligned(p as *mut P8, v) }
        }
        #[inline(always)]
        unsafe fn fmadd(a: P8, b: P8, c: P8) -> P8 {
            std::array::from_fn(|i| a[i] * b[i] + c[i])
        }
        #[inline(always)]
        unsafe fn add(a: P8, b: P8) -> P8 {
            map2(a, b, |x, y| x + y)
        }
        #[inline(always)]
        unsafe fn sub(a: P8, b: P8) -> P8 {
            map2(a, b, |x, y| x - y)
        }
        #[inline(always)]
        unsafe fn mul(a: P8, b: P8) -> P8 {
            map2(a, b, |x, y| x * y)
        }
        #[inline(always)]
        unsafe fn div(a: P8, b: P8) -> P8 {
            map2(a, b, |x, y| x / y)
        }
        #[inline(always)]
        unsafe fn max(a: P8, b: P8) -> P8 {
            map2(a, b, f32::max)
        }
        #[inline(always)]
        unsafe fn exp2(x: P8) -> P8 {
            x.map(exp2_scalar)
        }
        #[inline(always)]
        unsafe fn reduce_add(v: P8) -> f32 {
            ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each instruction set's transpose against the element-by-element one: whole tiles,
    /// ragged edges in both directions, rows and destination rows with padding past
    /// them (which must stay untouched).
    fn transposes_like_scalar<S: Simd>() {
        for (rows, cols) in [(1, 1), (8, 8), (7, 9), (9, 7), (16, 16), (17, 33), (16, 40), (3, 64), (24, 8)] {
            let (ld, ldd) = (cols + 3, rows + 5);
            let src: Vec<f32> = (0..rows * ld).map(|i| i as f32 * 0.5 - 7.0).collect();
            let mut want = vec![f32::NAN; cols * ldd];
            let mut got = want.clone();
            // SAFETY: src holds rows x ld floats, the destinations cols x ldd; distinct buffers.
            unsafe {
                transpose_scalar(src.as_ptr(), ld, 0, rows, 0, cols, want.as_mut_ptr(), ldd);
                S::transpose(src.as_ptr(), ld, rows, cols, got.as_mut_ptr(), ldd);
            }
            let same = want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{rows}x{cols}");
        }
    }

    #[test]
    fn vector_transposes_match_the_scalar_one() {
        transposes_like_scalar::<Portable>();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                transposes_like_scalar::<Avx2>();
            }
            if is_x86_feature_detected!("avx512f") {
                transposes_like_scalar::<Avx512>();
            }
        }
    }

    /// Every lane of `S`'s arithmetic against the scalar operation: exact where IEEE
    /// rounding fixes the result, the shared polynomial's bound for 2^x. `fused`: the
    /// multiply-add rounds once (every path but the plain arrays), which one lane's
    /// inputs tell apart: (1 + 2^-12)^2 - 1 is 2^-11 + 2^-24 fused, 2^-11 rounded twice.
    fn ops_like_scalar<S: Simd>(fused: bool) {
        let n = S::LANES;
        let lane = |i: usize, salt: f32| ((i as f32 + 1.0) * 0.731 + salt).sin() * 3.0;
        let a: Vec<f32> = (0..n).map(|i| if i == 1 { 1.0 + 2f32.powi(-12) } else { lane(i, 0.1) }).collect();
        let b: Vec<f32> = (0..n).map(|i| if i == 1 { 1.0 + 2f32.powi(-12) } else { lane(i, 2.3) }).collect();
        let c: Vec<f32> = (0..n).map(|i| if i == 1 { -1.0 } else { lane(i, 4.7) }).collect();
        let run = |f: &dyn Fn(S::V, S::V, S::V) -> S::V| -> Vec<f32> {
            let mut out = vec![0f32; n];
            // SAFETY: each buffer holds LANES floats; the caller checked the CPU's features.
            unsafe { S::store(out.as_mut_ptr(), f(S::load(a.as_ptr()), S::load(b.as_ptr()), S::load(c.as_ptr()))) };
            out
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let want = |f: fn(f32, f32, f32) -> f32| (0..n).map(|i| f(a[i], b[i], c[i])).collect::<Vec<f32>>();
        // SAFETY (all closures below): as `run`'s.
        let fma: Vec<f32> = run(&|x, y, z| unsafe { S::fmadd(x, y, z) });
        let expect_fma = if fused { want(|x, y, z| x.mul_add(y, z)) } else { want(|x, y, z| x * y + z) };
        assert_eq!(bits(&fma), bits(&expect_fma), "fmadd (fused: {fused})");
        assert_eq!(fma[1], if fused { 2f32.powi(-11) + 2f32.powi(-24) } else { 2f32.powi(-11) });
        assert_eq!(bits(&run(&|x, y, _| unsafe { S::add(x, y) })), bits(&want(|x, y, _| x + y)), "add");
        assert_eq!(bits(&run(&|x, y, _| unsafe { S::sub(x, y) })), bits(&want(|x, y, _| x - y)), "sub");
        assert_eq!(bits(&run(&|x, y, _| unsafe { S::mul(x, y) })), bits(&want(|x, y, _| x * y)), "mul");
        assert_eq!(bits(&run(&|x, y, _| unsafe { S::div(x, y) })), bits(&want(|x, y, _| x / y)), "div");
        assert_eq!(bits(&run(&|x, y, _| unsafe { S::max(x, y) })), bits(&want(|x, y, _| x.max(y))), "max");
        assert_eq!(bits(&run(&|_, _, _| unsafe { S::splat(0.375) })), bits(&vec![0.375; n]), "splat");
        // SAFETY: as `run`'s.
        let sum = unsafe { S::reduce_add(S::load(a.as_ptr())) };
        let exact: f64 = a.iter().map(|&x| x as f64).sum();
        assert!((sum as f64 - exact).abs() <= 1e-6 * a.iter().map(|x| x.abs() as f64).sum::<f64>(), "reduce_add {sum} vs {exact}");
        // 2^x across its range (it saturates past 127) and below it (0).
        for x0 in [-140.0f32, -126.5, -126.0, -60.3, -1.5, -0.49, 0.0, 0.5, 3.25, 60.7, 126.4] {
            let xs: Vec<f32> = (0..n).map(|i| x0 + i as f32 * 0.0371).collect();
            let mut got = vec![0f32; n];
            // SAFETY: as `run`'s.
            unsafe { S::store(got.as_mut_ptr(), S::exp2(S::load(xs.as_ptr()))) };
            for (&x, &g) in xs.iter().zip(&got) {
                if x < EXP2_MIN {
                    assert_eq!(g, 0.0, "exp2({x})");
                } else {
                    let r = (x as f64).exp2();
                    assert!(((g as f64 - r) / r).abs() <= 4e-7, "exp2({x}) = {g}, want {r}");
                }
            }
        }
    }

    #[test]
    fn vector_arithmetic_matches_the_scalar_one() {
        ops_like_scalar::<Portable>(cfg!(target_arch = "aarch64"));
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                ops_like_scalar::<Avx2>(true);
            }
            if is_x86_feature_detected!("avx512f") {
                ops_like_scalar::<Avx512>(true);
            }
        }
    }
}
