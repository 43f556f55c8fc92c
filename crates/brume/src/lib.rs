//! brume: an offline, on-device latent diffusion engine.
//!
//! Layout, by architecture: [`layers`] (the hot ops behind our own types),
//! [`models`] (CLIP, UNet, VAEs, one file per diffusers component),
//! [`loading`] (safetensors, diffusers folders, LDM single files),
//! [`samplers`], [`pipelines`], [`runtime`] (devices, memory accounting).

pub mod error;
pub mod kernels;
pub mod layers;
pub mod loading;
pub mod memory;
pub mod models;
pub mod output;
pub mod pipelines;
pub mod quantization;
pub mod runtime;
pub mod samplers;
pub mod util;

pub use error::{LoadError, RunError};
