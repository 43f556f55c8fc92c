//! `brume convert`: a model rewritten under a precision policy, as a diffusers
//! folder that loads like any other.
//!
//! Layout of the output: the source's configs, tokenizer and scheduler copied;
//! `text_encoder/model.safetensors`, `unet/diffusion_pytorch_model.safetensors`,
//! and the VAE as two shards (`vae/vae_encoder.safetensors`,
//! `vae/vae_decoder.safetensors`) under an ordinary sharded index, so each of the
//! four segments is its own file; `brume_precision.json` records the source's
//! fingerprint, the policy and the bytes per segment.
//!
//! Conversion streams: each file's header is computed from the schemes and
//! shapes alone, then tensors are read, encoded and written one at a time, so
//! memory stays near one tensor (a few hundred MB for a real SD 1.5 UNet)
//! whatever the model size. Everything is written into a temporary sibling
//! folder that is renamed into place only when complete (by the output rule
//! for folders, [`crate::output::OutputDir`]); an error or a cancel removes it.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use serde::Serialize;

use super::codec::encode;
use super::format::{PrecisionTable, TensorScheme, POLICY_KEY, PRECISION_KEY, SOURCE_HASH_KEY};
use super::policy::Policy;
use super::scheme::Scheme;
use crate::error::{Result, RunError};
use crate::loading::safetensors::StoredDType;
use crate::loading::{Component, Segment, StoredTensor};
use crate::pipelines::{EmbeddedFile, SdModel};

/// Name of the record written at the root of a converted model.
pub const RECORD_FILE: &str = "brume_precision.json";

/// Where the non-weight files (configs, tokenizer, scheduler) come from.
pub enum ConfigSource<'a> {
    /// A diffusers folder: everything but weight files is copied.
    Folder(&'a Path),
    /// A model compiled into the executable.
    Embedded(&'a [EmbeddedFile]),
}

/// What was written.
#[derive(Debug, Clone, Serialize)]
pub struct ConvertRecord {
    pub source: String,
    pub source_hash: String,
    pub policy: String,
    pub policy_text: String,
    /// Stored bytes per segment (text_encoder, vae_encoder, unet, vae_decoder).
    pub segment_bytes: BTreeMap<String, u64>,
    /// Tensors per scheme.
    pub schemes: BTreeMap<String, usize>,
}

fn write_err(path: &Path) -> impl Fn(std::io::Error) -> RunError + '_ {
    move |source| RunError::Write {
        path: path.to_path_buf(),
        source,
    }
}

/// The file a tensor of `component` goes to (relative to the output folder), and
/// its segment. The UNet keeps the subfolder it was opened from (`unet`, `unet_lcm`).
fn destination(component: Component, name: &str, unet_folder: &str) -> (String, Segment) {
    match component {
        Component::TextEncoder => ("text_encoder/model.safetensors".into(), Segment::TextEncoder),
        Component::Unet => (format!("{unet_folder}/diffusion_pytorch_model.safetensors"), Segment::Unet),
        Component::Vae if Segment::VaeEncoder.owns(name) => {
            ("vae/vae_encoder.safetensors".into(), Segment::VaeEncoder)
        }
        Component::Vae => ("vae/vae_decoder.safetensors".into(), Segment::VaeDecoder),
    }
}

