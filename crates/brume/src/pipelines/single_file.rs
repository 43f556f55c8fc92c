//! Single-file SD 1.x / 2.x checkpoints in the original LDM key layout, mapped
//! at load time onto the same modules a diffusers folder feeds.

use std::collections::BTreeMap;
use std::path::Path;

use brume_tokenizer::{ClipTokenizer, PadToken};

use super::model::{OpenOptions, SdModel, VaeConfig};
use crate::error::LoadError;
use crate::loading::ldm::{self, LdmFamily};
use crate::loading::safetensors::SafetensorsFile;
use crate::loading::{Component, WeightStore};
use crate::models::config::ConfigReader;
use crate::models::{ClipTextConfig, UNetConfig};
use crate::samplers::ScheduleConfig;

/// Bundled configs of the reference models, used when the user gives none.
struct Template {
    name: &'static str,
    text_encoder: &'static str,
    unet: &'static str,
    vae: &'static str,
    scheduler: &'static str,
}

const SD15: Template = Template {
    name: "sd15",
    text_encoder: include_str!("../../../../configs/sd15/text_encoder.json"),
    unet: include_str!("../../../../configs/sd15/unet.json"),
    vae: include_str!("../../../../configs/sd15/vae.json"),
    scheduler: include_str!("../../../../configs/sd15/scheduler.json"),
};
const SD15_INPAINT: Template = Template {
    name: "sd15_inpainting",
    text_encoder: include_str!("../../../../configs/sd15_inpainting/text_encoder.json"),
    unet: include_str!("../../../../configs/sd15_inpainting/unet.json"),
    vae: include_str!("../../../../configs/sd15_inpainting/vae.json"),
    scheduler: include_str!("../../../../configs/sd15_inpainting/scheduler.json"),
};
const SD21_BASE: Template = Template {
    name: "sd21_base",
    text_encoder: include_str!("../../../../configs/sd21_base/text_encoder.json"),
    unet: include_str!("../../../../configs/sd21_base/unet.json"),
    vae: include_str!("../../../../configs/sd21_base/vae.json"),
    scheduler: include_str!("../../../../configs/sd21_base/scheduler.json"),
};

fn parse<T>(
    path: &Path,
    text: &str,
    f: impl FnOnce(&ConfigReader) -> Result<T, LoadError>,
) -> Result<T, LoadError> {
    f(&ConfigReader::parse(path, text)?)
}

/// Opens an LDM single-file `.safetensors` checkpoint.
pub fn open(path: &Path, opts: &OpenOptions) -> Result<SdModel, LoadError> {
    let file = SafetensorsFile::open(path)?;
    let tensors: Vec<(String, Vec<usize>)> =
        file.entries().iter().map(|(k, e)| (k.clone(), e.shape.clone())).collect();
    let layout_err = |reason: String| LoadError::Layout {
        path: path.to_path_buf(),
        reason,
    };
    if !ldm::is_ldm(&tensors) {
        return Err(layout_err(
            "not an LDM single-file checkpoint (no `model.diffusion_model.*` tensors); for a diffusers model, \
             point brume at the model folder (the one holding model_index.json)"
                .into(),
        ));
    }
    let inferred = ldm::infer(&tensors).map_err(|e| layout_err(e.to_string()))?;
    let (text_config, unet_config, vae_config, schedule, tokenizer) = match &opts.config_dir {
        Some(dir) => {
            let sched = dir.join("scheduler").join("scheduler_config.json");
            let tok = dir.join("tokenizer");
            (
                ClipTextConfig::from_file(&dir.join("text_encoder").join("config.json"))?,
                UNetConfig::from_file(&dir.join("unet").join("config.json"))?,
                VaeConfig::from_file(&dir.join("vae").join("config.json"))?,
                if sched.is_file() { ScheduleConfig::from_file(&sched)? } else { ScheduleConfig::default() },
                if tok.is_dir() { ClipTokenizer::from_model_dir(&tok)? } else { builtin_tokenizer(&inferred.family) },
            )
        }
        None => {
            let t = match (&inferred.family, inferred.unet_in_channels) {
                (LdmFamily::Sd1, 9) => &SD15_INPAINT,
                (LdmFamily::Sd1, _) => &SD15,
                (LdmFamily::Sd2, _) => &SD21_BASE,
            };
            tracing::info!(template = t.name, "single-file checkpoint: using bundled configs");
            let p = |c: &str| path.with_file_name(format!("<bundled {}/{c}.json>", t.name));
            let text_config = parse(&p("text_encoder"), t.text_encoder, ClipTextConfig::from_reader)?;
            let unet_config = parse(&p("unet"), t.unet, UNetConfig::from_reader)?;
            let vae_config = parse(&p("vae"), t.vae, |c| Ok(VaeConfig::Kl(crate::models::AutoencoderKLConfig::from_reader(c)?)))?;
            let schedule = parse(&p("scheduler"), t.scheduler, ScheduleConfig::from_reader)?;
            if unet_config.block_out_channels != inferred.unet_block_out_channels
                || unet_config.cross_attention_dim[0] != inferred.unet_cross_attention_dim
                || text_config.hidden_size != inferred.text_hidden_size
            {
                return Err(layout_err(format!(
                    "the checkpoint's shapes (UNet channels {:?}, context {}, text width {}) are not those of {}; \
                     pass the model's diffusers configs with --config DIR",
                    inferred.unet_block_out_channels, inferred.unet_cross_attention_dim, inferred.text_hidden_size, t.name
                )));
            }
            (text_config, unet_config, vae_config, schedule, builtin_tokenizer(&inferred.family))
        }
    };
    let mut stores: BTreeMap<Component, WeightStore> = [Component::TextEncoder, Component::Unet, Component::Vae]
        .into_iter()
        .map(|c| (c, WeightStore::new(path)))
        .collect();
    for m in ldm::map_keys(&tensors, &inferred).map_err(|e| layout_err(e.to_string()))? {
        if let Some(store) = stores.get_mut(&m.component) {
            store.add_mapped(m.target, &file, &m.source, m.transform)?;
        }
    }
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    SdModel::from_parts(name, path.to_path_buf(), text_config, unet_config, vae_config, schedule, tokenizer, stores)
}

fn builtin_tokenizer(family: &LdmFamily) -> ClipTokenizer {
    match family {
        LdmFamily::Sd1 => ClipTokenizer::builtin(PadToken::EndOfText),
        LdmFamily::Sd2 => ClipTokenizer::builtin(PadToken::Exclamation),
    }
}
