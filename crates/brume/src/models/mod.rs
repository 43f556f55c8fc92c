//! The models of the Stable Diffusion family, one file per diffusers component,
//! named after the diffusers / transformers modules they reproduce.

pub mod attention;
pub mod autoencoder_kl;
pub mod autoencoder_tiny;
pub mod clip;
pub mod config;
pub mod embeddings;
pub mod resnet;
pub mod unet_2d_blocks;
pub mod unet_2d_condition;

pub use autoencoder_kl::{AutoencoderKLConfig, LatentDistribution, VaeDecoder, VaeEncoder};
pub use autoencoder_tiny::{AutoencoderTinyConfig, TinyDecoder, TinyEncoder};
pub use clip::{ClipOutput, ClipTextConfig, ClipTextModel};
pub use unet_2d_condition::{UNet2DConditionModel, UNetConfig};
