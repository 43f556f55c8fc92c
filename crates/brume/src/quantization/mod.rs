//! Precision tiers: storing weights in fewer bits, and reading them back.
//!
//! [`Scheme`] says how one tensor is stored (fp32, fp16, bf16, int8 per output
//! channel, n-bit k-means palettization with fp16 lookup tables, ternary);
//! [`Policy`] picks a scheme per tensor name (named presets or a policy file);
//! [`codec`] encodes and decodes; [`pack`] is the n-bit index layout; [`format`]
//! is how compressed tensors are described in a safetensors file; [`convert`]
//! writes a whole model under a policy, tensor by tensor.

pub mod codec;
pub mod convert;
pub mod format;
pub mod error;
pub mod kmeans;
pub mod pack;
pub mod policy;
pub mod scheme;

pub use error::QuantError;
pub use policy::Policy;
pub use scheme::{Bits, LutGranularity, Scheme};
