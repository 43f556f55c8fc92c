//! The recipe inside every image brume writes: the widely read "parameters"
//! text (as Stable Diffusion web UIs write it) for people and other tools, and a
//! JSON chunk with everything needed to re-create the image bit for bit.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::model::SdModel;
use super::request::GenerationRequest;
use crate::error::{Result, RunError};
use crate::samplers::{RngKind, SamplerKind};

/// PNG text keyword of the JSON recipe.
pub const RECIPE_KEY: &str = "brume-recipe";
/// PNG text keyword of the human-readable parameters.
pub const PARAMETERS_KEY: &str = "parameters";

/// Which pipeline made the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Txt2img,
    Img2img,
    Inpaint,
    Outpaint,
}

/// An input file of an edit, pinned by content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputFile {
    pub path: PathBuf,
    pub sha256: String,
}

impl InputFile {
    pub fn of(path: &Path) -> Result<Self> {
        // Streamed: an input of any size hashes in constant memory.
        let mut h = Sha256::new();
        std::fs::File::open(path)
            .and_then(|mut f| std::io::copy(&mut f, &mut h))
            .map_err(|e| RunError::Invalid(format!("{}: cannot read: {e}", path.display())))?;
        // Absolute, so `--from` finds the input from any working folder (the hash
        // still pins its content wherever it is found).
        Ok(Self {
            path: std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()),
            sha256: hex(&h.finalize()),
        })
    }
}

/// Everything that determines an image.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recipe {
    pub brume_version: String,
    pub mode: Mode,
    pub prompt: String,
    pub negative_prompt: Option<String>,
    pub steps: usize,
    /// CLI name of the sampler that ran.
    pub sampler: String,
    pub guidance_scale: f64,
    pub seed: u64,
    pub rng: String,
    pub width: usize,
    pub height: usize,
    pub batch: usize,
    pub eta: f64,
    pub clip_skip: usize,
    pub model_name: String,
    pub model_path: PathBuf,
    /// First 10 hex digits of the model fingerprint (see [`model_hash`]).
    pub model_hash: String,
    /// The UNet subfolder, when not the model's default `unet/` (e.g. `unet_lcm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unet: Option<String>,
    pub strength: Option<f64>,
    pub image: Option<InputFile>,
    pub mask: Option<InputFile>,
    /// Outpainting: pixels added (left, top, right, bottom).
    pub extend: Option<[usize; 4]>,
    /// Inpainting: mask feather radius in pixels.
    pub feather: Option<usize>,
    /// The memory plan and any fallback it took (a lower resolution changes the picture).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_plan: Option<String>,
    /// `bf16` when the kernels multiplied in bf16 (`--compute bf16`); absent for f32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute: Option<String>,
}

impl Recipe {
    pub fn new(mode: Mode, req: &GenerationRequest, sampler: SamplerKind, model: &SdModel) -> Self {
        Self {
            brume_version: env!("CARGO_PKG_VERSION").to_string(),
            mode,
            prompt: req.prompt.clone(),
            negative_prompt: req.negative_prompt.clone(),
            steps: req.steps,
            sampler: sampler.cli_name().to_string(),
            guidance_scale: req.guidance_scale,
            seed: req.seed,
            rng: req.rng.cli_name().to_string(),
            width: req.width,
            height: req.height,
            batch: req.batch,
            eta: req.eta,
            clip_skip: req.clip_skip,
            model_name: model.name.clone(),
            // Absolute (when on disk) so `--from` follows it from any folder.
            model_path: std::fs::canonicalize(&model.root).unwrap_or_else(|_| model.root.clone()),
            model_hash: model_hash(model),
            unet: (model.unet_folder != "unet").then(|| model.unet_folder.clone()),
            strength: None,
            image: None,
            mask: None,
            extend: None,
            feather: None,
            memory_plan: None,
            compute: match crate::kernels::compute() {
                crate::kernels::Compute::F32 => None,
                c => Some(c.name().to_string()),
            },
        }
    }

