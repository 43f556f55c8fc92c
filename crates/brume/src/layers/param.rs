use candle_core::{Device, Result, Tensor};

use super::mapped::MappedF32;
use crate::error::LoadError;
use crate::loading::Weights;

/// A layer's large weight: used in place from the file when possible, else a tensor.
#[derive(Debug, Clone)]
pub enum Param {
    Dense(Tensor),
    Mapped(MappedF32),
}

impl Param {
    /// Maps the weight in place on the CPU in f32 when the file stores f32 and
    /// is aligned; otherwise materialises (converting dtype as needed).
    pub fn load(w: &Weights, leaf: &str, shape: &[usize]) -> std::result::Result<Self, LoadError> {
        if matches!(w.device(), Device::Cpu) && w.dtype() == candle_core::DType::F32 && !w.is_recording() {
            let stored = w.stored(leaf, shape)?;
            if let Some(m) = MappedF32::from_stored(stored, shape) {
                return Ok(Param::Mapped(m));
            }
            tracing::debug!(tensor = %w.name(leaf), "not mappable in place (dtype or alignment); copying");
        }
        w.tensor(leaf, shape).map(Param::Dense)
    }

    pub fn is_mapped(&self) -> bool {
        matches!(self, Param::Mapped(_))
    }

    /// A tensor view for code paths without an in-place kernel (copies if mapped).
    pub fn to_tensor(&self, device: &Device) -> Result<Tensor> {
        match self {
            Param::Dense(t) => Ok(t.clone()),
            Param::Mapped(m) => m.to_tensor(device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loading::diffusers::open_component;

    fn fixture(case: &str) -> std::path::PathBuf {
        std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/parity")).join(case).join("model")
    }

    #[test]
    fn f32_weights_are_used_in_place_and_f16_are_converted() {
        let store = open_component(&fixture("unet_sd1"), None).unwrap();
        let loader = store.loader("test", &Device::Cpu, candle_core::DType::F32);
        let w = loader.root().pp("conv_in");
        assert!(Param::load(&w, "weight", &[16, 4, 3, 3]).unwrap().is_mapped());
        // Computing in f16 needs a converted copy.
        let loader16 = store.loader("test", &Device::Cpu, candle_core::DType::F16);
        let w16 = loader16.root().pp("conv_in");
        assert!(!Param::load(&w16, "weight", &[16, 4, 3, 3]).unwrap().is_mapped());
    }
}
