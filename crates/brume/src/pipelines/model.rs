//! A Stable Diffusion model on disk, opened but not loaded: configs parsed,
//! weight files mapped, and each segment loadable (and droppable) on its own.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use brume_tokenizer::{ClipTokenizer, PadToken};
use candle_core::{DType, Device, Tensor};

use crate::error::LoadError;
use crate::loading::diffusers::{open_component, ModelIndex};
use crate::loading::{Component, Segment, WeightStore};
use crate::models::config::ConfigReader;
use crate::models::{
    AutoencoderKLConfig, AutoencoderTinyConfig, ClipTextConfig, ClipTextModel, LatentDistribution, TinyDecoder,
    TinyEncoder, UNet2DConditionModel, UNetConfig, VaeDecoder, VaeEncoder,
};
use crate::samplers::{SamplerKind, ScheduleConfig};

use super::sampling_defaults::{Resolved, SamplingDefaults};

/// Which VAE the model uses.
#[derive(Debug, Clone, PartialEq)]
pub enum VaeConfig {
    Kl(AutoencoderKLConfig),
    Tiny(AutoencoderTinyConfig),
}

impl VaeConfig {
    /// Reads a VAE `config.json`, dispatching on `_class_name`.
    pub fn from_file(path: &Path) -> Result<Self, LoadError> {
        let c = ConfigReader::open(path)?;
        match c.string("_class_name")?.as_deref() {
            Some("AutoencoderTiny") => Ok(Self::Tiny(AutoencoderTinyConfig::from_reader(&c)?)),
            None | Some("AutoencoderKL") => Ok(Self::Kl(AutoencoderKLConfig::from_reader(&c)?)),
            Some(other) => Err(c.error("_class_name", format!("`{other}` is not a supported VAE"))),
        }
    }

    pub fn scaling_factor(&self) -> f64 {
        match self {
            Self::Kl(c) => c.scaling_factor,
            Self::Tiny(c) => c.scaling_factor,
        }
    }

    pub fn shift_factor(&self) -> f64 {
        match self {
            Self::Kl(c) => c.shift_factor,
            Self::Tiny(c) => c.shift_factor,
        }
    }

    pub fn latent_channels(&self) -> usize {
        match self {
            Self::Kl(c) => c.latent_channels,
            Self::Tiny(c) => c.latent_channels,
        }
    }

    /// Pixels per latent along each axis.
    pub fn scale_factor(&self) -> usize {
        match self {
            Self::Kl(c) => c.scale_factor(),
            Self::Tiny(c) => c.scale_factor(),
        }
    }

    pub fn class_name(&self) -> &'static str {
        match self {
            Self::Kl(_) => "AutoencoderKL",
            Self::Tiny(_) => "AutoencoderTiny",
        }
    }
}

/// A loaded VAE encoder of either kind.
pub enum AnyVaeEncoder {
    Kl(VaeEncoder),
    Tiny(TinyEncoder),
}

impl AnyVaeEncoder {
    /// Latents of `image` as diffusers' pipelines take them (`retrieve_latents`,
    /// sample mode): a draw from the KL VAE's distribution, using `noise`; the tiny
    /// VAE's deterministic output, drawing nothing. Unscaled.
    pub fn sample_latents(&self, image: &Tensor, noise: &mut dyn crate::samplers::NoiseSource) -> candle_core::Result<Tensor> {
        match self {
            Self::Kl(e) => {
                let dist = e.encode(image)?;
                let z = noise.randn(dist.mean.dims(), dist.mean.device())?;
                dist.sample(&z)
            }
            Self::Tiny(e) => e.encode(image),
        }
    }

    /// Images in [-1, 1] to the latent distribution (the tiny VAE's is a point).
    pub fn encode(&self, image: &Tensor) -> candle_core::Result<LatentDistribution> {
        match self {
            Self::Kl(e) => e.encode(image),
            Self::Tiny(e) => {
                let mean = e.encode(image)?;
                let logvar = (mean.zeros_like()? - 30.0)?;
                Ok(LatentDistribution { mean, logvar })
            }
        }
    }
}

/// A loaded VAE decoder of either kind.
pub enum AnyVaeDecoder {
    Kl(VaeDecoder),
    Tiny(TinyDecoder),
}

