//! diffusers folder layout: `model_index.json`, one folder per component, weight
//! files in plain, variant (`.fp16.safetensors`) and sharded (`.safetensors.index.json`) form.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::safetensors::SafetensorsFile;
use super::store::WeightStore;
use crate::error::LoadError;

/// The weight-file stems diffusers (`diffusion_pytorch_model`) and transformers (`model`) use.
const STEMS: [&str; 2] = ["diffusion_pytorch_model", "model"];

/// Which weight files of a component folder to read.
pub fn find_weight_files(dir: &Path, variant: Option<&str>) -> Result<Vec<PathBuf>, LoadError> {
    if !dir.is_dir() {
        return Err(LoadError::NotFound {
            path: dir.to_path_buf(),
            hint: " (expected a diffusers component folder)".into(),
        });
    }
    let try_variant = |v: Option<&str>| -> Result<Option<Vec<PathBuf>>, LoadError> {
        for stem in STEMS {
            let single = match v {
                Some(v) => dir.join(format!("{stem}.{v}.safetensors")),
                None => dir.join(format!("{stem}.safetensors")),
            };
            if single.is_file() {
                return Ok(Some(vec![single]));
            }
            // diffusers names variant indexes `<stem>.safetensors.index.<v>.json`;
            // some tools write `<stem>.<v>.safetensors.index.json`.
            let indexes: Vec<PathBuf> = match v {
                Some(v) => vec![
                    dir.join(format!("{stem}.safetensors.index.{v}.json")),
                    dir.join(format!("{stem}.{v}.safetensors.index.json")),
                ],
                None => vec![dir.join(format!("{stem}.safetensors.index.json"))],
            };
            for index in indexes {
                if index.is_file() {
                    return shards_from_index(&index).map(Some);
                }
            }
        }
        Ok(None)
    };
    if let Some(files) = try_variant(variant)? {
        return Ok(files);
    }
    if variant.is_none() {
        // A folder shipped only as fp16 is still the model the user pointed at.
        for v in ["fp16", "bf16"] {
            if let Some(files) = try_variant(Some(v))? {
                tracing::info!(dir = %dir.display(), variant = v, "no plain weights; using the {v} variant");
                return Ok(files);
            }
        }
    }
    // Say precisely why nothing loadable is here.
    for stem in STEMS {
        for ext in ["bin", "ckpt", "pt", "pth"] {
            let p = dir.join(format!("{stem}.{ext}"));
            if p.is_file() {
                return Err(LoadError::Pickle {
                    path: p,
                    kind: "by its extension",
                });
            }
        }
    }
    Err(LoadError::NotFound {
        path: dir.join(match variant {
            Some(v) => format!("diffusion_pytorch_model.{v}.safetensors"),
            None => "diffusion_pytorch_model.safetensors".into(),
        }),
        hint: " (nor model.safetensors, a sharded .safetensors.index.json, or a variant)".into(),
    })
}

fn shards_from_index(index: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let text = std::fs::read_to_string(index).map_err(|source| LoadError::Io {
        path: index.to_path_buf(),
        source,
    })?;
    let v: Value = serde_json::from_str(&text).map_err(|source| LoadError::Json {
        path: index.to_path_buf(),
        source,
    })?;
    let map = v.get("weight_map").and_then(Value::as_object).ok_or_else(|| LoadError::Layout {
        path: index.to_path_buf(),
        reason: "no `weight_map` object".into(),
    })?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = Vec::new();
    for (tensor, file) in map {
        let name = file.as_str().ok_or_else(|| LoadError::Layout {
            path: index.to_path_buf(),
            reason: format!("weight_map entry for `{tensor}` is not a file name"),
        })?;
        if name.contains('/') || name.contains('\\') || name.starts_with('.') {
            return Err(LoadError::Layout {
                path: index.to_path_buf(),
                reason: format!("shard name `{name}` must be a plain file name in the same folder"),
            });
        }
        let p = dir.join(name);
        if !files.contains(&p) {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

/// Opens a component folder's weights into one store, checking that a sharded
/// index and its shards agree.
pub fn open_component(dir: &Path, variant: Option<&str>) -> Result<WeightStore, LoadError> {
    let files = find_weight_files(dir, variant)?;
    let mut store = WeightStore::new(if files.len() == 1 { files[0].clone() } else { dir.to_path_buf() });
    for f in &files {
        let file = SafetensorsFile::open(f)?;
        store.add_file(&file)?;
    }
    Ok(store)
}

/// `model_index.json`: pipeline class and the class of each component.
#[derive(Debug, Clone)]
pub struct ModelIndex {
    pub pipeline_class: Option<String>,
    pub components: Vec<(String, Option<String>)>,
}

impl ModelIndex {
    pub fn read(path: &Path) -> Result<Self, LoadError> {
        let text = std::fs::read_to_string(path).map_err(|source| LoadError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let v: Value = serde_json::from_str(&text).map_err(|source| LoadError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let obj = v.as_object().ok_or_else(|| LoadError::Layout {
            path: path.to_path_buf(),
            reason: "not a JSON object".into(),
        })?;
        let mut components = Vec::new();
        for (k, val) in obj {
            if k.starts_with('_') {
                continue;
            }
            // ["library", "ClassName"] or [null, null] for an absent component.
            if let Some(arr) = val.as_array() {
                let class = arr.get(1).and_then(Value::as_str).map(str::to_string);
                components.push((k.clone(), class));
            }
        }
        Ok(Self {
            pipeline_class: obj.get("_class_name").and_then(Value::as_str).map(str::to_string),
            components,
        })
    }

    pub fn class_of(&self, component: &str) -> Option<&str> {
        self.components
            .iter()
            .find(|(k, _)| k == component)
            .and_then(|(_, c)| c.as_deref())
    }
}
