//! Where and how models run: the compute device and process memory readings.

pub mod budget;
pub mod memory;

use candle_core::Device;

/// The compute device: the CPU here; CUDA/Metal builds of candle plug in later.
pub fn default_device() -> Device {
    Device::Cpu
}
