//! Where and how models run: the compute device and process memory readings.

pub mod budget;
mod large_blocks;
pub mod memory;

use candle_core::Device;

/// The compute device: the CPU here; CUDA/Metal builds of candle plug in later.
pub fn default_device() -> Device {
    Device::Cpu
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
