//! A validating, memory-mapped reader of the safetensors format.
//!
//! We parse the header ourselves rather than through a crate so that every way a
//! file can be wrong (truncated, a header length or offset pointing outside the
//! file, sizes that disagree with the shape, a pickle in disguise) becomes a
//! [`LoadError`] naming the file and the tensor. The data section is mapped, not
//! read: weights cost page cache, not private memory, until a layer touches them.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use serde_json::Value;

use crate::error::LoadError;

/// Largest header we accept: real headers are well under 1 MB (SD 1.5 UNet: ~140 KB).
const MAX_HEADER: u64 = 100 * 1024 * 1024;

/// Element types that can appear in a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoredDType {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl StoredDType {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "F64" => Self::F64,
            "F32" => Self::F32,
            "F16" => Self::F16,
            "BF16" => Self::BF16,
            "I64" => Self::I64,
            "I32" => Self::I32,
            "I16" => Self::I16,
            "I8" => Self::I8,
            "U8" => Self::U8,
            "BOOL" => Self::Bool,
            _ => return None,
        })
    }

    pub fn size(self) -> usize {
        match self {
            Self::F64 | Self::I64 => 8,
            Self::F32 | Self::I32 => 4,
            Self::F16 | Self::BF16 | Self::I16 => 2,
            Self::I8 | Self::U8 | Self::Bool => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F64 => "F64",
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::I64 => "I64",
            Self::I32 => "I32",
            Self::I16 => "I16",
            Self::I8 => "I8",
            Self::U8 => "U8",
            Self::Bool => "BOOL",
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, Self::F64 | Self::F32 | Self::F16 | Self::BF16)
    }
}

impl std::fmt::Display for StoredDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor's place in a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    pub dtype: StoredDType,
    pub shape: Vec<usize>,
    /// Byte range within the whole file (header included), validated to lie inside it.
    pub start: usize,
    pub end: usize,
}

impl TensorEntry {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Where a file's bytes live.
#[derive(Debug)]
enum Backing {
    Mapped(Mmap),
    Static(&'static [u8]),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => m,
            Backing::Static(b) => b,
        }
    }
}

/// An open, validated, memory-mapped safetensors file.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    backing: Backing,
    entries: BTreeMap<String, TensorEntry>,
    metadata: BTreeMap<String, String>,
}

/// Refuses pickle-based checkpoints before anything else looks at them.
fn check_not_pickle(path: &Path, head: &[u8]) -> Result<(), LoadError> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    let kind = if head.starts_with(b"PK\x03\x04") {
        Some("a zip archive holding a pickle, as torch.save writes")
    } else if head.first() == Some(&0x80) && head.get(1).is_some_and(|p| (2..=5).contains(p)) {
        Some("a raw pickle stream")
    } else if matches!(ext.as_str(), "ckpt" | "pt" | "pth" | "bin" | "pkl") {
        Some("by its extension")
    } else {
        None
    };
    match kind {
        Some(kind) => Err(LoadError::Pickle {
            path: path.to_path_buf(),
            kind,
        }),
        None => Ok(()),
    }
}

impl SafetensorsFile {
    /// Opens and validates `path`. Nothing but the header is read.
    pub fn open(path: &Path) -> Result<Arc<Self>, LoadError> {
        let io = |source| LoadError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = File::open(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                LoadError::NotFound {
                    path: path.to_path_buf(),
                    hint: String::new(),
                }
            } else {
                io(e)
            }
        })?;
        let len = file.metadata().map_err(io)?.len();
        let mut head = [0u8; 8];
        let got = read_up_to(&mut file, &mut head).map_err(io)?;
        check_not_pickle(path, &head[..got])?;
        if len < 8 {
            return Err(LoadError::Truncated {
                path: path.to_path_buf(),
                len,
                needed: 8,
                what: "the 8-byte header length".into(),
            });
        }
        // SAFETY: the map is read-only. Like every mmap-based loader we rely on the
        // file not being truncated by another process while it is open; all offsets
        // are validated against the length seen now.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(path, Backing::Mapped(mmap))
    }

    /// Validates safetensors bytes compiled into the binary (the built-in model):
    /// they are read-only pages of the executable, clean and evictable like a mapping.
    pub fn from_static(label: &Path, bytes: &'static [u8]) -> Result<Arc<Self>, LoadError> {
        check_not_pickle(label, &bytes[..bytes.len().min(8)])?;
        Self::parse(label, Backing::Static(bytes))
    }

    fn parse(path: &Path, backing: Backing) -> Result<Arc<Self>, LoadError> {
        let bytes = backing.bytes();
        let len = bytes.len() as u64;
        if len < 8 {
            return Err(LoadError::Truncated {
                path: path.to_path_buf(),
                len,
                needed: 8,
                what: "the 8-byte header length".into(),
            });
        }
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap_or([0; 8]));
        if header_len > MAX_HEADER {
            return Err(LoadError::BadHeader {
                path: path.to_path_buf(),
                reason: format!(
                    "declared header length {header_len} bytes is implausible (limit {MAX_HEADER}); \
                     this is not a safetensors file or it is corrupt"
                ),
            });
        }
        let data_start = 8 + header_len;
        if data_start > len {
            return Err(LoadError::Truncated {
                path: path.to_path_buf(),
                len,
                needed: data_start,
                what: format!("a header of {header_len} bytes"),
            });
        }
        let header_bytes = &bytes[8..data_start as usize];
        let header: Value = serde_json::from_slice(header_bytes).map_err(|e| LoadError::BadHeader {
            path: path.to_path_buf(),
            reason: format!("header is not valid JSON: {e}"),
        })?;
        let Value::Object(map) = header else {
            return Err(LoadError::BadHeader {
                path: path.to_path_buf(),
                reason: "header is not a JSON object".into(),
            });
        };
        let data_len = len - data_start;
        let mut entries = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        for (name, value) in map {
            if name == "__metadata__" {
                if let Value::Object(m) = value {
                    for (k, v) in m {
                        if let Value::String(s) = v {
                            metadata.insert(k, s);
                        }
                    }
                }
                continue;
            }
            let entry = parse_entry(path, &name, &value, data_start, data_len)?;
            entries.insert(name, entry);
        }
        tracing::debug!(path = %path.display(), tensors = entries.len(), "opened safetensors");
        Ok(Arc::new(Self {
            path: path.to_path_buf(),
            backing,
            entries,
            metadata,
        }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn entries(&self) -> &BTreeMap<String, TensorEntry> {
        &self.entries
    }

    pub fn entry(&self, name: &str) -> Option<&TensorEntry> {
        self.entries.get(name)
    }

    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The raw bytes of a tensor, borrowed from the mapping.
    pub fn bytes(&self, entry: &TensorEntry) -> &[u8] {
        &self.backing.bytes()[entry.start..entry.end]
    }

    /// The whole mapping (header included).
    pub fn raw(&self) -> &[u8] {
        self.backing.bytes()
    }

    /// Tells the OS that bytes `start..end` will not be needed soon, so their pages
    /// leave this process's resident set (they stay in the page cache). Streaming
    /// over a whole model (conversion) then keeps RSS near one tensor instead of
    /// growing to the file size. A no-op for embedded bytes and off Unix.
    pub fn release(&self, start: usize, end: usize) {
        #[cfg(unix)]
        if let Backing::Mapped(m) = &self.backing {
            let end = end.min(m.len());
            if start < end {
                // SAFETY: the mapping is read-only and file-backed: dropped pages are
                // read back from the file on the next access, with the same contents,
                // so slices borrowed from it stay valid.
                let r = unsafe { m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) };
                if let Err(e) = r {
                    tracing::debug!(path = %self.path.display(), "madvise(DONTNEED) failed: {e}");
                }
            }
        }
        #[cfg(not(unix))]
        let _ = (start, end);
    }

    /// Size of the mapped file in bytes.
    pub fn file_len(&self) -> usize {
        self.backing.bytes().len()
    }
}

