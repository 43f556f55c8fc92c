//! Times the direct kernel's conv of a nearest 2x upsampled map by output phases
//! (`kernels::conv3x3_upsampled`, what the layers run) against its 3x3 taps over the
//! doubled rows (what `BRUME_UPSAMPLE_PHASES=off` runs), alternated in one process:
//! SD's 1280-channel upsampler to 32x32 by default (SDXS's and SD 1.5's up path).
//!
//! `cargo run --release -p brume --example upsampled_conv -- [C O H_OUT BATCH REPS]`

use brume::kernels::conv3x3_upsampled::conv3x3_upsampled_on;
use candle_core::{Device, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args().skip(1).map(|s| s.parse()).collect::<Result<_, _>>()?;
    let [c, o, side, batch, reps] = match args[..] {
        [] => [1280, 1280, 32, 1, 9],
        [a, b, h, n, r] => [a, b, h, n, r],
        _ => return Err("usage: upsampled_conv [C O H_OUT BATCH REPS]".into()),
    };
    if side % 2 != 0 || reps == 0 || c == 0 || o == 0 || batch == 0 {
        return Err("H_OUT must be even; C, O, BATCH and REPS at least 1".into());
    }
    let dev = Device::Cpu;
    let isa = brume::kernels::isa();
    let w = (Tensor::randn(0f32, 1.0, (o, c, 3, 3), &dev)? * (1.0 / ((9 * c) as f64).sqrt()))?;
    let x = Tensor::randn(0f32, 1.0, (batch, c, side / 2, side / 2), &dev)?;
    let (mut phases, mut taps) = (Vec::new(), Vec::new());
    let mut err = 0f32;
    for _ in 0..reps {
        let t = std::time::Instant::now();
        let a = conv3x3_upsampled_on(isa, &x, &w, true)?;
        phases.push(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        let b = conv3x3_upsampled_on(isa, &x, &w, false)?;
        taps.push(t.elapsed().as_secs_f64());
        let scale = b.abs()?.max_all()?.to_scalar::<f32>()?;
        err = err.max((a - &b)?.abs()?.max_all()?.to_scalar::<f32>()? / scale);
    }
    for v in [&mut phases, &mut taps] {
        v.sort_by(f64::total_cmp);
    }
    let med = |v: &[f64]| v[v.len() / 2];
    let gflop = 2.0 * (batch * o * c * 9 * side * side) as f64 / 1e9;
    println!(
        "{}: {batch} x {c} -> {o}, upsampled to {side}x{side} ({gflop:.1} GFLOP as a 3x3 conv): phases median {:.4} s (min {:.4}), 3x3 taps median {:.4} s (min {:.4}); time ratio {:.3}; max relative difference {err:.1e}",
        isa.name(),
        med(&phases),
        phases[0],
        med(&taps),
        taps[0],
        med(&phases) / med(&taps)
    );
    Ok(())
}
