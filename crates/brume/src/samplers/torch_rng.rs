//! A bit-exact re-implementation of PyTorch's CPU generator for float32
//! `torch.randn`, so that `--rng torch` with seed S gives the same starting
//! latents (and the same per-step noise of ancestral samplers) as diffusers run
//! on CPU with `torch.Generator("cpu").manual_seed(S)`. Without it a seed shared
//! with a diffusers user would name a different picture in brume.
//!
//! What torch does (established by probing torch 2.15.0 and checked bit for bit
//! by `tests/torch_rng.rs` against fixtures from `tools/torch_rng/`):
//!
//! * The engine is the standard 32-bit Mersenne Twister (mt19937), initialised
//!   from the low 32 bits of the 64-bit seed with the usual 1812433253 recurrence.
//!   A 64-bit draw is two 32-bit outputs, the first one the high half.
//! * `randn` of fewer than 16 elements draws each value from a double-precision
//!   Box–Muller: `u1`, `u2` uniform doubles from 64-bit draws
//!   (`(x & (2^53 - 1)) * 2^-53`), `r = sqrt(-2 ln(1 - u2))` (as `log1p(-u2)`),
//!   `θ = 2π u1`; it returns `r cos θ` and keeps `r sin θ` in the generator as the
//!   next double normal, which the next small draw (even in a later call) returns
//!   first. The double is then rounded to f32.
//! * `randn` of 16 or more elements first fills the whole output with uniform
//!   floats `(x & (2^24 - 1)) * 2^-24` from 32-bit draws, then turns each complete
//!   block of 16 into normals in place: with `u1 = 1 - d[j]`, `u2 = d[j + 8]`
//!   (j < 8), `d[j] = r cos θ` and `d[j + 8] = r sin θ`, `r = sqrt(-2 ln u1)`,
//!   `θ = 2π u2`. When the length is not a multiple of 16, 16 *fresh* uniforms are
//!   drawn, transformed the same way, and overwrite the last 16 outputs (some of
//!   which were already normals). This path never touches the cached normal.
//! * On x86-64 with AVX2 (every CPU that also has AVX-512 uses the same kernel)
//!   the block transform runs in single precision with the Cephes-style
//!   polynomial `log` and `sincos` of the well-known `avx_mathfun` routines, and
//!   the compiler fused several multiply-adds into FMAs. The exact operation
//!   sequence, including which products are fused, is reproduced below with
//!   `f32::mul_add` (always a correctly rounded fused multiply-add), so the result
//!   is the same on every platform brume runs on.
//!
//! Limits: the small-tensor path uses the platform's `f64` `ln_1p`, `sin`, `cos`;
//! these match glibc's (which torch uses on Linux); another libm could differ in
//! a last bit on rare inputs. Torch's generic kernel (non-x86 CPUs, or
//! `ATEN_CPU_CAPABILITY=default`) computes the 16-blocks differently, giving
//! values a few ulp apart in many places; that variant is not reproduced.

// The Cephes constants are written exactly as the reference kernel has them and
// the operation order is deliberate: bit-exact reproduction beats lint style.
#![allow(clippy::approx_constant, clippy::excessive_precision, clippy::assign_op_pattern)]

use candle_core::{Device, Result, Tensor};

/// The 32-bit Mersenne Twister MT19937 (Matsumoto & Nishimura, 1998), seeded
/// with the standard `init_genrand` recurrence.
#[derive(Clone)]
pub struct Mt19937 {
    state: [u32; 624],
    index: usize,
}

impl Mt19937 {
    const N: usize = 624;
    const M: usize = 397;

    pub fn new(seed: u32) -> Self {
        let mut state = [0u32; 624];
        state[0] = seed;
        for i in 1..Self::N {
            let prev = state[i - 1];
            state[i] = 1_812_433_253u32.wrapping_mul(prev ^ (prev >> 30)).wrapping_add(i as u32);
        }
        Self { state, index: Self::N }
    }

    fn twist(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        const MATRIX_A: u32 = 0x9908_b0df;
        for i in 0..Self::N {
            let y = (self.state[i] & UPPER) | (self.state[(i + 1) % Self::N] & LOWER);
            let mut v = self.state[(i + Self::M) % Self::N] ^ (y >> 1);
            if y & 1 != 0 {
                v ^= MATRIX_A;
            }
            self.state[i] = v;
        }
        self.index = 0;
    }

