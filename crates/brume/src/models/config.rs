//! Strict reading of diffusers / transformers `config.json` files.
//!
//! Configs are read field by field: a missing field takes the library default,
//! and a value we do not implement is an error naming the field, never a guess
//! that would silently compute something else than diffusers.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::LoadError;

/// Largest integer a config field may hold. Every size, count and length in a
/// model config is far below it (vocabularies ~50k, channels ~2k, timesteps
/// 1000); anything above is a broken file, and sizing an allocation or a
/// product of sizes by it would abort or overflow instead of failing cleanly.
pub const MAX_CONFIG_INT: u64 = 1 << 20;

/// Largest config file read (they are a few KB).
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;

/// A parsed `config.json` with its path, for error messages.
pub struct ConfigReader {
    path: PathBuf,
    obj: Map<String, Value>,
}

impl ConfigReader {
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        // Configs are a few KB: a huge file is refused before it is read whole.
        if let Ok(m) = std::fs::metadata(path) {
            if m.len() > MAX_CONFIG_BYTES {
                return Err(LoadError::Config {
                    path: path.to_path_buf(),
                    field: "<file>".into(),
                    reason: format!("{} bytes is too large for a config (at most {MAX_CONFIG_BYTES})", m.len()),
                });
            }
        }
        let text = std::fs::read_to_string(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                LoadError::NotFound {
                    path: path.to_path_buf(),
                    hint: " (every diffusers component folder has a config.json)".into(),
                }
            } else {
                LoadError::Io {
                    path: path.to_path_buf(),
                    source: e,
                }
            }
        })?;
        Self::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<Self, LoadError> {
        let text = quote_non_finite(text);
        let value: Value = serde_json::from_str(&text).map_err(|source| LoadError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        match value {
            Value::Object(obj) => Ok(Self {
                path: path.to_path_buf(),
                obj,
            }),
            _ => Err(LoadError::Config {
                path: path.to_path_buf(),
                field: "<root>".into(),
                reason: "not a JSON object".into(),
            }),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A reader over an already-parsed object.
    pub fn from_map(path: &Path, obj: Map<String, Value>) -> Self {
        Self {
            path: path.to_path_buf(),
            obj,
        }
    }

    /// All fields as parsed.
    pub fn raw(&self) -> &Map<String, Value> {
        &self.obj
    }

    pub fn error(&self, field: &str, reason: impl Into<String>) -> LoadError {
        LoadError::Config {
            path: self.path.clone(),
            field: field.to_string(),
            reason: reason.into(),
        }
    }

    /// Whether the key is present at all, null included.
    pub fn raw_has(&self, field: &str) -> bool {
        self.obj.contains_key(field)
    }

    /// The raw value, treating JSON null as absent.
    pub fn get(&self, field: &str) -> Option<&Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    pub fn usize(&self, field: &str, default: Option<usize>) -> Result<usize, LoadError> {
        match self.get(field) {
            Some(v) => match v.as_u64() {
                Some(x) if x <= MAX_CONFIG_INT => Ok(x as usize),
                Some(x) => Err(self.error(field, format!("{x} is too large (at most {MAX_CONFIG_INT})"))),
                None => Err(self.error(field, format!("expected a non-negative integer, found {v}"))),
            },
            None => default.ok_or_else(|| self.error(field, "required but absent")),
        }
    }

    pub fn opt_usize(&self, field: &str) -> Result<Option<usize>, LoadError> {
        match self.get(field) {
            Some(_) => self.usize(field, None).map(Some),
            None => Ok(None),
        }
    }

    pub fn f64(&self, field: &str, default: f64) -> Result<f64, LoadError> {
        match self.get(field) {
            Some(Value::String(s)) => NON_FINITE
                .iter()
                .find(|(tok, _)| *tok == s.as_str())
                .map(|(_, v)| *v)
                .ok_or_else(|| self.error(field, format!("expected a number, found \"{s}\""))),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.error(field, format!("expected a number, found {v}"))),
            None => Ok(default),
        }
    }

    pub fn bool(&self, field: &str, default: bool) -> Result<bool, LoadError> {
        match self.get(field) {
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.error(field, format!("expected true or false, found {v}"))),
            None => Ok(default),
        }
    }

    pub fn string(&self, field: &str) -> Result<Option<String>, LoadError> {
        match self.get(field) {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(self.error(field, format!("expected a string, found {v}"))),
            None => Ok(None),
        }
    }

    pub fn strings(&self, field: &str) -> Result<Vec<String>, LoadError> {
        match self.get(field) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| self.error(field, format!("expected strings, found {v}")))
                })
                .collect(),
            Some(v) => Err(self.error(field, format!("expected a list of strings, found {v}"))),
            None => Err(self.error(field, "required but absent")),
        }
    }

    pub fn usizes(&self, field: &str) -> Result<Vec<usize>, LoadError> {
        match self.get(field) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v.as_u64() {
                    Some(x) if x <= MAX_CONFIG_INT => Ok(x as usize),
                    Some(x) => Err(self.error(field, format!("{x} is too large (at most {MAX_CONFIG_INT})"))),
                    None => Err(self.error(field, format!("expected integers, found {v}"))),
                })
                .collect(),
            Some(v) => Err(self.error(field, format!("expected a list of integers, found {v}"))),
            None => Err(self.error(field, "required but absent")),
        }
    }

    /// An int applying to all `n` blocks or a per-block list of length `n`.
    pub fn per_block_usize(&self, field: &str, n: usize, default: Option<usize>) -> Result<Vec<usize>, LoadError> {
        match self.get(field) {
            Some(Value::Array(_)) => {
                let v = self.usizes(field)?;
                if v.len() != n {
                    return Err(self.error(field, format!("has {} entries but the model has {n} blocks", v.len())));
                }
                Ok(v)
            }
            Some(_) => Ok(vec![self.usize(field, None)?; n]),
            None => match default {
                Some(d) => Ok(vec![d; n]),
                None => Err(self.error(field, "required but absent")),
            },
        }
    }

    /// A bool applying to all `n` blocks or a per-block list.
    pub fn per_block_bool(&self, field: &str, n: usize, default: bool) -> Result<Vec<bool>, LoadError> {
        match self.get(field) {
            Some(Value::Array(a)) => {
                if a.len() != n {
                    return Err(self.error(field, format!("has {} entries but the model has {n} blocks", a.len())));
                }
                a.iter()
                    .map(|v| v.as_bool().ok_or_else(|| self.error(field, format!("expected booleans, found {v}"))))
                    .collect()
            }
            Some(_) => Ok(vec![self.bool(field, default)?; n]),
            None => Ok(vec![default; n]),
        }
    }

    /// Fails unless the field is absent/null or equal to one of `allowed`.
    pub fn expect_one_of(&self, field: &str, allowed: &[Value]) -> Result<(), LoadError> {
        match self.get(field) {
            None => Ok(()),
            Some(v) if allowed.contains(v) => Ok(()),
            Some(v) => Err(self.error(
                field,
                format!(
                    "value {v} is not supported by brume (supported: {})",
                    if allowed.is_empty() {
                        "null".to_string()
                    } else {
                        allowed.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(", ")
                    }
                ),
            )),
        }
    }

    /// Fails when the field is set (not absent / null).
    pub fn expect_unset(&self, field: &str) -> Result<(), LoadError> {
        self.expect_one_of(field, &[])
    }
}