    /// The request this recipe describes.
    pub fn request(&self) -> Result<GenerationRequest> {
        Ok(GenerationRequest {
            prompt: self.prompt.clone(),
            negative_prompt: self.negative_prompt.clone(),
            steps: self.steps,
            guidance_scale: self.guidance_scale,
            width: self.width,
            height: self.height,
            seed: self.seed,
            rng: RngKind::parse(&self.rng)?,
            eta: self.eta,
            clip_skip: self.clip_skip,
            sampler: Some(SamplerKind::parse(&self.sampler)?),
            batch: self.batch,
        })
    }

    /// The "parameters" text: prompt, negative prompt, then `Key: value` pairs.
    pub fn parameters_text(&self) -> String {
        let mut s = self.prompt.clone();
        if let Some(n) = self.negative_prompt.as_deref().filter(|n| !n.is_empty()) {
            s.push_str(&format!("\nNegative prompt: {n}"));
        }
        s.push_str(&format!(
            "\nSteps: {}, Sampler: {}, CFG scale: {}, Seed: {}, Size: {}x{}, Model hash: {}, Model: {}",
            self.steps, self.sampler, self.guidance_scale, self.seed, self.width, self.height, self.model_hash, self.model_name
        ));
        if let Some(unet) = &self.unet {
            s.push_str(&format!(", UNet: {unet}"));
        }
        if let Some(st) = self.strength {
            s.push_str(&format!(", Denoising strength: {st}"));
        }
        if self.clip_skip > 0 {
            s.push_str(&format!(", Clip skip: {}", self.clip_skip + 1));
        }
        if let Some(c) = &self.compute {
            s.push_str(&format!(", Compute: {c}"));
        }
        s.push_str(&format!(", RNG: {}, Mode: {:?}", self.rng, self.mode));
        s
    }
}

/// The model fingerprint: SHA-256 over every config that shapes a picture
/// (text encoder, UNet, VAE, the scheduler's raw fields, the UNet folder's
/// sampling defaults and which UNet folder it is) and over each weight file's
/// name, length and full contents. Any change to a weight or a config changes
/// it; moving or copying the model does not. Hashing the contents reads every
/// weight byte once (seconds for an SD 1.5 UNet), so each file's digest is
/// kept for the process, keyed by its path, length and modification time, and
/// files over 64 MiB keep it on disk between runs (see `disk_cache_entry`).
pub fn model_hash(model: &SdModel) -> String {
    let mut h = Sha256::new();
    let schedule = serde_json::to_string(&model.schedule.raw).unwrap_or_default();
    let parts = [
        format!("{:?}", model.text_config),
        format!("{:?}", model.unet_config),
        format!("{:?}", model.vae_config),
        schedule,
        format!("{:?}", model.sampling),
        model.unet_folder.clone(),
        model.tokenizer.vocab_size().to_string(),
    ];
    for part in &parts {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    let mut files: Vec<&std::sync::Arc<crate::loading::safetensors::SafetensorsFile>> = Vec::new();
    for c in [crate::loading::Component::TextEncoder, crate::loading::Component::Unet, crate::loading::Component::Vae] {
        for (_, t) in model.store(c).iter() {
            if !files.iter().any(|f| std::sync::Arc::ptr_eq(f, &t.file)) {
                files.push(&t.file);
            }
        }
    }
    for f in files {
        let raw = f.raw();
        h.update(f.path().file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default().as_bytes());
        h.update((raw.len() as u64).to_le_bytes());
        h.update(content_digest(f.path(), raw));
    }
    hex(&h.finalize())[..10].to_string()
}

/// SHA-256 of a weight file's bytes, remembered for the process.
fn content_digest(path: &Path, raw: &[u8]) -> [u8; 32] {
    use std::collections::HashMap;
    use std::sync::Mutex;
    type Key = (PathBuf, u64, Option<std::time::SystemTime>);
    static CACHE: Mutex<Option<HashMap<Key, [u8; 32]>>> = Mutex::new(None);
    let mtime = std::fs::metadata(path).ok().and_then(|m| m.modified().ok());
    let key = (path.to_path_buf(), raw.len() as u64, mtime);
    // Only files on disk with a modification time are cached (embedded ones are small).
    if mtime.is_some() {
        if let Some(d) = CACHE.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashMap::new).get(&key) {
            return *d;
        }
    }
    let disk = mtime.and_then(|m| disk_cache_entry(path, raw.len() as u64, m));
    if let Some(d) = disk.as_ref().and_then(|p| std::fs::read_to_string(p).ok()).and_then(|t| unhex32(t.trim())) {
        CACHE.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashMap::new).insert(key, d);
        return d;
    }
    // Read through a small buffer, not through the mapping: hashing must not
    // make the whole model resident in this process (the memory plans count it).
    let from_file: Option<[u8; 32]> = mtime
        .and_then(|_| {
            std::fs::File::open(path)
                .and_then(|mut f| {
                    let mut h = Sha256::new();
                    let n = std::io::copy(&mut f, &mut h)?;
                    Ok((n, h))
                })
                .ok()
        })
        .filter(|(n, _)| *n == raw.len() as u64)
        .map(|(_, h)| h.finalize().into());
    let digest: [u8; 32] = match from_file {
        Some(d) => d,
        None => Sha256::digest(raw).into(),
    };
    if mtime.is_some() {
        CACHE.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashMap::new).insert(key, digest);
    }
    if let (Some(p), true) = (disk, from_file.is_some()) {
        // Best effort: a cache that cannot be written only costs the next run a re-hash.
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = crate::output::Output::new(&p, true).write_bytes(hex(&digest).as_bytes());
    }
    digest
}

