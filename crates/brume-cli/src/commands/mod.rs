pub mod bench;
pub mod bench_precision;
pub mod bench_serve;
pub mod convert;
pub mod bench_memory;
pub mod bench_kernels;
pub mod bench_speed;
pub mod doctor;
pub mod edit;
pub mod eval;
pub mod eval_edits;
pub mod gallery;
pub mod generate;
pub mod info;
pub mod inspect;
pub mod live;
pub mod bench_live;
pub mod memory;
pub mod random_model;
pub mod run;
pub mod serve;

use std::path::PathBuf;

use anyhow::Context;
use brume::pipelines::{OpenOptions, SdModel};

pub use memory::MemoryArgs;

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
    /// Run another UNet subfolder of the model (e.g. `unet_lcm`, the built-in model's
    /// LCM-distilled UNet for 1-4 steps); its `scheduler_<name>/` comes with it.
    #[arg(long)]
    pub unet: Option<String>,
}

impl ModelArgs {
    /// The model's path on disk; `None` for the model compiled into the executable.
    pub fn path(&self) -> Option<PathBuf> {
        match &self.model {
            Some(p) if p.as_os_str() != brume::pipelines::EMBEDDED_ROOT => Some(p.clone()),
            Some(_) => None,
            None => std::env::var_os("BRUME_BUILTIN_MODEL").map(PathBuf::from),
        }
    }

    /// Fills in the model (and UNet folder) a recipe was made with, where the
    /// command line does not name one: `--from` re-creates with the same weights.
    pub fn follow(&mut self, r: &brume::pipelines::recipe::Recipe) {
        if self.model.is_none() {
            self.model = Some(r.model_path.clone());
        }
        if self.unet.is_none() && self.model.as_ref() == Some(&r.model_path) {
            self.unet = r.unet.clone();
        }
    }

    /// The chosen model as the runtime serves it.
    pub fn entry(&self) -> brume_runtime::ModelEntry {
        match self.path() {
            Some(path) => brume_runtime::ModelEntry {
                name: path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| path.display().to_string()),
                source: brume_runtime::ModelSource::Path { path, config_dir: self.config.clone(), variant: self.variant.clone() },
            },
            None => brume_runtime::ModelEntry { name: "builtin".into(), source: brume_runtime::ModelSource::Embedded { files: crate::builtin::FILES } },
        }
    }

    /// The chosen model: `--model`, else `$BRUME_BUILTIN_MODEL` (a folder), else
    /// the model compiled into this executable.
    pub fn open(&self) -> anyhow::Result<SdModel> {
        let opts = OpenOptions {
            variant: self.variant.clone(),
            config_dir: self.config.clone(),
            unet: self.unet.clone(),
        };
        match self.path() {
            Some(path) => SdModel::open(&path, &opts).with_context(|| format!("opening model {}", path.display())),
            None => SdModel::from_embedded("builtin", crate::builtin::FILES, self.unet.as_deref()).context("opening the built-in model"),
        }
    }
}

