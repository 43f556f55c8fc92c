//! The weights of one component, by module name, however they are stored.
//!
//! A [`WeightStore`] maps the names our modules ask for (diffusers names) to
//! tensors in one or more memory-mapped safetensors files, possibly renamed and
//! viewed through a [`Transform`] (LDM single-file checkpoints). Modules read it
//! through [`Weights`], which checks every shape against what the module needs
//! and records what was used, so that leftovers are reported, not ignored.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::safetensors::{SafetensorsFile, StoredDType, TensorEntry};
use super::transform::Transform;
use crate::error::LoadError;
use crate::quantization::codec::Decoder;
use crate::quantization::format::{companion_names, validate, PrecisionTable, QuantInfo};
use crate::quantization::{QuantError, Scheme};

/// Where one module tensor's data lives.
#[derive(Debug, Clone)]
pub struct StoredTensor {
    pub file: Arc<SafetensorsFile>,
    /// The tensor's name inside `file`.
    pub source: String,
    pub entry: TensorEntry,
    pub transform: Transform,
    /// For a compressed tensor (a converted model): its scheme, logical shape and
    /// companion tensors; `entry` is then the main part (indices or int8 values).
    pub quant: Option<Arc<QuantInfo>>,
}

impl StoredTensor {
    /// The shape the module sees (after the transform).
    pub fn shape(&self) -> Vec<usize> {
        if let Some(q) = &self.quant {
            return q.shape.clone();
        }
        self.transform
            .output_shape(&self.entry.shape)
            .unwrap_or_else(|| self.entry.shape.clone())
    }

    pub fn dtype(&self) -> StoredDType {
        self.entry.dtype
    }

    /// The bytes the module sees: the whole tensor or the selected rows.
    pub fn bytes(&self) -> &[u8] {
        let all = self.file.bytes(&self.entry);
        match &self.transform {
            Transform::Identity | Transform::Reshape(_) => all,
            Transform::Rows { start, len } | Transform::RowsThenReshape { start, len, .. } => {
                let row: usize = self.entry.shape.iter().skip(1).product::<usize>() * self.entry.dtype.size();
                &all[start * row..(start + len) * row]
            }
        }
    }

    /// Stored bytes attributed to this tensor (a fused in_proj counts per slice;
    /// a compressed tensor counts its lookup tables and scales too).
    pub fn nbytes(&self) -> usize {
        let companions: usize = self.quant.iter().flat_map(|q| &q.companions).map(|e| e.end - e.start).sum();
        self.bytes().len() + companions
    }

    /// Drops this tensor's pages from the resident set (see [`SafetensorsFile::release`]).
    pub fn release_pages(&self) {
        self.file.release(self.entry.start, self.entry.end);
        for e in self.quant.iter().flat_map(|q| &q.companions) {
            self.file.release(e.start, e.end);
        }
    }

    /// The storage scheme: a compressed scheme, or the plain float dtype.
    pub fn scheme(&self) -> Option<Scheme> {
        match &self.quant {
            Some(q) => Some(q.scheme),
            None => match self.entry.dtype {
                StoredDType::F32 => Some(Scheme::F32),
                StoredDType::F16 => Some(Scheme::F16),
                StoredDType::BF16 => Some(Scheme::BF16),
                _ => None,
            },
        }
    }

    /// A decoder over the stored bytes (plain f32/f16/bf16 or compressed), or
    /// `None` for dtypes that are not weights.
    pub fn decoder(&self) -> Option<Result<Decoder<'_>, QuantError>> {
        let scheme = self.scheme()?;
        let mut parts = vec![self.bytes()];
        if let Some(q) = &self.quant {
            parts.extend(q.companions.iter().map(|e| self.file.bytes(e)));
        }
        Some(Decoder::new(scheme, &self.shape(), &parts))
    }
}

/// All tensors of one component.
#[derive(Debug, Clone, Default)]
pub struct WeightStore {
    tensors: BTreeMap<String, StoredTensor>,
    /// What to name in errors: the file, or the folder of a sharded component.
    origin: PathBuf,
}