/// Files at least this large keep their digest on disk between runs (hashing
/// an SD 1.5 UNet takes seconds); smaller ones are hashed every time.
const DISK_CACHE_MIN_BYTES: u64 = 64 << 20;

/// Where a large weight file's digest is kept: `$BRUME_CACHE_DIR` (else
/// `$XDG_CACHE_HOME/brume`, else `~/.cache/brume`) `/digests/`, named by the
/// file's absolute path, length, modification time and inode, so any change
/// to the file (which rewrites its mtime) looks up a fresh entry.
fn disk_cache_entry(path: &Path, len: u64, mtime: std::time::SystemTime) -> Option<PathBuf> {
    if len < DISK_CACHE_MIN_BYTES {
        return None;
    }
    let root = std::env::var_os("BRUME_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("brume")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/brume")))?;
    let canon = std::fs::canonicalize(path).ok()?;
    let nanos = mtime.duration_since(std::time::UNIX_EPOCH).ok()?.as_nanos();
    #[cfg(unix)]
    let ino = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&canon).ok()?.ino()
    };
    #[cfg(not(unix))]
    let ino = 0u64;
    let mut h = Sha256::new();
    h.update(canon.to_string_lossy().as_bytes());
    h.update(len.to_le_bytes());
    h.update(nanos.to_le_bytes());
    h.update(ino.to_le_bytes());
    Some(root.join("digests").join(hex(&h.finalize())))
}

fn unhex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Encodes an RGB image as PNG with the recipe's two text chunks.
pub fn encode_png(img: &image::RgbImage, recipe: Option<&Recipe>) -> Result<Vec<u8>> {
    let mut buf = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut buf, img.width(), img.height());
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let err = |e: png::EncodingError| RunError::Invalid(format!("PNG encoding failed: {e}"));
        if let Some(r) = recipe {
            let json = serde_json::to_string(r).map_err(|e| RunError::Invalid(e.to_string()))?;
            enc.add_itxt_chunk(PARAMETERS_KEY.into(), r.parameters_text()).map_err(err)?;
            enc.add_itxt_chunk(RECIPE_KEY.into(), json).map_err(err)?;
        }
        let mut w = enc.write_header().map_err(err)?;
        w.write_image_data(img.as_raw()).map_err(err)?;
        w.finish().map_err(err)?;
    }
    Ok(buf)
}