fn read_up_to(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

fn parse_entry(
    path: &Path,
    name: &str,
    value: &Value,
    data_start: u64,
    data_len: u64,
) -> Result<TensorEntry, LoadError> {
    let bad = |reason: String| LoadError::BadTensor {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        reason,
    };
    let dtype_s = value
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("header entry has no `dtype` string".into()))?;
    let dtype = StoredDType::parse(dtype_s).ok_or_else(|| bad(format!("unsupported dtype `{dtype_s}`")))?;
    let shape: Vec<usize> = value
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("header entry has no `shape` array".into()))?
        .iter()
        .map(|d| d.as_u64().map(|d| d as usize))
        .collect::<Option<_>>()
        .ok_or_else(|| bad("`shape` holds a non-integer".into()))?;
    let offsets = value
        .get("data_offsets")
        .and_then(Value::as_array)
        .filter(|a| a.len() == 2)
        .ok_or_else(|| bad("header entry has no `data_offsets` pair".into()))?;
    let (Some(begin), Some(end)) = (offsets[0].as_u64(), offsets[1].as_u64()) else {
        return Err(bad("`data_offsets` holds a non-integer".into()));
    };
    if begin > end {
        return Err(bad(format!("data_offsets [{begin}, {end}] are reversed")));
    }
    if end > data_len {
        return Err(bad(format!(
            "data_offsets [{begin}, {end}] point past the end of the data section ({data_len} bytes); \
             the file is truncated or corrupt"
        )));
    }
    let numel = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    let expected = numel
        .checked_mul(dtype.size())
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    if (end - begin) as usize != expected {
        return Err(bad(format!(
            "holds {} bytes but shape {shape:?} of {dtype} needs {expected}",
            end - begin
        )));
    }
    Ok(TensorEntry {
        dtype,
        shape,
        start: (data_start + begin) as usize,
        end: (data_start + end) as usize,
    })
}

/// Writes tensors as a safetensors file, atomically (temp file + rename), so a
/// failed or interrupted write never leaves a half-written model behind.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, StoredDType, Vec<usize>, Vec<u8>)],
    metadata: &BTreeMap<String, String>,
) -> Result<(), LoadError> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::to_value(metadata).unwrap_or(Value::Null));
    }
    let mut offset = 0usize;
    for (name, dtype, shape, data) in tensors {
        let mut e = serde_json::Map::new();
        e.insert("dtype".into(), Value::from(dtype.name()));
        e.insert("shape".into(), Value::from(shape.clone()));
        e.insert("data_offsets".into(), Value::from(vec![offset, offset + data.len()]));
        header.insert(name.clone(), Value::Object(e));
        offset += data.len();
    }
    let mut header_bytes = serde_json::to_vec(&Value::Object(header)).map_err(|e| LoadError::BadHeader {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    // Pad so the data section starts 8-byte aligned, which keeps f32 data mappable in place.
    while (header_bytes.len() + 8) % 8 != 0 {
        header_bytes.push(b' ');
    }
    crate::util::atomic_write(path, |w| {
        w.write_all(&(header_bytes.len() as u64).to_le_bytes())?;
        w.write_all(&header_bytes)?;
        for (_, _, _, data) in tensors {
            w.write_all(data)?;
        }
        Ok(())
    })
    .map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })
}
