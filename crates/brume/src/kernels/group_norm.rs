//! Fused group normalisation, optionally followed by SiLU (what every resnet
//! block and every `conv_norm_out` does).
//!
//! The plain path makes seven full-size temporaries (upcast, centre, square,
//! divide, reshape, scale, shift) and SiLU two more. Here each task takes one
//! (sample, group): the group's channels are contiguous in NCHW, so it sums them,
//! sums the squared deviations (two passes, as the plain path, so no cancellation),
//! then writes `(x - mean) * rstd * w[c] + b[c]` (and SiLU) in one pass.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::simd::{Avx2, Avx512};
use super::simd::{Portable, Simd};
use super::{isa, require, Isa, SharedMut};

/// Group norm of `x` `[batch, channels, ...]` (f32, CPU) with per-channel `weight`
/// and `bias`, then SiLU when `silu`.
pub fn group_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, groups: usize, eps: f64, silu: bool) -> Result<Tensor> {
    group_norm_on(isa(), x, weight, bias, groups, eps, silu)
}

/// [`group_norm`] on a chosen instruction set (an error if this CPU lacks it).
pub fn group_norm_on(
    isa: Isa,
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
    silu: bool,
) -> Result<Tensor> {
    require(isa)?;
    let op = GroupNormOp { groups, eps: eps as f32, silu, isa };
    x.contiguous()?.apply_op3_no_bwd(&weight.contiguous()?, &bias.contiguous()?, &op)
}

struct GroupNormOp {
    groups: usize,
    eps: f32,
    silu: bool,
    isa: Isa,
}

fn contiguous_f32<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let data = match s {
        CpuStorage::F32(v) => v.as_slice(),
        other => candle_core::bail!("group norm takes f32 {what}, got {:?}", other.dtype()),
    };
    match l.contiguous_offsets() {
        Some((a, b)) if b <= data.len() => Ok(&data[a..b]),
        _ => candle_core::bail!("group norm needs a contiguous {what}"),
    }
}

impl CustomOp3 for GroupNormOp {
    fn name(&self) -> &'static str {
        "brume-group-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s1, l1, "input")?;
        let w = contiguous_f32(s2, l2, "weight")?;
        let b = contiguous_f32(s3, l3, "bias")?;
        let dims = l1.dims();
        if dims.len() < 2 {
            candle_core::bail!("group norm needs [batch, channels, ...], got {dims:?}");
        }
        let (n, c) = (dims[0], dims[1]);
        let hw: usize = dims[2..].iter().product();
        let g = self.groups;
        if g == 0 || c % g != 0 || w.len() != c || b.len() != c {
            candle_core::bail!("group norm: {c} channels, {g} groups, weight {}, bias {}", w.len(), b.len());
        }
        let mut out = vec![0f32; x.len()];
        let span = c / g * hw;
        if span == 0 {
            return Ok((CpuStorage::F32(out), l1.shape().clone()));
        }
        let dst = SharedMut(out.as_mut_ptr());
        let isa = self.isa;
        (0..n * g).into_par_iter().for_each(|t| {
            let gi = t % g;
            let src = &x[t * span..(t + 1) * span];
            let (w, b) = (&w[gi * (c / g)..(gi + 1) * (c / g)], &b[gi * (c / g)..(gi + 1) * (c / g)]);
            // SAFETY: task t writes only out[t * span..(t + 1) * span], inside `out`
            // (x and out have the same length), disjoint from every other task.
            let dst = unsafe { std::slice::from_raw_parts_mut(dst.get().add(t * span), span) };
            // SAFETY: the CPU has the features of `isa` (detected at run time).
            unsafe {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => group_avx512(src, dst, w, b, hw, self.eps, self.silu),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => group_avx2(src, dst, w, b, hw, self.eps, self.silu),
                    _ => group::<Portable>(src, dst, w, b, hw, self.eps, self.silu),
                }
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn group_avx512(src: &[f32], dst: &mut [f32], w: &[f32], b: &[f32], hw: usize, eps: f32, silu: bool) {
    // SAFETY: forwarded from the caller.
    unsafe { group::<Avx512>(src, dst, w, b, hw, eps, silu) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn group_avx2(src: &[f32], dst: &mut [f32], w: &[f32], b: &[f32], hw: usize, eps: f32, silu: bool) {
    // SAFETY: forwarded from the caller.
    unsafe { group::<Avx2>(src, dst, w, b, hw, eps, silu) }
}

/// One (sample, group): `src` and `dst` hold its `w.len()` channels of `hw` values.
///
/// SAFETY: the CPU has `S`'s features; `src.len() == dst.len() == w.len() * hw`.
#[inline(always)]
unsafe fn group<S: Simd>(src: &[f32], dst: &mut [f32], w: &[f32], b: &[f32], hw: usize, eps: f32, silu: bool) {
    let len = src.len();
    let sum = sum_by::<S>(src, |v| v, |x| x);
    let mean = sum / len as f32;
    // SAFETY: splat has no preconditions beyond the CPU feature.
    let mv = unsafe { S::splat(mean) };
    let sq = sum_by::<S>(
        src,
        // SAFETY: as above.
        |v| unsafe {
            let d = S::sub(v, mv);
            S::mul(d, d)
        },
        |x| (x - mean) * (x - mean),
    );
    let rstd = 1.0 / (sq / len as f32 + eps).sqrt();
    let l = S::LANES;
    for (ch, (&wc, &bc)) in w.iter().zip(b).enumerate() {
        let (s, o) = (&src[ch * hw..(ch + 1) * hw], &mut dst[ch * hw..(ch + 1) * hw]);
        let a = rstd * wc;
        // SAFETY: loads and stores at i..i + LANES with i + LANES <= hw.
        unsafe {
            let (av, bv) = (S::splat(a), S::splat(bc));
            let mut i = 0;
            while i + l <= hw {
                let y = S::fmadd(S::sub(S::load(s.as_ptr().add(i)), mv), av, bv);
                S::store(o.as_mut_ptr().add(i), if silu { S::silu(y) } else { y });
                i += l;
            }
            for (oi, &si) in o[i..].iter_mut().zip(&s[i..]) {
                let y = (si - mean) * a + bc;
                *oi = if silu { y / (1.0 + (-y).exp()) } else { y };
            }
        }
    }
}

/// Sum of `f` over `x`: four vector accumulators, then a scalar tail.
#[inline(always)]
fn sum_by<S: Simd>(x: &[f32], f: impl Fn(S::V) -> S::V, tail: impl Fn(f32) -> f32) -> f32 {
    let l = S::LANES;
    let mut i = 0;
    // SAFETY: loads at i..i + 4 * LANES (or + LANES) within x's length; the CPU
    // features were checked by the entry point this is inlined into.
    let mut total = unsafe {
        let mut acc = [S::splat(0.0); 4];
        while i + 4 * l <= x.len() {
            for (k, a) in acc.iter_mut().enumerate() {
                *a = S::add(*a, f(S::load(x.as_ptr().add(i + k * l))));
            }
            i += 4 * l;
        }
        while i + l <= x.len() {
            acc[0] = S::add(acc[0], f(S::load(x.as_ptr().add(i))));
            i += l;
        }
        S::reduce_add(S::add(S::add(acc[0], acc[1]), S::add(acc[2], acc[3])))
    };
    for &v in &x[i..] {
        total += tail(v);
    }
    total
}
