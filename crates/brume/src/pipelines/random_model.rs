//! Random-weight models of real architectures, written as diffusers folders.
//!
//! No pretrained weights can be downloaded here, yet speed and memory must be
//! measured at true size. The tensor list of each component comes from our own
//! modules (a recording loader), so a written model is by construction one that
//! brume loads; weights are streamed to disk tensor by tensor, never held whole.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use candle_core::{DType, Device};

use super::model::VaeConfig;
use crate::error::{LoadError, Result, RunError};
use crate::loading::safetensors::StoredDType;
use crate::loading::Loader;
use crate::models::config::ConfigReader;
use crate::models::{ClipTextConfig, ClipTextModel, UNet2DConditionModel, UNetConfig, VaeDecoder, VaeEncoder};
use crate::models::{TinyDecoder, TinyEncoder};
use crate::samplers::Rng;

/// The config files of one reference model, embedded in the binary.
pub struct Preset {
    pub name: &'static str,
    pub description: &'static str,
    files: &'static [(&'static str, &'static str)],
}

macro_rules! preset_files {
    ($dir:literal, vae = $vae:literal) => {
        &[
            ("model_index.json", include_str!(concat!("../../../../configs/", $dir, "/model_index.json"))),
            ("text_encoder/config.json", include_str!(concat!("../../../../configs/", $dir, "/text_encoder.json"))),
            ("unet/config.json", include_str!(concat!("../../../../configs/", $dir, "/unet.json"))),
            ("vae/config.json", include_str!(concat!("../../../../configs/", $vae))),
            ("scheduler/scheduler_config.json", include_str!(concat!("../../../../configs/", $dir, "/scheduler.json"))),
            ("tokenizer/tokenizer_config.json", include_str!(concat!("../../../../configs/", $dir, "/tokenizer_config.json"))),
            (
                "tokenizer/special_tokens_map.json",
                include_str!(concat!("../../../../configs/", $dir, "/tokenizer_special_tokens_map.json")),
            ),
        ]
    };
}

pub const PRESETS: &[Preset] = &[
    Preset {
        name: "sd15",
        description: "Stable Diffusion 1.5 (runwayml / sd-legacy)",
        files: preset_files!("sd15", vae = "sd15/vae.json"),
    },
    Preset {
        name: "sd15-inpainting",
        description: "Stable Diffusion 1.5 inpainting (9-channel UNet)",
        files: preset_files!("sd15_inpainting", vae = "sd15_inpainting/vae.json"),
    },
    Preset {
        name: "sd21-base",
        description: "Stable Diffusion 2.1-base (OpenCLIP ViT-H text encoder, 512 px)",
        files: preset_files!("sd21_base", vae = "sd21_base/vae.json"),
    },
    Preset {
        name: "sd-turbo",
        description: "SD-Turbo (distilled SD 2.1, 1-4 steps)",
        files: preset_files!("sd_turbo", vae = "sd_turbo/vae.json"),
    },
    Preset {
        name: "sdxs-512",
        description: "SDXS-512-0.9 (one-step UNet with the tiny VAE)",
        files: preset_files!("sdxs_512_0_9", vae = "sdxs_512_0_9/vae.json"),
    },
    Preset {
        name: "lcm-dreamshaper-v7",
        description: "LCM Dreamshaper v7 (SD 1.5 UNet with time_cond_proj_dim)",
        files: preset_files!("lcm_dreamshaper_v7", vae = "lcm_dreamshaper_v7/vae.json"),
    },
];

pub fn preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}

fn config(preset: &Preset, file: &str) -> std::result::Result<ConfigReader, LoadError> {
    let text = preset.files.iter().find(|(f, _)| *f == file).map(|(_, t)| *t).unwrap_or("{}");
    ConfigReader::parse(Path::new(&format!("<{} {file}>", preset.name)), text)
}

fn record(build: impl FnOnce(&Loader) -> std::result::Result<(), LoadError>) -> std::result::Result<Vec<(String, Vec<usize>)>, LoadError> {
    let loader = crate::loading::WeightStore::recorder("random model", &Device::Cpu, DType::F32);
    build(&loader)?;
    Ok(loader.recorded())
}

