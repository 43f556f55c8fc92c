//! GELU and CLIP's QuickGELU as one vector pass over a tensor.
//!
//! candle's `gelu_erf` calls a scalar `erf` per value (SD 2.x / SDXS's OpenCLIP text
//! encoder: 7 M of them per prompt, ~8 % of the encoder's time on the Intel host), and
//! QuickGELU (`x * sigmoid(1.702 x)`, SD 1.x's CLIP) is three tensor ops with two
//! temporaries. Here each is one pass over a fresh output. The erf is Abramowitz &
//! Stegun 7.1.26 (absolute error under 1.5e-7, the size of f32's own rounding of
//! values near 1), computed as erfc for negative inputs so small results keep their
//! relative accuracy; the sigmoid uses the kernels' vector exp (relative error under
//! 1.3e-7). GEGLU ([`super::geglu`]) shares the erf.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::simd::{Avx2, Avx512};
use super::simd::{Portable, Simd};
use super::{isa, require, Isa};

/// Which activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Exact (erf) GELU: `0.5 x (1 + erf(x / sqrt 2))`.
    Gelu,
    /// `x * sigmoid(1.702 x)`.
    QuickGelu,
}

/// `kind` applied to every value of `x` (f32, CPU).
pub fn activation(x: &Tensor, kind: Kind) -> Result<Tensor> {
    activation_on(isa(), x, kind)
}

/// [`activation`] on a chosen instruction set (an error if this CPU lacks it).
pub fn activation_on(isa: Isa, x: &Tensor, kind: Kind) -> Result<Tensor> {
    require(isa)?;
    x.contiguous()?.apply_op1_no_bwd(&Op { isa, kind })
}

struct Op {
    isa: Isa,
    kind: Kind,
}

impl CustomOp1 for Op {
    fn name(&self) -> &'static str {
        "brume-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(data) = s else {
            candle_core::bail!("gelu takes f32, got {:?}", s.dtype());
        };
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("gelu needs a contiguous input");
        };
        let x = &data[a..b];
        let mut out = vec![0f32; x.len()];
        let (isa, kind) = (self.isa, self.kind);
        out.par_chunks_mut(1 << 16).zip(x.par_chunks(1 << 16)).for_each(|(d, s)| {
            // SAFETY: the CPU has `isa`'s features (checked in activation_on).
            unsafe {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => run_avx512(kind, s, d),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => run_avx2(kind, s, d),
                    _ => run::<Portable>(kind, s, d),
                }
            }
        });
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn run_avx512(kind: Kind, src: &[f32], dst: &mut [f32]) {
    // SAFETY: forwarded from the caller.
    unsafe { run::<Avx512>(kind, src, dst) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2(kind: Kind, src: &[f32], dst: &mut [f32]) {
    // SAFETY: forwarded from the caller.
    unsafe { run::<Avx2>(kind, src, dst) }
}

/// `dst[i] = kind(src[i])`: vectors, then a scalar tail.
///
/// SAFETY: the CPU has `S`'s features; `src` and `dst` have the same length.
#[inline(always)]
unsafe fn run<S: Simd>(kind: Kind, src: &[f32], dst: &mut [f32]) {
    let (n, l) = (dst.len().min(src.len()), S::LANES);
    let mut i = 0;
    // SAFETY: every load and store covers i..i + LANES <= n.
    unsafe {
        while i + l <= n {
            let x = S::load(src.as_ptr().add(i));
            let y = match kind {
                Kind::Gelu => gelu::<S>(x),
                Kind::QuickGelu => quick_gelu::<S>(x),
            };
            S::store(dst.as_mut_ptr().add(i), y);
            i += l;
        }
    }
    for j in i..n {
        dst[j] = match kind {
            Kind::Gelu => gelu_scalar(src[j]),
            Kind::QuickGelu => src[j] / (1.0 + (-QUICK * src[j]).exp()),
        };
    }
}

const QUICK: f32 = 1.702;

/// `x * sigmoid(1.702 x) = x / (1 + e^(-1.702 x))` lane by lane.
///
/// SAFETY: the CPU has `S`'s features.
#[inline(always)]
unsafe fn quick_gelu<S: Simd>(x: S::V) -> S::V {
    unsafe {
        let e = S::exp2(S::mul(x, S::splat(-QUICK * std::f32::consts::LOG2_E)));
        S::div(x, S::add(S::splat(1.0), e))
    }
}

const A1: f32 = 0.254_829_6;
const A2: f32 = -0.284_496_74;
const A3: f32 = 1.421_413_7;
const A4: f32 = -1.453_152_1;
const A5: f32 = 1.061_405_4;
const P: f32 = 0.327_591_1;

/// `0.5 x (1 + erf(x / sqrt 2))` lane by lane.
///
/// SAFETY: the CPU has `S`'s features.
#[inline(always)]
pub(super) unsafe fn gelu<S: Simd>(x: S::V) -> S::V {
    unsafe {
        let z = S::mul(x, S::splat(std::f32::consts::FRAC_1_SQRT_2));
        // |z| as max(z, -z); erf is odd, so erf(z) = sign(z) * erf(|z|).
        let az = S::max(z, S::sub(S::splat(0.0), z));
        let t = S::div(S::splat(1.0), S::fmadd(az, S::splat(P), S::splat(1.0)));
        let poly = S::mul(
            t,
            S::fmadd(t, S::fmadd(t, S::fmadd(t, S::fmadd(t, S::splat(A5), S::splat(A4)), S::splat(A3)), S::splat(A2)), S::splat(A1)),
        );
        // c = erfc|z| = 1 - erf|z|.
        let c = S::mul(poly, S::exp2(S::mul(S::mul(az, az), S::splat(-std::f32::consts::LOG2_E))));
        // 0.5 x (1 + sign(x) erf|z|) = 0.5 ((x + |x|) - |x| c): for x < 0 the first term
        // is exactly 0, so the small result -|x| c / 2 keeps c's relative accuracy
        // instead of losing it to 1 - erf|z| cancelling.
        let ax = S::max(x, S::sub(S::splat(0.0), x));
        S::mul(S::splat(0.5), S::sub(S::add(x, ax), S::mul(ax, c)))
    }
}

pub(super) fn gelu_scalar(x: f32) -> f32 {
    let az = (x * std::f32::consts::FRAC_1_SQRT_2).abs();
    let t = 1.0 / (1.0 + P * az);
    let poly = t * (A1 + t * (A2 + t * (A3 + t * (A4 + t * A5))));
    let c = poly * (-az * az).exp();
    0.5 * ((x + x.abs()) - x.abs() * c)
}