impl AnyVaeDecoder {
    /// Unscaled latents to images in [-1, 1].
    pub fn decode(&self, latents: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Kl(d) => d.decode(latents),
            Self::Tiny(d) => d.decode(latents),
        }
    }
}

/// One file of a diffusers folder compiled into the binary.
#[derive(Debug, Clone, Copy)]
pub struct EmbeddedFile {
    /// Path inside the folder, e.g. `unet/diffusion_pytorch_model.safetensors`.
    pub path: &'static str,
    pub bytes: &'static [u8],
}

/// What a model compiled into the binary is called in recipes and errors.
pub const EMBEDDED_ROOT: &str = "<built-in>";

/// Options for opening a model.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Weight variant to prefer (`fp16`), as diffusers' `variant=`.
    pub variant: Option<String>,
    /// For single-file checkpoints: a diffusers folder whose component configs
    /// (and tokenizer) describe the checkpoint, instead of the bundled SD configs.
    pub config_dir: Option<PathBuf>,
    /// The UNet subfolder to run instead of `unet/` (e.g. `unet_lcm`, a distilled
    /// UNet shipped beside the base one). Its scheduler is `scheduler_<suffix>/`
    /// when that folder exists, else `scheduler/`.
    pub unet: Option<String>,
}

/// The scheduler folder that belongs to a UNet folder: `unet_lcm` -> `scheduler_lcm`.
pub fn scheduler_folder_for(unet: &str) -> Option<String> {
    unet.strip_prefix("unet_").map(|suffix| format!("scheduler_{suffix}"))
}

/// The folder a component is read from: its own, or the chosen UNet folder.
fn component_folder(c: Component, unet_folder: &str) -> &str {
    match c {
        Component::Unet => unet_folder,
        _ => c.folder(),
    }
}

/// A UNet folder name must be a plain subfolder name: no separators, no `..`.
fn check_unet_folder(root: &Path, unet: &str) -> Result<(), LoadError> {
    let plain = !unet.is_empty() && unet != "." && unet != ".." && !unet.contains(['/', '\\']);
    if plain && unet.starts_with("unet") {
        Ok(())
    } else {
        Err(LoadError::Layout {
            path: root.to_path_buf(),
            reason: format!("`{unet}` is not a UNet subfolder name (expected `unet` or `unet_<name>`, e.g. `unet_lcm`)"),
        })
    }
}

/// An opened model: everything but the weights themselves.
pub struct SdModel {
    pub name: String,
    pub root: PathBuf,
    pub pipeline_class: Option<String>,
    pub text_config: ClipTextConfig,
    pub unet_config: UNetConfig,
    pub vae_config: VaeConfig,
    pub schedule: ScheduleConfig,
    pub tokenizer: ClipTokenizer,
    /// The UNet subfolder in use (`unet` unless [`OpenOptions::unet`] chose another).
    pub unet_folder: String,
    /// What that UNet folder recommends (its `sampling_defaults.json`; nothing for a
    /// single-file checkpoint).
    pub sampling: SamplingDefaults,
    stores: BTreeMap<Component, WeightStore>,
}

