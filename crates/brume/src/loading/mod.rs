//! Reading model weights and configs from disk: safetensors files (validated,
//! memory-mapped), diffusers folders (variants, shards) and LDM single files.

pub mod diffusers;
pub mod ldm;
pub mod safetensors;
pub mod segment;
pub mod store;
pub mod transform;

pub use segment::{Component, Segment};
pub use store::{Loader, StoredTensor, WeightStore, Weights};
pub use transform::Transform;
