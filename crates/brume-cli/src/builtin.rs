//! The built-in model, compiled into the executable so `brume generate` works
//! on a fresh install with no path and no download.

use brume::pipelines::EmbeddedFile;

macro_rules! embed {
    ($($path:literal),* $(,)?) => {
        &[$(EmbeddedFile { path: $path, bytes: include_bytes!(concat!("../../../models/builtin/", $path)) }),*]
    };
}

/// Every file of `models/builtin/` the engine reads (the tokenizer is the
/// engine's embedded CLIP vocabulary).
pub static FILES: &[EmbeddedFile] = embed!(
    "model_index.json",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "unet/config.json",
    "unet/diffusion_pytorch_model.safetensors",
    "unet/sampling_defaults.json",
    "unet_lcm/config.json",
    "unet_lcm/diffusion_pytorch_model.safetensors",
    "unet_lcm/sampling_defaults.json",
    "scheduler_lcm/scheduler_config.json",
    // The vocabulary is the engine's; these two small files carry its settings
    // so a converted copy has the original's tokenizer folder.
    "tokenizer/tokenizer_config.json",
    "tokenizer/special_tokens_map.json",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
);