impl SdModel {
    /// Opens a diffusers folder (with `model_index.json`).
    pub fn open(path: &Path, opts: &OpenOptions) -> Result<Self, LoadError> {
        if !path.exists() {
            return Err(LoadError::NotFound {
                path: path.to_path_buf(),
                hint: " (expected a diffusers model folder or a .safetensors checkpoint)".into(),
            });
        }
        if path.is_file() {
            if let Some(unet) = &opts.unet {
                return Err(LoadError::Layout {
                    path: path.to_path_buf(),
                    reason: format!("a single-file checkpoint has one UNet; `--unet {unet}` needs a diffusers folder"),
                });
            }
            return super::single_file::open(path, opts);
        }
        let index_path = path.join("model_index.json");
        let index = if index_path.is_file() {
            Some(ModelIndex::read(&index_path)?)
        } else {
            None
        };
        if let Some(idx) = &index {
            for (component, expected) in [("unet", "UNet2DConditionModel"), ("text_encoder", "CLIPTextModel")] {
                if let Some(class) = idx.class_of(component) {
                    if class != expected {
                        return Err(LoadError::Layout {
                            path: index_path.clone(),
                            reason: format!("component `{component}` is a {class}; brume supports {expected}"),
                        });
                    }
                }
            }
        } else if !path.join("unet").is_dir() {
            return Err(LoadError::NotFound {
                path: index_path,
                hint: " (not a diffusers model folder: no model_index.json and no unet/)".into(),
            });
        }
        let variant = opts.variant.as_deref();
        let unet_folder = opts.unet.clone().unwrap_or_else(|| "unet".into());
        check_unet_folder(path, &unet_folder)?;
        if !path.join(&unet_folder).is_dir() {
            return Err(LoadError::NotFound {
                path: path.join(&unet_folder),
                hint: format!(" (this model has no UNet folder `{unet_folder}`)"),
            });
        }
        let text_config = ClipTextConfig::from_file(&path.join("text_encoder").join("config.json"))?;
        let unet_config = UNetConfig::from_file(&path.join(&unet_folder).join("config.json"))?;
        let vae_config = VaeConfig::from_file(&path.join("vae").join("config.json"))?;
        let sched_dir = scheduler_folder_for(&unet_folder)
            .filter(|d| path.join(d).is_dir())
            .unwrap_or_else(|| "scheduler".into());
        let sched_path = path.join(sched_dir).join("scheduler_config.json");
        let schedule = if sched_path.is_file() {
            ScheduleConfig::from_file(&sched_path)?
        } else {
            tracing::warn!("{} absent; using the SD 1.x training schedule", sched_path.display());
            ScheduleConfig::default()
        };
        let tok_dir = path.join("tokenizer");
        let tokenizer = if tok_dir.is_dir() {
            ClipTokenizer::from_model_dir(&tok_dir)?
        } else {
            tracing::warn!("{} absent; using the built-in CLIP vocabulary", tok_dir.display());
            ClipTokenizer::builtin(PadToken::EndOfText)
        };
        let mut stores = BTreeMap::new();
        for c in [Component::TextEncoder, Component::Unet, Component::Vae] {
            let folder = component_folder(c, &unet_folder);
            stores.insert(c, open_component(&path.join(folder), variant)?);
        }
        let mut model = Self::from_parts(
            display_name(path),
            path.to_path_buf(),
            text_config,
            unet_config,
            vae_config,
            schedule,
            tokenizer,
            stores,
        )?;
        model.pipeline_class = index.and_then(|i| i.pipeline_class);
        model.sampling = SamplingDefaults::read_dir(&path.join(&unet_folder))?;
        model.unet_folder = unet_folder;
        Ok(model)
    }

    /// Opens a diffusers folder compiled into the binary (the built-in model), so a
    /// fresh install needs no path and no files. Its weights stay in the
    /// executable's read-only pages. The tokenizer is the embedded CLIP vocabulary
    /// with SD 1.x settings.
    pub fn from_embedded(name: &str, files: &[EmbeddedFile], unet: Option<&str>) -> Result<Self, LoadError> {
        let root = PathBuf::from(EMBEDDED_ROOT);
        let unet_folder = unet.unwrap_or("unet").to_string();
        check_unet_folder(&root, &unet_folder)?;
        let has_folder = |d: &str| files.iter().any(|f| f.path.starts_with(&format!("{d}/")));
        if !has_folder(&unet_folder) {
            return Err(LoadError::NotFound {
                path: root.join(&unet_folder),
                hint: format!(" (the built-in model has no UNet folder `{unet_folder}`)"),
            });
        }
        let sched_dir = scheduler_folder_for(&unet_folder)
            .filter(|d| has_folder(d))
            .unwrap_or_else(|| "scheduler".into());
        let label = |p: &str| root.join(p);
        let text = |p: &str| -> Result<ConfigReader, LoadError> {
            let f = files.iter().find(|f| f.path == p).ok_or_else(|| LoadError::NotFound {
                path: label(p),
                hint: " (missing from the embedded model)".into(),
            })?;
            let s = std::str::from_utf8(f.bytes).map_err(|e| LoadError::Layout {
                path: label(p),
                reason: format!("not UTF-8: {e}"),
            })?;
            ConfigReader::parse(&label(p), s)
        };
        let text_config = ClipTextConfig::from_reader(&text("text_encoder/config.json")?)?;
        let unet_config = UNetConfig::from_reader(&text(&format!("{unet_folder}/config.json"))?)?;
        let vae_reader = text("vae/config.json")?;
        let vae_config = match vae_reader.string("_class_name")?.as_deref() {
            Some("AutoencoderTiny") => VaeConfig::Tiny(AutoencoderTinyConfig::from_reader(&vae_reader)?),
            _ => VaeConfig::Kl(AutoencoderKLConfig::from_reader(&vae_reader)?),
        };
        let schedule = ScheduleConfig::from_reader(&text(&format!("{sched_dir}/scheduler_config.json"))?)?;
        let mut stores = BTreeMap::new();
        for c in [Component::TextEncoder, Component::Unet, Component::Vae] {
            let folder = component_folder(c, &unet_folder);
            let mut store = WeightStore::new(label(folder));
            let prefix = format!("{folder}/");
            for f in files.iter().filter(|f| f.path.starts_with(&prefix) && f.path.ends_with(".safetensors")) {
                let file = crate::loading::safetensors::SafetensorsFile::from_static(&label(f.path), f.bytes)?;
                store.add_file(&file)?;
            }
            if store.is_empty() {
                return Err(LoadError::NotFound {
                    path: label(folder),
                    hint: " (the embedded model has no weights for it)".into(),
                });
            }
            stores.insert(c, store);
        }
        let defaults = format!("{unet_folder}/{}", super::sampling_defaults::FILE);
        let sampling = match files.iter().any(|f| f.path == defaults) {
            true => SamplingDefaults::from_reader(&text(&defaults)?)?,
            false => SamplingDefaults::default(),
        };
        let mut model = Self::from_parts(
            name.to_string(),
            root,
            text_config,
            unet_config,
            vae_config,
            schedule,
            ClipTokenizer::builtin(PadToken::EndOfText),
            stores,
        )?;
        model.sampling = sampling;
        model.unet_folder = unet_folder;
        Ok(model)
    }