/// Most bytes of text metadata read from one PNG, raw and inflated together
/// (brume's own recipe is a few KB; other tools' workflows rarely pass 1 MB).
/// A small file whose compressed chunk inflates to gigabytes stops here.
pub const MAX_PNG_TEXT_BYTES: usize = 8 << 20;

/// The text chunks of a PNG, by keyword (tEXt, zTXt and iTXt), within
/// [`MAX_PNG_TEXT_BYTES`]: raw chunks count against the png decoder's limit
/// and each compressed one is inflated with a bound, so memory stays near that
/// figure whatever the file claims.
pub fn read_png_text(path: &Path) -> Result<Vec<(String, String)>> {
    let file = std::fs::File::open(path).map_err(|e| RunError::Invalid(format!("{}: cannot open: {e}", path.display())))?;
    read_png_text_from(std::io::BufReader::new(file), &path.display().to_string())
}

/// [`read_png_text`] over any reader; `name` names the source in errors.
pub fn read_png_text_from<R: std::io::BufRead + std::io::Seek>(reader: R, name: &str) -> Result<Vec<(String, String)>> {
    let mut decoder = png::Decoder::new(reader);
    decoder.set_limits(png::Limits { bytes: MAX_PNG_TEXT_BYTES });
    let reader = decoder.read_info().map_err(|e| match e {
        png::DecodingError::LimitsExceeded => RunError::Invalid(format!(
            "{name}: its metadata is over {} MiB; brume reads at most that much",
            MAX_PNG_TEXT_BYTES >> 20
        )),
        e => RunError::Invalid(format!("{name}: not a readable PNG: {e}")),
    })?;
    let info = reader.info();
    let mut out = Vec::new();
    // Inflated text so far counts against the bound, so many chunks cannot add up past it.
    let budget_left = |out: &Vec<(String, String)>| MAX_PNG_TEXT_BYTES.saturating_sub(out.iter().map(|(_, v)| v.len()).sum());
    let take = |keyword: &str, text: String, out: &mut Vec<(String, String)>| {
        out.push((keyword.to_string(), text));
    };
    for t in &info.uncompressed_latin1_text {
        take(&t.keyword, t.text.clone(), &mut out);
    }
    for t in &info.compressed_latin1_text {
        let mut t = t.clone();
        t.decompress_text_with_limit(budget_left(&out)).map_err(|e| too_big(name, &t.keyword, e))?;
        if let Ok(text) = t.get_text() {
            take(&t.keyword, text, &mut out);
        }
    }
    for t in &info.utf8_text {
        let mut t = t.clone();
        t.decompress_text_with_limit(budget_left(&out)).map_err(|e| too_big(name, &t.keyword, e))?;
        if let Ok(text) = t.get_text() {
            take(&t.keyword, text, &mut out);
        }
    }
    Ok(out)
}

fn too_big(name: &str, keyword: &str, e: png::DecodingError) -> RunError {
    let keyword = crate::output::escape_control(keyword);
    // The png crate's text error type is private: its message tells the two cases apart.
    if e.to_string().contains("decompression space") {
        RunError::Invalid(format!(
            "{name}: text chunk `{keyword}` inflates to more than brume reads ({} MiB of metadata in all); it is refused",
            MAX_PNG_TEXT_BYTES >> 20
        ))
    } else {
        RunError::Invalid(format!("{name}: text chunk `{keyword}` is not valid compressed text: {e}"))
    }
}

/// The brume recipe stored in a PNG, if any.
pub fn read_recipe(path: &Path) -> Result<Option<Recipe>> {
    for (k, v) in read_png_text(path)? {
        if k == RECIPE_KEY {
            return serde_json::from_str(&v)
                .map(Some)
                .map_err(|e| RunError::Invalid(format!("{}: the {RECIPE_KEY} chunk is not a valid recipe: {e}", path.display())));
        }
    }
    Ok(None)
}
