//! bf16 rounding for the AVX512-BF16 kernels, vectorised: the kernels round their
//! f32 factors on every call (weights stay f32 or compressed in the file), so at a
//! UNet's small maps, where a weight feeds few products, a scalar rounding loop
//! costs as much as the products it feeds.
//!
//! Every routine rounds to nearest even, as `vcvtneps2bf16` and PyTorch do;
//! [`round_into`] uses that instruction, which also flushes subnormal inputs (below
//! 1.2e-38) to zero, a difference far under bf16's own rounding of any product.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

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

/// The error a bf16 kernel returns on a CPU without the bf16 dot-product instructions.
pub(crate) fn require() -> candle_core::Result<()> {
    if supported() {
        Ok(())
    } else {
        candle_core::bail!("bf16 compute needs a CPU with AVX512-BF16")
    }
}

/// The scalar rule: f32 -> bf16 bits, rounded to nearest even (NaN stays NaN). What
/// the vector routines below compute, for the few values a kernel rounds one at a time.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn bf16_bits(x: f32) -> u32 {
    let b = x.to_bits();
    if x.is_nan() {
        return (b >> 16) | 0x40;
    }
    (b.wrapping_add(0x7FFF + ((b >> 16) & 1))) >> 16
}

/// Rounds `src` into `src.len()` bf16 values at `dst`: consecutive values pair up
/// into the 32-bit words `vdpbf16ps` takes (element 2p low, 2p + 1 high).
///
/// SAFETY: the CPU has AVX512-BF16 ([`supported`]); `dst` has room for `src.len()`
/// 16-bit values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
pub(crate) unsafe fn round_into(src: &[f32], dst: *mut u16) {
    let mut x = 0;
    unsafe {
        while x + 16 <= src.len() {
            let v = _mm512_loadu_ps(src.as_ptr().add(x));
            let r: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
            _mm256_storeu_si256(dst.add(x) as *mut __m256i, r);
            x += 16;
        }
        // The tail through the same instruction, so every position rounds alike.
        let rest = src.len() - x;
        if rest > 0 {
            let v = _mm512_maskz_loadu_ps((1u16 << rest) - 1, src.as_ptr().add(x));
            let r: [u16; 16] = std::mem::transmute(_mm512_cvtneps_pbh(v));
            std::ptr::copy_nonoverlapping(r.as_ptr(), dst.add(x), rest);
        }
    }
}

/// Writes `lo.len()` pair words to `dst`: bf16(lo[x]) in the low half and bf16(hi[x])
/// (zero without `hi`) in the high half, for pairs that run across two rows (two
/// input channels of a conv, two rows of k of a [k, n] matrix).
///
/// SAFETY: the CPU has AVX-512 F and BW; `dst` has room for `lo.len()` words; `hi`,
/// when given, is as long as `lo`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn pack_pairs(lo: &[f32], hi: Option<&[f32]>, dst: *mut u32) {
    let w = lo.len();
    unsafe {
        let round = _mm512_set1_epi32(0x7FFF);
        let one = _mm512_set1_epi32(1);
        let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        // bf16 of 16 floats, left in the high half of each 32-bit lane.
        let to_bf16_high = |v: __m512i| -> __m512i {
            let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(v), one);
            _mm512_and_si512(_mm512_add_epi32(v, _mm512_add_epi32(round, odd)), high)
        };
        let mut x = 0;
        while x < w {
            let m: __mmask16 = if w - x >= 16 { 0xFFFF } else { (1u16 << (w - x)) - 1 };
            let a = _mm512_maskz_loadu_epi32(m, lo.as_ptr().add(x) as *const i32);
            let b = match hi {
                Some(hi) => _mm512_maskz_loadu_epi32(m, hi.as_ptr().add(x) as *const i32),
                None => _mm512_setzero_si512(),
            };
            let pair = _mm512_or_si512(_mm512_srli_epi32::<16>(to_bf16_high(a)), to_bf16_high(b));
            _mm512_mask_storeu_epi32(dst.add(x) as *mut i32, m, pair);
            x += 16;
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn vector_rounding_matches_the_scalar_rule() {
        if !supported() {
            return;
        }
        // Ties (0x3F808000 rounds to even), carries into the exponent, subnormals, signs.
        let mut src: Vec<f32> = [1.0f32, 1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -2.5e-39, 3.4e38, -0.0, 0.1, 65504.0]
            .into_iter()
            .chain((0..37).map(|i| (i as f32 * 0.37).sin() * 10f32.powi(i % 7 - 3)))
            .collect();
        src.push(f32::from_bits(0x3F80_8000));
        src.push(f32::from_bits(0x3F81_8000));
        let mut got = vec![0u16; src.len()];
        unsafe { round_into(&src, got.as_mut_ptr()) };
        for (s, g) in src.iter().zip(&got) {
            let want = if s.is_subnormal() { bf16_bits(0.0f32.copysign(*s)) } else { bf16_bits(*s) };
            assert_eq!(*g as u32, want, "{s:e}");
        }
        let (lo, hi) = src.split_at(src.len() / 2);
        let mut pairs = vec![0u32; lo.len()];
        unsafe { pack_pairs(lo, Some(&hi[..lo.len()]), pairs.as_mut_ptr()) };
        for (i, p) in pairs.iter().enumerate() {
            assert_eq!(*p, bf16_bits(lo[i]) | (bf16_bits(hi[i]) << 16));
        }
    }
}
