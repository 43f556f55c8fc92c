//! The models a runtime serves, by name, and what clients may learn of them.

use std::path::{Path, PathBuf};

use brume::pipelines::{EmbeddedFile, OpenOptions, SdModel};

/// Where a model's files are.
#[derive(Debug, Clone)]
pub enum ModelSource {
    /// A diffusers folder or a single-file checkpoint on disk.
    Path {
        path: PathBuf,
        /// For single-file checkpoints: a diffusers folder with the component configs.
        config_dir: Option<PathBuf>,
        /// Weight variant, as diffusers' `variant=` (e.g. `fp16`).
        variant: Option<String>,
    },
    /// A diffusers folder compiled into the executable (the built-in model).
    Embedded { files: &'static [EmbeddedFile] },
}

/// One model the runtime serves.
#[derive(Debug, Clone)]
pub struct ModelEntry {
    /// The name clients use (`--model NAME=PATH`; `builtin` for the built-in one).
    pub name: String,
    pub source: ModelSource,
}

impl ModelEntry {
    /// Opens the model with one of its UNet folders (`None`: `unet`).
    pub fn open(&self, unet: Option<&str>) -> Result<SdModel, brume::error::LoadError> {
        match &self.source {
            ModelSource::Path { path, config_dir, variant } => {
                let opts = OpenOptions { variant: variant.clone(), config_dir: config_dir.clone(), unet: unet.map(str::to_string) };
                SdModel::open(path, &opts)
            }
            ModelSource::Embedded { files } => SdModel::from_embedded(&self.name, files, unet),
        }
    }

    /// The UNet subfolders the model has (`unet` first), found by their config.
    pub fn unet_folders(&self) -> Vec<String> {
        let mut names: Vec<String> = match &self.source {
            ModelSource::Path { path, .. } => list_unet_dirs(path),
            ModelSource::Embedded { files } => {
                let mut v: Vec<String> = files
                    .iter()
                    .filter_map(|f| f.path.strip_suffix("/config.json"))
                    .filter(|d| is_unet_folder(d))
                    .map(str::to_string)
                    .collect();
                v.dedup();
                v
            }
        };
        names.sort_by(|a, b| (a != "unet", a).cmp(&(b != "unet", b)));
        names.dedup();
        if names.is_empty() {
            // A single-file checkpoint has no folders; its UNet is the default one.
            names.push("unet".into());
        }
        names
    }
}

fn is_unet_folder(name: &str) -> bool {
    name == "unet" || name.strip_prefix("unet_").is_some_and(|s| !s.is_empty() && !s.contains('/'))
}

fn list_unet_dirs(root: &Path) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(root) else { return Vec::new() };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| is_unet_folder(n) && root.join(n).join("config.json").is_file())
        .collect()
}

/// What a UNet folder recommends, resolved for its own scheduler.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct UnetInfo {
    pub name: String,
    /// The sampler its scheduler config names (CLI name).
    pub sampler: String,
    pub steps: usize,
    pub guidance: f64,
    /// img2img strength.
    pub strength: f64,
    /// A distilled UNet meant for 1-8 steps (LCM, TCD, or a guidance-embedded one).
    pub few_step: bool,
    /// A 9-channel inpainting UNet (inpainting only).
    pub inpainting: bool,
}

/// What clients may learn of a model.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ModelInfo {
    pub name: String,
    pub default: bool,
    /// Native output side in pixels.
    pub default_size: usize,
    /// Sides must be multiples of this (the VAE factor).
    pub size_multiple: usize,
    pub unets: Vec<UnetInfo>,
    /// First 10 hex digits of the weights' fingerprint (as recipes carry it).
    pub hash: String,
    /// Text-encoder layers (clip_skip must stay below this).
    pub text_layers: usize,
    pub tiny_vae: bool,
}

impl ModelInfo {
    /// Opens every UNet folder of `entry` once to read its settings.
    pub fn read(entry: &ModelEntry, default: bool) -> Result<Self, String> {
        let mut unets = Vec::new();
        let mut base: Option<(usize, usize, String, usize, bool)> = None;
        for folder in entry.unet_folders() {
            let m = entry.open(Some(&folder)).map_err(|e| e.to_string())?;
            let kind = m.sampler_kind(None).map_err(|e| e.to_string())?;
            let s = m.sampling_settings(kind, None, None).map_err(|e| e.to_string())?;
            unets.push(UnetInfo {
                name: folder.clone(),
                sampler: kind.cli_name().to_string(),
                steps: s.steps,
                guidance: s.guidance_scale,
                strength: m.sampling.img2img_strength(None),
                few_step: kind.is_few_step() || m.unet_config.time_cond_proj_dim.is_some(),
                inpainting: m.unet_config.in_channels != m.vae_config.latent_channels(),
            });
            if base.is_none() {
                base = Some((
                    m.default_size(),
                    m.vae_config.scale_factor(),
                    brume::pipelines::recipe::model_hash(&m),
                    m.text_config.num_hidden_layers,
                    matches!(m.vae_config, brume::pipelines::VaeConfig::Tiny(_)),
                ));
            }
        }
        let (default_size, size_multiple, hash, text_layers, tiny_vae) = base.ok_or("the model has no UNet")?;
        Ok(Self { name: entry.name.clone(), default, default_size, size_multiple, unets, hash, text_layers, tiny_vae })
    }

    pub fn unet(&self, name: &str) -> Option<&UnetInfo> {
        self.unets.iter().find(|u| u.name == name)
    }
}