/// The non-finite numbers Python's `json.dump` writes (diffusers saves
/// `"lambda_min_clipped": -Infinity` in every DPM-Solver config), which strict JSON
/// has no syntax for.
const NON_FINITE: [(&str, f64); 3] = [("-Infinity", f64::NEG_INFINITY), ("Infinity", f64::INFINITY), ("NaN", f64::NAN)];

/// Wraps bare `Infinity`, `-Infinity` and `NaN` tokens outside strings in quotes, so
/// serde_json parses them and [`ConfigReader::f64`] can read them back as numbers.
fn quote_non_finite(text: &str) -> std::borrow::Cow<'_, str> {
    if !NON_FINITE.iter().any(|(tok, _)| text.contains(tok)) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    let mut in_string = false;
    let mut escaped = false;
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
        } else if let Some((tok, _)) = NON_FINITE.iter().find(|(tok, _)| rest.starts_with(tok)) {
            out.push('"');
            out.push_str(tok);
            out.push('"');
            rest = &rest[tok.len()..];
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod non_finite_tests {
    use super::*;

    #[test]
    fn python_non_finite_numbers_read_as_floats() {
        let text = r#"{"lambda_min_clipped": -Infinity, "hi": Infinity, "n": NaN, "name": "NaN -Infinity \" Infinity", "x": 1.5}"#;
        let c = ConfigReader::parse(Path::new("scheduler_config.json"), text).unwrap();
        assert_eq!(c.f64("lambda_min_clipped", 0.0).unwrap(), f64::NEG_INFINITY);
        assert_eq!(c.f64("hi", 0.0).unwrap(), f64::INFINITY);
        assert!(c.f64("n", 0.0).unwrap().is_nan());
        assert_eq!(c.f64("x", 0.0).unwrap(), 1.5);
        // Inside strings nothing changes.
        assert_eq!(c.string("name").unwrap().as_deref(), Some("NaN -Infinity \" Infinity"));
        // A string that is not a non-finite token is still not a number.
        assert!(c.f64("name", 0.0).is_err());
    }
}