/// A stable per-tensor seed for k-means (FNV-1a of the name).
fn seed_of(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Refuses outputs that are, contain or lie inside the input, then applies the
/// output rule for folders ([`crate::output::OutputDir::check`]).
fn check_paths(input: Option<&Path>, out: &Path, force: bool) -> Result<()> {
    if let Some(input) = input {
        let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        let (i, o) = (canon(input), canon(out));
        // A not-yet-existing OUT canonicalises through its parent.
        let o = if out.exists() {
            o
        } else {
            match (
                out.parent().filter(|p| !p.as_os_str().is_empty()),
                out.file_name(),
            ) {
                (Some(parent), Some(name)) => canon(parent).join(name),
                (None, Some(name)) => canon(Path::new(".")).join(name),
                _ => o,
            }
        };
        if i == o || i.starts_with(&o) || o.starts_with(&i) {
            return Err(RunError::Invalid(format!(
                "--out {} would overwrite or nest inside the input model {}; choose a folder outside it",
                out.display(),
                input.display()
            )));
        }
    }
    if out.file_name().is_none() {
        return Err(RunError::Invalid(format!("--out {} must name a new folder", out.display())));
    }
    crate::output::OutputDir::new(out, force).check(is_conversion).map_err(|e| match e {
        crate::output::OutputError::Exists { .. } if force => RunError::Invalid(format!(
            "{} already exists and is not a model brume converted; --force replaces only a converted model \
             (one holding {RECORD_FILE}), never another folder",
            out.display()
        )),
        crate::output::OutputError::Exists { .. } => RunError::Invalid(format!(
            "{} already exists; pass --force to replace it (only if it is a model brume converted)",
            out.display()
        )),
        e => e.into(),
    })
}

/// A folder `convert` wrote (it holds the record), which `--force` may replace.
fn is_conversion(p: &Path) -> bool {
    std::fs::symlink_metadata(p.join(RECORD_FILE)).map(|m| m.file_type().is_file()).unwrap_or(false)
}

/// Converts `model` under `policy` into the new folder `out`. `input` is the
/// source's path on disk (None for a built-in model), used to refuse overwriting it.
pub fn convert(
    model: &SdModel,
    configs: ConfigSource<'_>,
    input: Option<&Path>,
    policy: &Policy,
    out: &Path,
    force: bool,
) -> Result<ConvertRecord> {
    convert_with(model, &[], configs, input, policy, out, force, &|| false)
}

/// [`convert`], also converting `extra_unets` (the same model opened on its
/// other UNet folders, e.g. the built-in model's `unet_lcm`) so the copy keeps
/// every UNet of the original, and checking `cancelled` between tensors (a
/// cancel returns [`RunError::Cancelled`]). The folder is built in a temporary
/// sibling that any error or cancel removes; with `force`, only a previous
/// conversion is replaced, and only when the new one rewrites every file it held.
#[allow(clippy::too_many_arguments)]
pub fn convert_with(
    model: &SdModel,
    extra_unets: &[&SdModel],
    configs: ConfigSource<'_>,
    input: Option<&Path>,
    policy: &Policy,
    out: &Path,
    force: bool,
    cancelled: &dyn Fn() -> bool,
) -> Result<ConvertRecord> {
    check_paths(input, out, force)?;
    let target = crate::output::OutputDir::new(out, force);
    let tmp = target.temp()?;
    let record = write_all(model, extra_unets, configs, policy, tmp.path(), cancelled)?;
    if cancelled() {
        return Err(RunError::Cancelled);
    }
    target.commit(tmp, is_conversion).map_err(|e| match e {
        crate::output::OutputError::Exists { .. } => RunError::Invalid(format!(
            "{} appeared while converting and is left alone; nothing was written (run again with another --out)",
            out.display()
        )),
        e => e.into(),
    })?;
    Ok(record)
}

fn copy_configs(configs: ConfigSource<'_>, dir: &Path, unet_folders: &[&str]) -> Result<()> {
    let is_weights = |p: &str| {
        p.ends_with(".safetensors")
            || p.contains(".safetensors.index")
            || [".bin", ".ckpt", ".pt", ".pth"]
                .iter()
                .any(|e| p.ends_with(e))
    };
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    match configs {
        ConfigSource::Embedded(list) => {
            for f in list.iter().filter(|f| !is_weights(f.path)) {
                files.push((f.path.to_string(), f.bytes.to_vec()));
            }
        }
        ConfigSource::Folder(root) => {
            let mut wanted = vec!["model_index.json".to_string()];
            let mut subs: Vec<String> = ["text_encoder", "vae", "scheduler", "tokenizer"].iter().map(|s| s.to_string()).collect();
            for u in unet_folders {
                subs.push(u.to_string());
                subs.extend(crate::pipelines::scheduler_folder_for(u));
            }
            for sub in &subs {
                let Ok(rd) = std::fs::read_dir(root.join(sub)) else {
                    continue;
                };
                for e in rd.flatten() {
                    let n = e.file_name().to_string_lossy().into_owned();
                    if e.path().is_file() && !is_weights(&n) && !n.starts_with('.') {
                        wanted.push(format!("{sub}/{n}"));
                    }
                }
            }
            for rel in wanted {
                let src = root.join(&rel);
                if src.is_file() {
                    let bytes = std::fs::read(&src).map_err(|source| RunError::Write {
                        path: src.clone(),
                        source,
                    })?;
                    files.push((rel, bytes));
                }
            }
        }
    }
    for (rel, bytes) in files {
        let p = dir.join(&rel);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).map_err(write_err(parent))?;
        }
        std::fs::write(&p, bytes).map_err(write_err(&p))?;
    }
    Ok(())
}

