use candle_core::{Device, Result, Tensor};

use super::mapped::MappedF32;
use super::packed::PackedWeight;
use crate::error::LoadError;
use crate::loading::Weights;

/// A layer's large weight: used in place from the file when possible, else a tensor.
#[derive(Debug, Clone)]
pub enum Param {
    Dense(Tensor),
    /// f32 in the file, read in place.
    Mapped(MappedF32),
    /// Compressed (int8, palettized, ternary) or half precision in the file,
    /// expanded a block of output channels at a time at forward time. Boxed: it is the largest
    /// variant, and models hold hundreds of these inline.
    Packed(Box<PackedWeight>),
}

impl Param {
    /// Computing in f32 on the CPU, keeps the weight in the file: f32 (aligned) is
    /// used in place, compressed and half-precision weights are expanded per layer
    /// at forward time. Otherwise materialises (decoding and converting as needed).
    pub fn load(w: &Weights, leaf: &str, shape: &[usize]) -> std::result::Result<Self, LoadError> {
        if matches!(w.device(), Device::Cpu) && w.dtype() == candle_core::DType::F32 && !w.is_recording() {
            let stored = w.stored(leaf, shape)?;
            if let Some(m) = MappedF32::from_stored(stored, shape) {
                return Ok(Param::Mapped(m));
            }
            if let Some(p) = PackedWeight::from_stored(stored, &w.name(leaf)) {
                return p.map(|p| Param::Packed(Box::new(p)));
            }
            tracing::debug!(tensor = %w.name(leaf), "not mappable in place (dtype or alignment); copying");
        }
        w.tensor(leaf, shape).map(Param::Dense)
    }

    pub fn is_packed(&self) -> bool {
        matches!(self, Param::Packed(_))
    }

    pub fn is_mapped(&self) -> bool {
        matches!(self, Param::Mapped(_))
    }

    /// A tensor view for code paths without an in-place kernel (copies if mapped).
    pub fn to_tensor(&self, device: &Device) -> Result<Tensor> {
        match self {
            Param::Dense(t) => Ok(t.clone()),
            Param::Mapped(m) => m.to_tensor(device),
            Param::Packed(p) => p.to_tensor(device),
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
        let p16 = Param::load(&w16, "weight", &[16, 4, 3, 3]).unwrap();
        assert!(!p16.is_mapped() && !p16.is_packed());
    }
}
