//! Where and how models run: the compute device and process memory readings.

pub mod budget;
mod large_blocks;
pub mod memory;

use candle_core::Device;

/// The compute device: the CPU here; CUDA/Metal builds of candle plug in later.
pub fn default_device() -> Device {
    Device::Cpu
}

/// Runs `f` on one of the kernels' pool threads and returns its result; the caller
/// waits. Run inference this way (the CLI runs every command so). A kernel called
/// from outside the pool hands its tasks to the pool and sleeps until they are done,
/// one futex wake and wait per op; a small model runs hundreds of ops per step, so
/// on 2 cores the built-in model's `brume eval adherence` spent a third of its time
/// in those handoffs (11.7-13.1 s of system time in 17-21 s). From a pool thread the
/// caller works on its own tasks while the other threads steal: 1.44-1.79 -> 2.19-2.48
/// images/s (30 prompts, alternated twice on a 2-core Zen 3; the same images).
pub fn on_compute_thread<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

/// Leaves the CPU's cores to one thread pool. brume's kernels and candle's matmuls
/// run on rayon's pool; candle 0.11 also starts its own "barrier pool" for
/// elementwise ops, whose threads spin for tens of thousands of iterations after
/// each op and whose caller spins until every worker is done. On a 2-core machine
/// the two pools take turns evicting each other: the built-in model's 20-step
/// generation spent half its time in those spins (1.08 s, 0.50 s without them).
/// With `CANDLE_NUM_THREADS=1` candle runs elementwise ops on the calling thread,
/// which for these memory-bound ops costs little. Call first thing in `main`,
/// before any thread starts; a value the user set is kept.
pub fn use_one_thread_pool() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
}