impl WeightStore {
    pub fn new(origin: impl Into<PathBuf>) -> Self {
        Self {
            tensors: BTreeMap::new(),
            origin: origin.into(),
        }
    }

    /// Every tensor of `file` under its own name. A converted file's compressed
    /// tensors are validated against their schemes and their companion tensors
    /// (lookup tables, scales) folded into them.
    pub fn add_file(&mut self, file: &Arc<SafetensorsFile>) -> Result<(), LoadError> {
        let qerr = |tensor: &str, source: QuantError| LoadError::Quantized {
            path: file.path().to_path_buf(),
            tensor: tensor.to_string(),
            source: Box::new(source),
        };
        let table = PrecisionTable::of(file).map_err(|e| qerr(crate::quantization::format::PRECISION_KEY, e))?;
        let companions = table.as_ref().map(companion_names).unwrap_or_default();
        for (name, entry) in file.entries() {
            if companions.contains(name) {
                continue;
            }
            let (entry, quant) = match table.as_ref().and_then(|t| t.tensors.get(name)) {
                Some(ts) => {
                    let (e, q) = validate(file, name, ts).map_err(|e| qerr(name, e))?;
                    (e, q.map(Arc::new))
                }
                None => (entry.clone(), None),
            };
            if self.tensors.contains_key(name) {
                return Err(LoadError::BadTensor {
                    path: file.path().to_path_buf(),
                    tensor: name.clone(),
                    reason: "appears in more than one shard".into(),
                });
            }
            self.tensors.insert(
                name.clone(),
                StoredTensor {
                    file: file.clone(),
                    source: name.clone(),
                    entry,
                    transform: Transform::Identity,
                    quant,
                },
            );
        }
        if let Some(t) = &table {
            if let Some(name) = t.tensors.keys().find(|n| file.entry(n).is_none()) {
                return Err(qerr(name, QuantError::MissingData));
            }
        }
        Ok(())
    }

    /// One tensor under a module name, from `source` in `file`, viewed through `transform`.
    pub fn add_mapped(
        &mut self,
        target: String,
        file: &Arc<SafetensorsFile>,
        source: &str,
        transform: Transform,
    ) -> Result<(), LoadError> {
        let entry = file.entry(source).ok_or_else(|| LoadError::BadTensor {
            path: file.path().to_path_buf(),
            tensor: source.to_string(),
            reason: format!("needed for `{target}` but absent"),
        })?;
        if transform.output_shape(&entry.shape).is_none() {
            return Err(LoadError::BadTensor {
                path: file.path().to_path_buf(),
                tensor: source.to_string(),
                reason: format!("shape {:?} cannot be viewed as {transform:?} for `{target}`", entry.shape),
            });
        }
        self.tensors.insert(
            target,
            StoredTensor {
                file: file.clone(),
                source: source.to_string(),
                entry: entry.clone(),
                transform,
                quant: None,
            },
        );
        Ok(())
    }

    pub fn origin(&self) -> &Path {
        &self.origin
    }

    pub fn get(&self, name: &str) -> Option<&StoredTensor> {
        self.tensors.get(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &StoredTensor)> {
        self.tensors.iter()
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Bytes of all tensors whose name starts with one of `prefixes` (all when empty).
    pub fn nbytes(&self, prefixes: &[&str]) -> usize {
        self.tensors
            .iter()
            .filter(|(n, _)| prefixes.is_empty() || prefixes.iter().any(|p| n.starts_with(p)))
            .map(|(_, t)| t.nbytes())
            .sum()
    }

    /// Begins loading one module: tensors are read through the returned [`Weights`].
    pub fn loader(&self, module: &str, device: &Device, dtype: DType) -> Loader<'_> {
        Loader {
            store: self,
            module: module.to_string(),
            device: device.clone(),
            dtype,
            used: RefCell::new(BTreeSet::new()),
            recording: None,
            slots: std::cell::Cell::new(0),
        }
    }

    /// A loader that fabricates every tensor a module asks for (as a zero-stride
    /// view, so nothing is allocated) and records its name and shape. This is how
    /// the tensors of an architecture are listed from its config alone, e.g. to
    /// write random-weight models of real sizes.
    pub fn recorder(module: &str, device: &Device, dtype: DType) -> Loader<'static> {
        static EMPTY: std::sync::OnceLock<WeightStore> = std::sync::OnceLock::new();
        Loader {
            store: EMPTY.get_or_init(WeightStore::default),
            module: module.to_string(),
            device: device.clone(),
            dtype,
            used: RefCell::new(BTreeSet::new()),
            recording: Some(RefCell::new(Vec::new())),
            slots: std::cell::Cell::new(0),
        }
    }
}

