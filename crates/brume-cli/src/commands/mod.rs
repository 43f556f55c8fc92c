pub mod bench;
pub mod doctor;
pub mod edit;
pub mod eval;
pub mod generate;
pub mod info;
pub mod inspect;
pub mod random_model;
pub mod run;

use std::path::PathBuf;

use anyhow::Context;
use brume::pipelines::{OpenOptions, SdModel};

/// Model selection shared by every command that runs a model.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// A diffusers model folder or an LDM single-file .safetensors (default: the built-in model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// For single-file checkpoints: a diffusers folder holding the component configs.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Weight variant to load (e.g. fp16), as diffusers' `variant=`.
    #[arg(long)]
    pub variant: Option<String>,
}

/// Where the built-in model lives: next to the executable's repository checkout.
pub fn builtin_model_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("BRUME_BUILTIN_MODEL") {
        return PathBuf::from(p);
    }
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/builtin"))
}

impl ModelArgs {
    pub fn open(&self) -> anyhow::Result<SdModel> {
        let path = self.model.clone().unwrap_or_else(builtin_model_dir);
        let opts = OpenOptions {
            variant: self.variant.clone(),
            config_dir: self.config.clone(),
        };
        SdModel::open(&path, &opts).with_context(|| format!("opening model {}", path.display()))
    }
}