/// One tensor's planned place in an output file.
struct Planned<'a> {
    name: String,
    stored: &'a StoredTensor,
    scheme: Scheme,
    shape: Vec<usize>,
    /// Absolute file offset of each part, in `scheme.parts()` order.
    offsets: Vec<u64>,
}

fn write_all(
    model: &SdModel,
    extra_unets: &[&SdModel],
    configs: ConfigSource<'_>,
    policy: &Policy,
    dir: &Path,
    cancelled: &dyn Fn() -> bool,
) -> Result<ConvertRecord> {
    std::fs::create_dir_all(dir).map_err(write_err(dir))?;
    let unet_folders: Vec<&str> = std::iter::once(model.unet_folder.as_str())
        .chain(extra_unets.iter().map(|m| m.unet_folder.as_str()))
        .collect();
    copy_configs(configs, dir, &unet_folders)?;
    let source_hash = crate::pipelines::recipe::model_hash(model);
    let policy_text = policy.to_text();
    let mut record = ConvertRecord {
        source: model.name.clone(),
        source_hash: source_hash.clone(),
        policy: policy.name.clone(),
        policy_text: policy_text.clone(),
        segment_bytes: BTreeMap::new(),
        schemes: BTreeMap::new(),
    };
    // Group every tensor by destination file.
    type Group<'m> = (Segment, Component, Vec<(String, &'m StoredTensor)>);
    let mut files: BTreeMap<String, Group> = BTreeMap::new();
    for c in [Component::TextEncoder, Component::Unet, Component::Vae] {
        for (name, t) in model.store(c).iter() {
            let (file, seg) = destination(c, name, &model.unet_folder);
            files.entry(file).or_insert((seg, c, Vec::new())).2.push((name.clone(), t));
        }
    }
    // The other UNet folders: their own file each, counted apart from the
    // segments (which describe the model as it runs, with one UNet).
    let mut extra_files = std::collections::BTreeSet::new();
    for m in extra_unets.iter().filter(|m| m.unet_folder != model.unet_folder) {
        for (name, t) in m.store(Component::Unet).iter() {
            let (file, seg) = destination(Component::Unet, name, &m.unet_folder);
            extra_files.insert(file.clone());
            files.entry(file).or_insert((seg, Component::Unet, Vec::new())).2.push((name.clone(), t));
        }
    }
    let mut vae_map = serde_json::Map::new();
    for (rel, (segment, comp, tensors)) in &files {
        // Policies name tensors by component (`unet/...`) whichever UNet subfolder it is.
        let component = comp.folder();
        let mut planned: Vec<Planned> = tensors
            .iter()
            .map(|(name, t)| {
                let shape = t.shape();
                let scheme = policy.scheme_for(&format!("{component}/{name}"), &shape);
                Planned {
                    name: name.clone(),
                    stored: t,
                    scheme,
                    shape,
                    offsets: Vec::new(),
                }
            })
            .collect();
        let bytes = write_file(&dir.join(rel), &mut planned, &source_hash, &policy_text, cancelled)?;
        if !extra_files.contains(rel) {
            *record
                .segment_bytes
                .entry(segment.name().to_string())
                .or_default() += bytes;
        }
        for p in &planned {
            *record.schemes.entry(p.scheme.to_string()).or_default() += 1;
            if component == "vae" {
                let shard = rel.rsplit('/').next().unwrap_or(rel);
                for part in p.scheme.parts(&p.shape) {
                    vae_map.insert(
                        format!("{}{}", p.name, part.suffix),
                        serde_json::Value::from(shard),
                    );
                }
            }
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": record.segment_bytes.get("vae_encoder").copied().unwrap_or(0) + record.segment_bytes.get("vae_decoder").copied().unwrap_or(0)}, "weight_map": vae_map});
    let index_path = dir.join("vae/diffusion_pytorch_model.safetensors.index.json");
    std::fs::write(
        &index_path,
        serde_json::to_vec_pretty(&index).unwrap_or_default(),
    )
    .map_err(write_err(&index_path))?;
    let rec_path = dir.join(RECORD_FILE);
    std::fs::write(
        &rec_path,
        serde_json::to_vec_pretty(&record).unwrap_or_default(),
    )
    .map_err(write_err(&rec_path))?;
    Ok(record)
}

/// Writes one safetensors file: header first (sizes follow from the schemes),
/// then each tensor encoded and written at its offsets. Parts are laid out by
/// element size (4-byte, then 2-byte, then 1-byte) so every f32 and f16 part is
/// aligned in the mapping. Returns the bytes of tensor data written.
fn write_file(
    path: &Path,
    planned: &mut [Planned],
    source_hash: &str,
    policy_text: &str,
    cancelled: &dyn Fn() -> bool,
) -> Result<u64> {
    let mut table = PrecisionTable::new();
    let mut header = serde_json::Map::new();
    let mut layout: Vec<(usize, usize, StoredDType, Vec<usize>, String)> = Vec::new(); // (tensor, part, dtype, shape, name)
    for (ti, p) in planned.iter().enumerate() {
        table.tensors.insert(
            p.name.clone(),
            TensorScheme {
                scheme: p.scheme.to_string(),
                shape: p.shape.clone(),
            },
        );
        for (pi, part) in p.scheme.parts(&p.shape).into_iter().enumerate() {
            layout.push((
                ti,
                pi,
                part.dtype,
                part.shape,
                format!("{}{}", p.name, part.suffix),
            ));
        }
    }
    layout.sort_by_key(|(ti, pi, dtype, _, _)| (std::cmp::Reverse(dtype.size()), *ti, *pi));
    let mut offset = 0u64;
    let mut rel_offsets = vec![Vec::new(); planned.len()];
    for (ti, pi, dtype, shape, name) in &layout {
        let n = shape.iter().product::<usize>() as u64 * dtype.size() as u64;
        header.insert(name.clone(), serde_json::json!({"dtype": dtype.name(), "shape": shape, "data_offsets": [offset, offset + n]}));
        let v: &mut Vec<(usize, u64)> = &mut rel_offsets[*ti];
        v.push((*pi, offset));
        offset += n;
    }
    header.insert(
        "__metadata__".into(),
        serde_json::json!({"format": "pt", PRECISION_KEY: table.to_json(), SOURCE_HASH_KEY: source_hash, POLICY_KEY: policy_text}),
    );
    let mut header_bytes = serde_json::to_vec(&serde_json::Value::Object(header))
        .map_err(|e| RunError::Invalid(e.to_string()))?;
    while (header_bytes.len() + 8) % 8 != 0 {
        header_bytes.push(b' ');
    }
    let data_start = 8 + header_bytes.len() as u64;
    for (p, mut offs) in planned.iter_mut().zip(rel_offsets) {
        offs.sort();
        p.offsets = offs.into_iter().map(|(_, o)| data_start + o).collect();
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(write_err(parent))?;
    }
    let mut f = File::create(path).map_err(write_err(path))?;
    f.write_all(&(header_bytes.len() as u64).to_le_bytes())
        .map_err(write_err(path))?;
    f.write_all(&header_bytes).map_err(write_err(path))?;
    f.set_len(data_start + offset).map_err(write_err(path))?;
    for p in planned.iter() {
        if cancelled() {
            return Err(RunError::Cancelled);
        }
        let values = crate::loading::store::materialize(
            p.stored,
            &p.shape,
            &candle_core::Device::Cpu,
            candle_core::DType::F32,
        )
        .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
        .map_err(|e| {
            RunError::Invalid(format!(
                "{}: reading `{}`: {e}",
                p.stored.file.path().display(),
                p.name
            ))
        })?;
        let parts = encode(p.scheme, &values, &p.shape, seed_of(&p.name)).map_err(|e| {
            RunError::Invalid(format!(
                "{}: `{}` as {}: {e}",
                p.stored.file.path().display(),
                p.name,
                p.scheme
            ))
        })?;
        drop(values);
        p.stored.release_pages();
        for (bytes, off) in parts.iter().zip(&p.offsets) {
            f.seek(SeekFrom::Start(*off)).map_err(write_err(path))?;
            f.write_all(bytes).map_err(write_err(path))?;
        }
        tracing::debug!(tensor = %p.name, scheme = %p.scheme, "converted");
    }
    f.sync_all().map_err(write_err(path))?;
    Ok(offset)
}

/// The record of a converted model folder, if `root` is one.
pub fn read_record(root: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(root.join(RECORD_FILE)).ok()?;
    serde_json::from_str(&text).ok()
}