/// State shared by all [`Weights`] views of one module load.
pub struct Loader<'a> {
    store: &'a WeightStore,
    module: String,
    device: Device,
    dtype: DType,
    used: RefCell<BTreeSet<String>>,
    recording: Option<RefCell<Vec<(String, Vec<usize>)>>>,
    slots: std::cell::Cell<usize>,
}

impl<'a> Loader<'a> {
    /// The tensors requested so far, in request order (recording loaders only).
    pub fn recorded(&self) -> Vec<(String, Vec<usize>)> {
        self.recording.as_ref().map(|r| r.borrow().clone()).unwrap_or_default()
    }

    pub fn root(&self) -> Weights<'_> {
        Weights {
            loader: self,
            prefix: String::new(),
        }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Fails if the store holds tensors under `prefixes` that no module asked for:
    /// a file for another architecture should be an error, not silently half-used.
    pub fn finish(&self, prefixes: &[&str]) -> Result<(), LoadError> {
        if self.recording.is_some() {
            return Ok(());
        }
        let used = self.used.borrow();
        let unexpected: Vec<&String> = self
            .store
            .tensors
            .keys()
            .filter(|n| prefixes.is_empty() || prefixes.iter().any(|p| n.starts_with(p)))
            .filter(|n| !used.contains(*n))
            .collect();
        if unexpected.is_empty() {
            return Ok(());
        }
        let first = self.store.tensors.get(unexpected[0].as_str());
        let path = first
            .map(|t| t.file.path().to_path_buf())
            .unwrap_or_else(|| self.store.origin.clone());
        Err(LoadError::UnexpectedTensors {
            path,
            count: unexpected.len(),
            examples: unexpected
                .iter()
                .take(5)
                .map(|s| format!("`{s}`"))
                .collect::<Vec<_>>()
                .join(", "),
            module: self.module.clone(),
        })
    }
}

/// A prefix-scoped view of a module's weights, in the spirit of candle's VarBuilder,
/// but with errors that name file, tensor and shape.
#[derive(Clone)]
pub struct Weights<'a> {
    loader: &'a Loader<'a>,
    prefix: String,
}

