//! How compressed tensors are described inside a safetensors file.
//!
//! A converted file is ordinary safetensors: every part is a tensor (packed
//! indices as `U8`, int8 values as `I8`, lookup tables `F16` under `<name>.lut`,
//! scales under `<name>.scale`), and the header's `__metadata__` holds, under
//! [`PRECISION_KEY`], a JSON object mapping each tensor name to its scheme and
//! logical shape. Opening a file checks every described tensor's parts against
//! what the scheme implies for the shape, so a corrupt or mismatched file is an
//! error naming the tensor before any layer reads it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::error::QuantError;
use super::scheme::{Scheme, LUT_SUFFIX};
use crate::loading::safetensors::{SafetensorsFile, StoredDType, TensorEntry};

/// Metadata key of the per-tensor scheme table.
pub const PRECISION_KEY: &str = "brume.precision";
/// Metadata key of the source model's fingerprint.
pub const SOURCE_HASH_KEY: &str = "brume.source_hash";
/// Metadata key of the policy (its text, as a policy file).
pub const POLICY_KEY: &str = "brume.policy";
/// Version of the layout described here.
pub const FORMAT_VERSION: u32 = 1;

/// One tensor's line in the scheme table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorScheme {
    pub scheme: String,
    pub shape: Vec<usize>,
}

/// The scheme table of one file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrecisionTable {
    pub format: u32,
    pub tensors: BTreeMap<String, TensorScheme>,
}

impl PrecisionTable {
    pub fn new() -> Self {
        Self {
            format: FORMAT_VERSION,
            tensors: BTreeMap::new(),
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The table of `file`, if it has one.
    pub fn of(file: &SafetensorsFile) -> Result<Option<Self>, QuantError> {
        let Some(text) = file.metadata().get(PRECISION_KEY) else {
            return Ok(None);
        };
        let t: Self = serde_json::from_str(text).map_err(|e| QuantError::BadMetadata {
            reason: format!("`{PRECISION_KEY}` is not a scheme table: {e}"),
        })?;
        if t.format != FORMAT_VERSION {
            return Err(QuantError::BadMetadata {
                reason: format!(
                    "format version {} (this brume reads {FORMAT_VERSION})",
                    t.format
                ),
            });
        }
        Ok(Some(t))
    }
}

impl Default for PrecisionTable {
    fn default() -> Self {
        Self::new()
    }
}

/// A validated compressed tensor: its scheme, logical shape and companion entries
/// (in `scheme.parts()` order after the main one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantInfo {
    pub scheme: Scheme,
    pub shape: Vec<usize>,
    pub companions: Vec<TensorEntry>,
}

/// Checks `name`'s stored parts in `file` against `ts`. Returns the main entry,
/// and the compressed description for non-float schemes.
pub fn validate(
    file: &SafetensorsFile,
    name: &str,
    ts: &TensorScheme,
) -> Result<(TensorEntry, Option<QuantInfo>), QuantError> {
    let scheme = Scheme::parse(&ts.scheme)?;
    let parts = scheme.parts(&ts.shape);
    let main = file.entry(name).ok_or(QuantError::MissingData)?;
    let check = |entry: &TensorEntry,
                 part: &super::scheme::Part,
                 label: &str|
     -> Result<(), QuantError> {
        if entry.dtype == part.dtype && entry.shape == part.shape {
            return Ok(());
        }
        if part.suffix == LUT_SUFFIX {
            if let Scheme::Palettize { bits, .. } = scheme {
                return Err(QuantError::LutSize {
                    bits: bits.get(),
                    groups: part.shape[0],
                    levels: part.shape[1],
                    found: entry.shape.clone(),
                });
            }
        }
        if part.suffix.is_empty() && part.dtype == StoredDType::U8 && entry.dtype == StoredDType::U8
        {
            let bits = match scheme {
                Scheme::Palettize { bits, .. } => bits.get(),
                _ => 2,
            };
            return Err(QuantError::IndexBytes {
                shape: ts.shape.clone(),
                bits,
                expected: part.nbytes(),
                found: entry.numel(),
            });
        }
        Err(QuantError::PartMismatch {
            part: label.to_string(),
            found: entry.dtype.to_string(),
            found_shape: entry.shape.clone(),
            expected: part.dtype.to_string(),
            expected_shape: part.shape.clone(),
        })
    };
    check(main, &parts[0], name)?;
    if scheme.is_float() {
        return Ok((main.clone(), None));
    }
    let mut companions = Vec::new();
    for part in &parts[1..] {
        let cname = format!("{name}{}", part.suffix);
        let entry = file
            .entry(&cname)
            .ok_or_else(|| QuantError::MissingCompanion {
                companion: cname.clone(),
            })?;
        check(entry, part, &cname)?;
        companions.push(entry.clone());
    }
    Ok((
        main.clone(),
        Some(QuantInfo {
            scheme,
            shape: ts.shape.clone(),
            companions,
        }),
    ))
}

/// The names of `table`'s companion tensors (not module tensors themselves).
pub fn companion_names(table: &PrecisionTable) -> Vec<String> {
    let mut out = Vec::new();
    for (name, ts) in &table.tensors {
        if let Ok(s) = Scheme::parse(&ts.scheme) {
            for p in s.parts(&ts.shape).iter().skip(1) {
                out.push(format!("{name}{}", p.suffix));
            }
        }
    }
    out
}
