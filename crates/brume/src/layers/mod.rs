//! The hot operations every model calls: linear, convolution, normalisation,
//! attention, embedding and activations.
//!
//! Models never call candle's ops for these directly. Keeping them behind our own
//! types is what lets faster CPU kernels and compressed weights replace the
//! plain path later without touching a line of model code.

mod activation;
mod attention;
mod conv;
mod embedding;
mod linear;
pub mod mapped;
mod norm;
pub mod packed;
mod param;

pub use activation::Activation;
pub use attention::{attention, attention_reference, attention_reference_with, attention_with, AttentionMask, AttentionMode};
pub use conv::{Conv2d, Conv2dConfig};
pub use embedding::Embedding;
pub use linear::Linear;
pub use norm::{GroupNorm, LayerNorm};
pub use packed::PackedWeight;
pub use param::Param;
