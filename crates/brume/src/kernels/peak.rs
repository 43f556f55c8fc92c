//! The machine's own f32 arithmetic ceiling, measured rather than looked up.
//!
//! A benchmark's GFLOP/s only means something next to what the cores can do, and
//! data sheets do not know about shared machines, turbo limits or how many cores a
//! container really gets. So every thread of rayon's pool runs independent chains
//! of fused multiply-adds in registers (no memory traffic) for a fixed time, and the
//! sum of their rates is the ceiling a kernel's percentage is quoted against.

use std::time::{Duration, Instant};

use super::simd::{Portable, Simd};
use super::{isa, Isa};

/// Independent accumulators per thread: enough to cover the FMA latency on two
/// pipes (4-5 cycles x 2 on current x86 cores) so the loop is throughput-bound.
const CHAINS: usize = 12;
/// FMA iterations between clock reads.
const BURST: usize = 4096;

/// Measured f32 throughput of all of rayon's threads together, in GFLOP/s (an FMA
/// counts two), each thread running for about `time`.
pub fn peak_f32_gflops(time: Duration) -> f64 {
    let isa = isa();
    on_every_thread(|| run(isa, time))
}

/// The sum of `rate` run by one task per pool thread, started together, so the
/// cores run at once (as a kernel's do) and a shared power or clock limit shows.
fn on_every_thread(rate: impl Fn() -> f64 + Sync) -> f64 {
    let per = std::sync::Mutex::new(Vec::with_capacity(rayon::current_num_threads()));
    rayon::broadcast(|_| {
        let r = rate();
        if let Ok(mut v) = per.lock() {
            v.push(r);
        }
    });
    per.into_inner().map(|v| v.iter().sum()).unwrap_or(0.0)
}

fn run(isa: Isa, time: Duration) -> f64 {
    // SAFETY: `isa` was detected on this CPU.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => run_avx512(time),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => run_avx2(time),
            _ => chains::<Portable>(time),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn run_avx512(time: Duration) -> f64 {
    // SAFETY: forwarded from the caller.
    unsafe { chains::<super::simd::Avx512>(time) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2(time: Duration) -> f64 {
    // SAFETY: forwarded from the caller.
    unsafe { chains::<super::simd::Avx2>(time) }
}

/// GFLOP/s of one thread running `CHAINS` FMA chains for about `time`.
///
/// SAFETY: the CPU has `S`'s features.
#[inline(always)]
unsafe fn chains<S: Simd>(time: Duration) -> f64 {
    // Multipliers just under 1 and a small addend keep the values finite forever.
    let (a, b) = unsafe { (S::splat(0.999_999), S::splat(1e-7)) };
    let mut acc = [unsafe { S::splat(1.0) }; CHAINS];
    let start = Instant::now();
    let mut iters = 0usize;
    while start.elapsed() < time {
        for _ in 0..BURST {
            for x in acc.iter_mut() {
                *x = unsafe { S::fmadd(*x, a, b) };
            }
        }
        iters += BURST;
    }
    let secs = start.elapsed().as_secs_f64();
    // Keep the chains live so the loop is not optimised away.
    let mut sink = 0f32;
    for x in acc {
        sink += unsafe { S::reduce_add(x) };
    }
    std::hint::black_box(sink);
    (iters * CHAINS * S::LANES * 2) as f64 / secs / 1e9
}

/// Measured bf16 dot-product throughput (`vdpbf16ps`, 32 multiply-adds per
/// instruction into f32) of all of rayon's threads, in GFLOP/s; `None` on a CPU
/// without AVX512-BF16. What `--compute bf16` rows are quoted against.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub fn peak_bf16_gflops(time: Duration) -> Option<f64> {
    if !super::conv3x3_bf16::supported() {
        return None;
    }
    Some(on_every_thread(|| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX512-BF16 was detected above.
        let r = unsafe { bf16_chains(time) };
        #[cfg(not(target_arch = "x86_64"))]
        let r = 0.0;
        r
    }))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn bf16_chains(time: Duration) -> f64 {
    use std::arch::x86_64::*;
    // The intrinsics are safe to call here: this function enables their features.
    {
        // Tiny factors keep the f32 sums finite for as long as the loop runs.
        let a: __m512bh = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3), _mm512_set1_ps(1e-3));
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        let start = Instant::now();
        let mut iters = 0usize;
        while start.elapsed() < time {
            for _ in 0..BURST {
                for x in acc.iter_mut() {
                    *x = _mm512_dpbf16_ps(*x, a, a);
                }
            }
            iters += BURST;
        }
        let secs = start.elapsed().as_secs_f64();
        let mut sink = 0f32;
        for x in acc {
            sink += _mm512_reduce_add_ps(x);
        }
        std::hint::black_box(sink);
        // 16 lanes x 2 products x 2 FLOP per instruction.
        (iters * CHAINS * 64) as f64 / secs / 1e9
    }
}

/// Measured AMX throughput (`tdpbf16ps` on resident tiles) of all of rayon's
/// threads, in GFLOP/s; `None` without AMX. On such a CPU the `--compute bf16`
/// rows run on the tiles and are quoted against this.
pub fn peak_amx_gflops(time: Duration) -> Option<f64> {
    if !super::amx::supported() {
        return None;
    }
    Some(on_every_thread(|| super::amx::tile_rate(time).unwrap_or(0.0)))
}

#[cfg(test)]
mod tests {
    #[test]
    fn peak_is_positive_and_finite() {
        let g = super::peak_f32_gflops(std::time::Duration::from_millis(300));
        eprintln!("measured f32 peak: {g:.1} GFLOP/s on {} threads", rayon::current_num_threads());
        if let Some(b) = super::peak_bf16_gflops(std::time::Duration::from_millis(300)) {
            eprintln!("measured bf16 peak: {b:.1} GFLOP/s");
            assert!(b.is_finite() && b > 0.1, "{b}");
        }
        if let Some(t) = super::peak_amx_gflops(std::time::Duration::from_millis(300)) {
            eprintln!("measured AMX peak: {t:.1} GFLOP/s");
            assert!(t.is_finite() && t > 0.1, "{t}");
        }
        assert!(g.is_finite() && g > 0.1, "{g}");
    }
}