    /// Assembles a model from parts already read (single-file checkpoints).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn from_parts(
        name: String,
        root: PathBuf,
        text_config: ClipTextConfig,
        unet_config: UNetConfig,
        vae_config: VaeConfig,
        schedule: ScheduleConfig,
        tokenizer: ClipTokenizer,
        stores: BTreeMap<Component, WeightStore>,
    ) -> Result<Self, LoadError> {
        let m = Self {
            name,
            root,
            pipeline_class: None,
            text_config,
            unet_config,
            vae_config,
            schedule,
            tokenizer,
            unet_folder: "unet".into(),
            sampling: SamplingDefaults::default(),
            stores,
        };
        m.check_compatible()?;
        Ok(m)
    }

    /// Cross-component agreement that no single config can check.
    fn check_compatible(&self) -> Result<(), LoadError> {
        let cross = self.unet_config.cross_attention_dim[0];
        if cross != self.text_config.hidden_size {
            return Err(LoadError::Layout {
                path: self.root.clone(),
                reason: format!(
                    "the UNet's cross_attention_dim is {cross} but the text encoder's hidden_size is {}",
                    self.text_config.hidden_size
                ),
            });
        }
        let lat = self.vae_config.latent_channels();
        let unet_out = self.unet_config.out_channels;
        if unet_out != lat {
            return Err(LoadError::Layout {
                path: self.root.clone(),
                reason: format!("the UNet predicts {unet_out} channels but the VAE has {lat} latent channels"),
            });
        }
        let unet_in = self.unet_config.in_channels;
        if unet_in != lat && unet_in != 2 * lat + 1 {
            return Err(LoadError::Layout {
                path: self.root.clone(),
                reason: format!("the UNet takes {unet_in} channels; expected {lat} or {} (inpainting)", 2 * lat + 1),
            });
        }
        Ok(())
    }

    pub fn store(&self, c: Component) -> &WeightStore {
        &self.stores[&c]
    }

    /// Bytes on disk of a segment's weights.
    pub fn segment_bytes(&self, s: Segment) -> usize {
        let (component, prefixes) = s.weights();
        self.store(component).nbytes(prefixes)
    }

    /// Hands the resident pages of a dropped segment's mapped weights back to the
    /// OS, with the freed activations the allocator kept for reuse, so sequential
    /// loading lowers RSS as well as private memory. Call only
    /// once the segment's modules are dropped (the pages would just fault back in).
    /// Weights compiled into the executable are left alone.
    pub fn release(&self, s: Segment) {
        for (name, t) in self.store(s.weights().0).iter() {
            if s.owns(name) {
                t.release_pages();
            }
        }
        // Its freed activations, kept for reuse, would not be asked for again.
        crate::runtime::memory::release_reused_blocks();
        tracing::debug!(segment = %s, "released mapped pages");
    }

    pub fn text_encoder(&self, device: &Device, dtype: DType) -> Result<ClipTextModel, LoadError> {
        ClipTextModel::load(self.store(Component::TextEncoder), &self.text_config, device, dtype)
    }

    pub fn unet(&self, device: &Device, dtype: DType) -> Result<UNet2DConditionModel, LoadError> {
        UNet2DConditionModel::load(self.store(Component::Unet), &self.unet_config, device, dtype)
    }

    pub fn vae_encoder(&self, device: &Device, dtype: DType) -> Result<AnyVaeEncoder, LoadError> {
        let store = self.store(Component::Vae);
        Ok(match &self.vae_config {
            VaeConfig::Kl(c) => AnyVaeEncoder::Kl(VaeEncoder::load(store, c, device, dtype)?),
            VaeConfig::Tiny(c) => AnyVaeEncoder::Tiny(TinyEncoder::load(store, c, device, dtype)?),
        })
    }

    pub fn vae_decoder(&self, device: &Device, dtype: DType) -> Result<AnyVaeDecoder, LoadError> {
        let store = self.store(Component::Vae);
        Ok(match &self.vae_config {
            VaeConfig::Kl(c) => AnyVaeDecoder::Kl(VaeDecoder::load(store, c, device, dtype)?),
            VaeConfig::Tiny(c) => AnyVaeDecoder::Tiny(TinyDecoder::load(store, c, device, dtype)?),
        })
    }

    /// Whether the folder is diffusers' `LatentConsistencyModelPipeline`, whose img2img
    /// applies strength differently from Stable Diffusion's (see `img2img::schedule`).
    pub fn is_lcm_pipeline(&self) -> bool {
        matches!(self.pipeline_class.as_deref(), Some("LatentConsistencyModelPipeline" | "LatentConsistencyModelImg2ImgPipeline"))
    }

    /// `choice`, else the sampler the model's own scheduler config names.
    pub fn sampler_kind(&self, choice: Option<SamplerKind>) -> Result<SamplerKind, crate::error::RunError> {
        match choice {
            Some(k) => Ok(k),
            None => SamplerKind::from_config(&self.schedule),
        }
    }

    /// Why sampler `kind` does not suit this UNet, if it does not: a few-step
    /// sampler (lcm, tcd) on a UNet that was not distilled for it gives a rough
    /// picture in its handful of steps, and an LCM-distilled UNet (one with a
    /// guidance embedding) under an ordinary sampler ignores what it was trained for.
    pub fn sampler_mismatch(&self, kind: SamplerKind) -> Option<String> {
        let distilled = self.unet_config.time_cond_proj_dim.is_some()
            || self.sampler_kind(None).map(|k| k.is_few_step()).unwrap_or(false);
        let unet = &self.unet_folder;
        match (kind.is_few_step(), distilled) {
            (true, false) => Some(format!(
                "sampler {} is made for LCM/TCD-distilled UNets, and `{unet}` is not one: expect a rough picture \
                 (use the model's own sampler, or a distilled UNet such as the built-in model's --unet unet_lcm)",
                kind.cli_name()
            )),
            (false, true) => Some(format!(
                "`{unet}` is LCM-distilled (made for 1-8 steps of lcm or tcd); sampler {} does not use what it was \
                 trained for: expect a poor picture (use --sampler lcm)",
                kind.cli_name()
            )),
            _ => None,
        }
    }

    /// Steps and guidance for a run on sampler `kind` where the request leaves them
    /// out: the UNet folder's recommendation, else the sampler family's and
    /// diffusers' defaults (see [`SamplingDefaults::resolve`]).
    pub fn sampling_settings(&self, kind: SamplerKind, steps: Option<usize>, guidance: Option<f64>) -> Result<Resolved, crate::error::RunError> {
        Ok(self.sampling.resolve(kind, self.sampler_kind(None)?, steps, guidance))
    }

    /// Default output size: the UNet's `sample_size` in pixels (512 for SD 1.5).
    pub fn default_size(&self) -> usize {
        self.unet_config.sample_size.unwrap_or(64) * self.vae_config.scale_factor()
    }
}

fn display_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}