    pub fn next_u32(&mut self) -> u32 {
        if self.index >= Self::N {
            self.twist();
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^= y >> 18;
        y
    }
}

/// PyTorch's CPU generator as seen by float32 `torch.randn`: the engine plus
/// the cached second value of the double-precision Box–Muller.
#[derive(Clone)]
pub struct TorchRng {
    engine: Mt19937,
    next_double_normal: Option<f64>,
}

impl TorchRng {
    /// Same state as `torch.Generator("cpu").manual_seed(seed)`.
    pub fn new(seed: u64) -> Self {
        // torch keeps the 64-bit seed but the engine only consumes its low half.
        Self { engine: Mt19937::new(seed as u32), next_double_normal: None }
    }

    pub fn next_u32(&mut self) -> u32 {
        self.engine.next_u32()
    }

    pub fn next_u64(&mut self) -> u64 {
        let hi = self.engine.next_u32() as u64;
        let lo = self.engine.next_u32() as u64;
        (hi << 32) | lo
    }

    /// Uniform in [0, 1) on a 2^-53 grid.
    fn uniform_f64(&mut self) -> f64 {
        (self.next_u64() & ((1u64 << 53) - 1)) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [0, 1) on a 2^-24 grid.
    fn uniform_f32(&mut self) -> f32 {
        (self.next_u32() & ((1u32 << 24) - 1)) as f32 * (1.0 / (1u32 << 24) as f32)
    }

    /// One standard normal double, returning the cached one first.
    pub fn normal_f64(&mut self) -> f64 {
        if let Some(v) = self.next_double_normal.take() {
            return v;
        }
        let u1 = self.uniform_f64();
        let u2 = self.uniform_f64();
        let r = (-2.0 * (-u2).ln_1p()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u1;
        self.next_double_normal = Some(r * theta.sin());
        r * theta.cos()
    }

    /// `torch.randn(numel, generator=g, dtype=torch.float32)`, advancing the
    /// generator exactly as torch does.
    pub fn randn_f32(&mut self, numel: usize) -> Vec<f32> {
        if numel < 16 {
            return (0..numel).map(|_| self.normal_f64() as f32).collect();
        }
        let mut out: Vec<f32> = (0..numel).map(|_| self.uniform_f32()).collect();
        for block in out.chunks_exact_mut(16) {
            box_muller_16(block.try_into().unwrap());
        }
        if numel % 16 != 0 {
            let mut tail = [0f32; 16];
            for v in tail.iter_mut() {
                *v = self.uniform_f32();
            }
            box_muller_16(&mut tail);
            out[numel - 16..].copy_from_slice(&tail);
        }
        out
    }
}

impl super::NoiseSource for TorchRng {
    fn randn(&mut self, shape: &[usize], device: &Device) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        Tensor::from_vec(self.randn_f32(n), shape, device)
    }
}

/// Turns 16 uniforms into 16 normals in place: lanes j and j + 8 share one pair.
fn box_muller_16(d: &mut [f32; 16]) {
    const TWO_PI: f32 = (2.0 * std::f64::consts::PI) as f32;
    for j in 0..8 {
        let u1 = 1.0 - d[j];
        let u2 = d[j + 8];
        let radius = (-2.0 * cephes_logf(u1)).sqrt();
        let (s, c) = cephes_sincosf(TWO_PI * u2);
        // torch applies `x * std + mean` (std 1, mean 0) as an FMA; the only
        // visible effect is that -0 becomes +0.
        d[j] = (radius * c).mul_add(1.0, 0.0);
        d[j + 8] = (radius * s).mul_add(1.0, 0.0);
    }
}

/// Single-precision natural log, Cephes polynomial, operation order and FMA
/// fusion as in torch's AVX2 kernel.
fn cephes_logf(x: f32) -> f32 {
    const MIN_NORM_POS: f32 = f32::MIN_POSITIVE;
    const SQRTHF: f32 = 0.707106781186547524_f64 as f32;
    const P: [f32; 9] = [
        7.0376836292E-2_f64 as f32,
        -1.1514610310E-1_f64 as f32,
        1.1676998740E-1_f64 as f32,
        -1.2420140846E-1_f64 as f32,
        1.4249322787E-1_f64 as f32,
        -1.6668057665E-1_f64 as f32,
        2.0000714765E-1_f64 as f32,
        -2.4999993993E-1_f64 as f32,
        3.3333331174E-1_f64 as f32,
    ];
    const Q1: f32 = -2.12194440e-4_f64 as f32;
    const Q2: f32 = 0.693359375;

    let invalid = x <= 0.0;
    let x = x.max(MIN_NORM_POS);
    let bits = x.to_bits();
    // Exponent and mantissa in [0.5, 1).
    let mut e = ((bits >> 23) as i32 - 0x7f) as f32 + 1.0;
    let mut m = f32::from_bits((bits & !0x7f80_0000) | 0x3f00_0000);
    let small = m < SQRTHF;
    let tmp = if small { m } else { 0.0 };
    m = m - 1.0;
    e = e - if small { 1.0 } else { 0.0 };
    m = m + tmp;
    let z = m * m;
    let mut y = P[0];
    for &p in &P[1..] {
        y = y.mul_add(m, p);
    }
    y = y * m;
    y = y.mul_add(z, e * Q1);
    y = (-z).mul_add(0.5, y);
    m = m + y;
    let r = e.mul_add(Q2, m);
    if invalid {
        f32::NAN
    } else {
        r
    }
}

/// Single-precision (sin x, cos x), Cephes polynomials with the extended
/// precision reduction by π/4, operation order and FMA fusion as in torch's
/// AVX2 kernel. Accurate for the |x| < 2π it is used on here.
fn cephes_sincosf(x: f32) -> (f32, f32) {
    const FOPI: f32 = 1.27323954473516_f64 as f32;
    const DP1: f32 = -0.78515625;
    const DP2: f32 = -2.4187564849853515625e-4_f64 as f32;
    const DP3: f32 = -3.77489497744594108e-8_f64 as f32;
    const SIN_P: [f32; 3] = [-1.9515295891E-4_f64 as f32, 8.3321608736E-3_f64 as f32, -1.6666654611E-1_f64 as f32];
    const COS_P: [f32; 3] =
        [2.443315711809948E-005_f64 as f32, -1.388731625493765E-003_f64 as f32, 4.166664568298827E-002_f64 as f32];
    const SIGN: u32 = 0x8000_0000;

    let mut sign_sin = x.to_bits() & SIGN;
    let ax = x.abs();
    // Octant index rounded up to even (truncating conversion, as cvttps2dq).
    let j = (((ax * FOPI) as i32).wrapping_add(1)) & !1;
    let y = j as f32;
    sign_sin ^= ((j & 4) as u32) << 29;
    let sign_cos = ((!(j.wrapping_sub(2)) & 4) as u32) << 29;
    let use_sin_poly_for_sin = (j & 2) == 0;

    let mut r = y.mul_add(DP1, ax);
    r = DP2.mul_add(y, r);
    r = y.mul_add(DP3, r);

    let z = r * r;
    // cos polynomial: 1 - z/2 + z^2 (c0 z^2 + c1 z + c2)
    let mut yc = COS_P[0].mul_add(z, COS_P[1]);
    yc = yc.mul_add(z, COS_P[2]);
    let t = z * yc;
    yc = z.mul_add(t, -(z * 0.5));
    yc = yc + 1.0;
    // sin polynomial: r + r z (s0 z^2 + s1 z + s2)
    let mut ys = SIN_P[0].mul_add(z, SIN_P[1]);
    ys = ys.mul_add(z, SIN_P[2]);
    let ys = r.mul_add(z * ys, r);

    let (s, c) = if use_sin_poly_for_sin { (ys, yc) } else { (yc, ys) };
    (f32::from_bits(s.to_bits() ^ sign_sin), f32::from_bits(c.to_bits() ^ sign_cos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mt19937_standard_outputs_for_seed_5489() {
        let mut mt = Mt19937::new(5489);
        let first: Vec<u32> = (0..5).map(|_| mt.next_u32()).collect();
        assert_eq!(first, [3_499_211_612, 581_869_302, 3_890_346_734, 3_586_334_585, 545_404_204]);
        // C++ [rand.predef]: the 10000th output of a default-constructed mt19937.
        let mut mt = Mt19937::new(5489);
        let v = (0..10_000).map(|_| mt.next_u32()).last().unwrap();
        assert_eq!(v, 4_123_659_995);
    }

    #[test]
    fn seed_uses_low_32_bits() {
        let mut a = TorchRng::new((1u64 << 32) + 7);
        let mut b = TorchRng::new(7);
        assert_eq!(a.randn_f32(40), b.randn_f32(40));
    }

    #[test]
    fn cephes_functions_are_accurate() {
        for i in 1..=4096 {
            let u = i as f32 / 4096.0;
            assert!((cephes_logf(u) as f64 - (u as f64).ln()).abs() < 2e-7 * (1.0 + (u as f64).ln().abs()));
            let th = (2.0 * std::f64::consts::PI) as f32 * (i - 1) as f32 / 4096.0;
            let (s, c) = cephes_sincosf(th);
            assert!((s as f64 - (th as f64).sin()).abs() < 3e-7, "sin {th}");
            assert!((c as f64 - (th as f64).cos()).abs() < 3e-7, "cos {th}");
        }
    }

    #[test]
    fn small_draws_share_the_cached_normal() {
        let mut a = TorchRng::new(3);
        let one = a.randn_f32(1);
        let two = a.randn_f32(1);
        let mut b = TorchRng::new(3);
        assert_eq!(b.randn_f32(2), [one[0], two[0]]);
    }
}