impl<'a> Weights<'a> {
    /// The view one level down, e.g. `w.pp("down_blocks").pp(0)`.
    pub fn pp(&self, part: impl std::fmt::Display) -> Weights<'a> {
        let prefix = if self.prefix.is_empty() {
            part.to_string()
        } else {
            format!("{}.{}", self.prefix, part)
        };
        Weights {
            loader: self.loader,
            prefix,
        }
    }

    pub fn name(&self, leaf: &str) -> String {
        if self.prefix.is_empty() {
            leaf.to_string()
        } else {
            format!("{}.{}", self.prefix, leaf)
        }
    }

    pub fn contains(&self, leaf: &str) -> bool {
        self.loader.store.tensors.contains_key(&self.name(leaf))
    }

    pub fn device(&self) -> &Device {
        &self.loader.device
    }

    pub fn dtype(&self) -> DType {
        self.loader.dtype
    }

    /// A fresh index, unique within this load: how cross-attention layers find
    /// their entry in a conditioning cache.
    pub fn next_slot(&self) -> usize {
        let s = self.loader.slots.get();
        self.loader.slots.set(s + 1);
        s
    }

    /// Whether this view belongs to a recording loader (no file behind it).
    pub fn is_recording(&self) -> bool {
        self.loader.recording.is_some()
    }

    /// Marks `leaf` as known and deliberately unused (a saved buffer such as
    /// `position_ids`), so it does not count as unexpected.
    pub fn ignore(&self, leaf: &str) {
        if self.contains(leaf) {
            self.loader.used.borrow_mut().insert(self.name(leaf));
        }
    }

    /// The stored tensor `leaf`, checked to have `shape`, not yet materialised.
    pub fn stored(&self, leaf: &str, shape: &[usize]) -> Result<&'a StoredTensor, LoadError> {
        let name = self.name(leaf);
        let store = self.loader.store;
        let Some(t) = store.tensors.get(&name) else {
            return Err(LoadError::MissingTensor {
                path: store.origin.clone(),
                tensor: name,
                expected: shape.to_vec(),
                module: self.loader.module.clone(),
            });
        };
        let found = t.shape();
        if found != shape {
            return Err(LoadError::ShapeMismatch {
                path: t.file.path().to_path_buf(),
                tensor: describe_source(&name, t),
                expected: shape.to_vec(),
                found,
                module: self.loader.module.clone(),
            });
        }
        if t.quant.is_none() && !t.dtype().is_float() {
            return Err(LoadError::DTypeMismatch {
                path: t.file.path().to_path_buf(),
                tensor: describe_source(&name, t),
                found: t.dtype().to_string(),
                module: self.loader.module.clone(),
            });
        }
        self.loader.used.borrow_mut().insert(name);
        Ok(t)
    }

    /// The tensor `leaf` as a candle tensor in the compute dtype on the compute device.
    pub fn tensor(&self, leaf: &str, shape: &[usize]) -> Result<Tensor, LoadError> {
        if let Some(rec) = &self.loader.recording {
            rec.borrow_mut().push((self.name(leaf), shape.to_vec()));
            return Tensor::zeros(1, self.loader.dtype, &self.loader.device)
                .and_then(|z| z.reshape(vec![1; shape.len()]))
                .and_then(|z| z.broadcast_as(shape))
                .map_err(|source| LoadError::Candle {
                    context: format!("recording {}", self.name(leaf)),
                    source,
                });
        }
        let t = self.stored(leaf, shape)?;
        materialize(t, shape, &self.loader.device, self.loader.dtype).map_err(|source| LoadError::Candle {
            context: format!("{} in {}", self.name(leaf), t.file.path().display()),
            source,
        })
    }

    /// `tensor` if present, `None` if absent (for optional biases).
    pub fn optional(&self, leaf: &str, shape: &[usize]) -> Result<Option<Tensor>, LoadError> {
        if self.contains(leaf) {
            self.tensor(leaf, shape).map(Some)
        } else {
            Ok(None)
        }
    }
}

fn describe_source(name: &str, t: &StoredTensor) -> String {
    if t.source == name {
        name.to_string()
    } else {
        format!("{} (stored as `{}`)", name, t.source)
    }
}

/// Decodes stored little-endian bytes into a tensor of `dtype`.
pub fn materialize(t: &StoredTensor, shape: &[usize], device: &Device, dtype: DType) -> candle_core::Result<Tensor> {
    if t.quant.is_some() {
        let values = match t.decoder() {
            Some(Ok(d)) => d.decode_all().map_err(|e| candle_core::Error::Msg(e.to_string()))?,
            Some(Err(e)) => candle_core::bail!("{e}"),
            None => candle_core::bail!("dtype {} is not a weight type", t.dtype()),
        };
        return Tensor::from_vec(values, shape, device)?.to_dtype(dtype);
    }
    let bytes = t.bytes();
    let tensor = match t.dtype() {
        StoredDType::F32 => {
            let v: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            Tensor::from_vec(v, shape, device)?
        }
        StoredDType::F16 => {
            let v: Vec<half::f16> = bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
                .collect();
            Tensor::from_vec(v, shape, device)?
        }
        StoredDType::BF16 => {
            let v: Vec<half::bf16> = bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
                .collect();
            Tensor::from_vec(v, shape, device)?
        }
        StoredDType::F64 => {
            let v: Vec<f64> = bytes
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect();
            Tensor::from_vec(v, shape, device)?
        }
        other => candle_core::bail!("dtype {other} is not a floating point type"),
    };
    if tensor.dtype() == dtype {
        Ok(tensor)
    } else {
        tensor.to_dtype(dtype)
    }
}