/// Names and shapes of every tensor of each component folder of `preset`.
pub fn tensor_lists(preset: &Preset) -> std::result::Result<BTreeMap<&'static str, Vec<(String, Vec<usize>)>>, LoadError> {
    let text = ClipTextConfig::from_reader(&config(preset, "text_encoder/config.json")?)?;
    let unet = UNetConfig::from_reader(&config(preset, "unet/config.json")?)?;
    let vae_reader = config(preset, "vae/config.json")?;
    let vae = match vae_reader.string("_class_name")?.as_deref() {
        Some("AutoencoderTiny") => VaeConfig::Tiny(crate::models::AutoencoderTinyConfig::from_reader(&vae_reader)?),
        _ => VaeConfig::Kl(crate::models::AutoencoderKLConfig::from_reader(&vae_reader)?),
    };
    let mut out = BTreeMap::new();
    out.insert("text_encoder", record(|l| ClipTextModel::from_loader(l, &text).map(drop))?);
    out.insert("unet", record(|l| UNet2DConditionModel::from_loader(l, &unet).map(drop))?);
    out.insert(
        "vae",
        record(|l| {
            match &vae {
                VaeConfig::Kl(c) => {
                    VaeEncoder::from_loader(l, c)?;
                    VaeDecoder::from_loader(l, c)?;
                }
                VaeConfig::Tiny(c) => {
                    TinyEncoder::from_loader(l, c)?;
                    TinyDecoder::from_loader(l, c)?;
                }
            }
            Ok(())
        })?,
    );
    Ok(out)
}

/// Writes `preset` with random weights into the new folder `out`.
pub fn write(preset: &Preset, out: &Path, dtype: StoredDType, seed: u64) -> Result<()> {
    // The output rule for folders: a free name (or an empty folder) only,
    // never through a symlink; built in a temporary sibling that an error removes.
    let target = crate::output::OutputDir::new(out, false);
    target.check(|_| false).map_err(|e| match e {
        crate::output::OutputError::Exists { .. } => {
            RunError::Invalid(format!("{} already exists; choose a new folder", out.display()))
        }
        e => e.into(),
    })?;
    let (elem, is_f16) = match dtype {
        StoredDType::F32 => (4, false),
        StoredDType::F16 => (2, true),
        other => return Err(RunError::Invalid(format!("random models are written as F32 or F16, not {other}"))),
    };
    let lists = tensor_lists(preset)?;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| RunError::Write { path, source }
    };
    let tmp = target.temp()?;
    let dir = tmp.path().to_path_buf();
    for (file, text) in preset.files {
        let p = dir.join(file);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        std::fs::write(&p, text).map_err(io(&p))?;
    }
    let mut rng = Rng::new(seed);
    for (component, tensors) in &lists {
        let stem = if *component == "text_encoder" { "model" } else { "diffusion_pytorch_model" };
        let path = dir.join(component).join(format!("{stem}.safetensors"));
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        let mut header = serde_json::Map::new();
        let mut offset = 0usize;
        for (name, shape) in tensors {
            let bytes = shape.iter().product::<usize>() * elem;
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": dtype.name(), "shape": shape, "data_offsets": [offset, offset + bytes]}),
            );
            offset += bytes;
        }
        header.insert("__metadata__".into(), serde_json::json!({"format": "pt", "brume": "random weights"}));
        let mut header_bytes = serde_json::to_vec(&serde_json::Value::Object(header))
            .map_err(|e| RunError::Invalid(e.to_string()))?;
        while (header_bytes.len() + 8) % 8 != 0 {
            header_bytes.push(b' ');
        }
        crate::util::atomic_write(&path, |w| {
            w.write_all(&(header_bytes.len() as u64).to_le_bytes())?;
            w.write_all(&header_bytes)?;
            for (name, shape) in tensors {
                let fill = init_for(name, shape);
                let n: usize = shape.iter().product();
                let mut buf = Vec::with_capacity(n * elem);
                for _ in 0..n {
                    let v = fill.sample(&mut rng);
                    if is_f16 {
                        buf.extend_from_slice(&half::f16::from_f32(v).to_le_bytes());
                    } else {
                        buf.extend_from_slice(&v.to_le_bytes());
                    }
                }
                w.write_all(&buf)?;
            }
            Ok(())
        })
        .map_err(io(&path))?;
        tracing::info!(component, bytes = offset, "wrote random weights");
    }
    target.commit(tmp, |_| false).map_err(|e| match e {
        crate::output::OutputError::Exists { .. } => {
            RunError::Invalid(format!("{} appeared while writing and is left alone; nothing was written", out.display()))
        }
        e => e.into(),
    })?;
    Ok(())
}

/// How a tensor is initialised: keeps activations O(1) through deep stacks.
enum Init {
    Const(f32),
    /// Uniform in [-a, a].
    Uniform(f32),
}

impl Init {
    fn sample(&self, rng: &mut Rng) -> f32 {
        match self {
            Init::Const(c) => *c,
            Init::Uniform(a) => {
                let u = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
                (2.0 * u - 1.0) * a
            }
        }
    }
}

fn init_for(name: &str, shape: &[usize]) -> Init {
    if name.ends_with("bias") {
        Init::Const(0.0)
    } else if shape.len() == 1 {
        Init::Const(1.0)
    } else if name.contains("embedding") {
        Init::Uniform(0.02 * 3f32.sqrt())
    } else {
        let fan_in: usize = shape[1..].iter().product();
        Init::Uniform((3.0 / fan_in.max(1) as f32).sqrt())
    }
}
