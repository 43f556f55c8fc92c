//! Times `x [m, k] W^T` on the AVX2 GEMM with cold weights: `copies` weights of
//! [n, k] are cycled, so that (with more bytes than the L3 holds) each product reads
//! its weight from memory, as a UNet does, where `brume bench kernels` repeats one
//! weight that then stays in cache. Prints the median seconds per product over
//! `reps - 1` rounds (the first is a warm-up) and its GFLOP/s.
//!
//! `cargo run --release -p brume --example cold_linear -- M K N COPIES REPS`

use brume::kernels::{matmul::linear_on, Isa};
use candle_core::{Device, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args().skip(1).map(|s| s.parse()).collect::<Result<_, _>>()?;
    let [m, k, n, copies, reps] = args[..] else {
        return Err("usage: cold_linear M K N COPIES REPS (REPS >= 2)".into());
    };
    if reps < 2 || copies == 0 {
        return Err("needs REPS >= 2 (the first is a warm-up) and COPIES >= 1".into());
    }
    let dev = Device::Cpu;
    let a = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
    let ws = (0..copies).map(|_| Tensor::randn(0f32, 1.0, (n, k), &dev)).collect::<Result<Vec<_>, _>>()?;
    let mut times = Vec::new();
    for r in 0..reps {
        let t = std::time::Instant::now();
        for w in &ws {
            linear_on(Isa::Avx2, &a, w)?;
        }
        if r > 0 {
            times.push(t.elapsed().as_secs_f64() / copies as f64);
        }
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    println!("{m}x{k} -> {n}: median {med:.5} s per product, {:.1} GFLOP/s", 2.0 * (m * k * n) as f64 / med / 1e9);
    Ok(())
}
