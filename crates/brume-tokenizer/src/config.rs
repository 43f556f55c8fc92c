//! Reading `tokenizer_config.json` and `special_tokens_map.json` the way transformers 5.x resolves them into the
//! special tokens (and their `normalized` flags) of a `CLIPTokenizer`.
//!
//! transformers' rules, read in `tokenization_utils_base.py` (`_from_pretrained`) and
//! `tokenization_utils_tokenizers.py` (`TokenizersBackend.__init__` / `_post_init`) of version 5.23.0:
//!
//! * The named special tokens are `bos`, `eos`, `unk`, `sep`, `pad`, `cls`, `mask` (`*_token` keys). Their
//!   defaults are CLIPTokenizer's: bos `<|startoftext|>`, eos/unk/pad `<|endoftext|>`, all plain strings.
//! * If `tokenizer_config.json` has an `added_tokens_decoder`, that table is authoritative: its tokens are added
//!   with their own flags, and a named token whose text is in the table takes the table's flags.
//!   `special_tokens_map.json` is not read at all.
//! * Otherwise (the "legacy" layout of the SD 1.x / 2.x repositories) every key of `special_tokens_map.json`
//!   replaces the same key of `tokenizer_config.json`.
//! * The named tokens are then (re-)added in the order bos, eos, unk, sep, pad, cls, mask; adding a token whose
//!   text already exists replaces its flags, so the last one wins. A plain string is added with
//!   `normalized = false`; an object uses its `normalized` field, whose default is `not special` (objects in
//!   `tokenizer_config.json` are not special unless they say so, those in `special_tokens_map.json` are).
//!
//! Hence SD 1.5 (pad `"<|endoftext|>"` as a plain string in special_tokens_map.json) ends with `<|endoftext|>`
//! matched in the raw text (case-sensitive), while SD 2.x (pad `"!"`) keeps `<|endoftext|>` normalized and adds
//! `!` as a special token matched in the raw text.

use std::path::Path;

use serde_json::Value;

use crate::TokenizerError;

/// Named special-token keys in the order transformers adds them.
pub const NAMED_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Text and flag of one token as written in a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenSpec {
    pub content: String,
    pub normalized: bool,
}

impl TokenSpec {
    pub fn plain(content: &str) -> Self {
        Self {
            content: content.to_owned(),
            normalized: false,
        }
    }
}

/// What the config files say, resolved.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub bos: String,
    pub eos: String,
    pub unk: String,
    pub pad: String,
    /// Special tokens in the order they are added (the first occurrence of a text fixes its position, the
    /// last one its flag).
    pub added: Vec<TokenSpec>,
    /// `model_max_length` when it is present and finite.
    pub max_length: Option<usize>,
}

fn invalid(path: &Path, message: impl Into<String>) -> TokenizerError {
    TokenizerError::Invalid {
        path: path.to_owned(),
        message: message.into(),
    }
}

/// Parse a token value: a string, or an AddedToken object (`content`, `normalized`, `special`, ...).
/// `special_default` is the `special` flag transformers assumes when the object does not have one.
fn parse_token(
    path: &Path,
    key: &str,
    value: &Value,
    special_default: bool,
) -> Result<Option<TokenSpec>, TokenizerError> {
    match value {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(TokenSpec::plain(s))),
        Value::Object(obj) => {
            let content = obj
                .get("content")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid(path, format!("`{key}` has no string `content`")))?;
            let flag = |name: &str| -> Result<Option<bool>, TokenizerError> {
                match obj.get(name) {
                    None | Some(Value::Null) => Ok(None),
                    Some(Value::Bool(b)) => Ok(Some(*b)),
                    Some(other) => Err(invalid(
                        path,
                        format!("`{key}.{name}` must be true or false, found {other}"),
                    )),
                }
            };
            for unsupported in ["lstrip", "rstrip", "single_word"] {
                if flag(unsupported)? == Some(true) {
                    return Err(invalid(
                        path,
                        format!(
                            "`{key}` sets `{unsupported}`, which brume's tokenizer does not implement \
                             (no Stable Diffusion tokenizer uses it)"
                        ),
                    ));
                }
            }
            let special = flag("special")?.unwrap_or(special_default);
            let normalized = flag("normalized")?.unwrap_or(!special);
            Ok(Some(TokenSpec {
                content: content.to_owned(),
                normalized,
            }))
        }
        other => Err(invalid(
            path,
            format!("`{key}` must be a string or an object, found {other}"),
        )),
    }
}

fn as_object<'a>(
    path: &Path,
    value: &'a Value,
) -> Result<&'a serde_json::Map<String, Value>, TokenizerError> {
    value
        .as_object()
        .ok_or_else(|| invalid(path, "expected a JSON object at the top level"))
}

fn reject_extra_tokens(
    path: &Path,
    obj: &serde_json::Map<String, Value>,
) -> Result<(), TokenizerError> {
    for key in ["additional_special_tokens", "extra_special_tokens"] {
        match obj.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(Value::Object(o)) if o.is_empty() => {}
            Some(_) => {
                return Err(invalid(
                    path,
                    format!(
                        "`{key}` is not supported by brume's tokenizer (no Stable Diffusion tokenizer has any)"
                    ),
                ))
            }
        }
    }
    Ok(())
}

/// Resolve the special tokens from the (optional) parsed files.
pub fn resolve(
    config: Option<(&Path, &Value)>,
    special_map: Option<(&Path, &Value)>,
) -> Result<Resolved, TokenizerError> {
    let mut named: Vec<Option<TokenSpec>> = vec![
        Some(TokenSpec::plain("<|startoftext|>")),
        Some(TokenSpec::plain("<|endoftext|>")),
        Some(TokenSpec::plain("<|endoftext|>")),
        None,
        Some(TokenSpec::plain("<|endoftext|>")),
        None,
        None,
    ];
    let mut added: Vec<TokenSpec> = Vec::new();
    let mut max_length = None;

    let mut decoder: Option<Vec<TokenSpec>> = None;
    if let Some((path, value)) = config {
        let obj = as_object(path, value)?;
        reject_extra_tokens(path, obj)?;
        for (slot, key) in named.iter_mut().zip(NAMED_KEYS) {
            if let Some(v) = obj.get(key) {
                if let Some(spec) = parse_token(path, key, v, false)? {
                    *slot = Some(spec);
                }
            }
        }
        if let Some(v) = obj.get("added_tokens_decoder") {
            let table = v
                .as_object()
                .ok_or_else(|| invalid(path, "`added_tokens_decoder` must be an object"))?;
            let mut entries = Vec::with_capacity(table.len());
            for (id, tok) in table {
                let id: u64 = id.parse().map_err(|_| {
                    invalid(
                        path,
                        format!("`added_tokens_decoder` key {id:?} is not an id"),
                    )
                })?;
                let key = format!("added_tokens_decoder.{id}");
                if let Some(spec) = parse_token(path, &key, tok, false)? {
                    entries.push((id, spec));
                }
            }
            entries.sort_by_key(|(id, _)| *id);
            decoder = Some(entries.into_iter().map(|(_, s)| s).collect());
        }
        for key in ["padding_side", "truncation_side"] {
            match obj.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::String(s)) if s == "right" => {}
                Some(other) => {
                    return Err(invalid(
                        path,
                        format!("`{key}` = {other} is not supported (brume pads and truncates on the right)"),
                    ))
                }
            }
        }
        match obj.get("model_max_length") {
            None | Some(Value::Null) => {}
            Some(Value::Number(n)) => {
                // transformers writes "infinite" as 1e30; treat any absurd value like a missing one.
                if let Some(v) = n.as_u64().filter(|&v| v <= 1 << 20) {
                    if v < 2 {
                        return Err(invalid(
                            path,
                            format!("`model_max_length` = {v} leaves no room for the bos and eos tokens"),
                        ));
                    }
                    max_length = Some(v as usize);
                } else if n.as_f64().is_some_and(|f| f < 2.0) {
                    return Err(invalid(
                        path,
                        format!("`model_max_length` = {n} is not a usable length"),
                    ));
                }
            }
            Some(other) => {
                return Err(invalid(
                    path,
                    format!("`model_max_length` must be a number, found {other}"),
                ))
            }
        }
    }

    match &decoder {
        Some(table) => {
            // New layout: the table rules; named tokens with the same text take its flags.
            added.extend(table.iter().cloned());
            for spec in named.iter_mut().flatten() {
                if let Some(t) = table.iter().find(|t| t.content == spec.content) {
                    *spec = t.clone();
                }
            }
        }
        None => {
            if let Some((path, value)) = special_map {
                let obj = as_object(path, value)?;
                reject_extra_tokens(path, obj)?;
                for (slot, key) in named.iter_mut().zip(NAMED_KEYS) {
                    if let Some(v) = obj.get(key) {
                        if let Some(spec) = parse_token(path, key, v, true)? {
                            *slot = Some(spec);
                        }
                    }
                }
            }
        }
    }
    added.extend(named.iter().flatten().cloned());

    let text = |i: usize| named[i].as_ref().map(|s| s.content.clone());
    Ok(Resolved {
        bos: text(0).unwrap_or_else(|| "<|startoftext|>".into()),
        eos: text(1).unwrap_or_else(|| "<|endoftext|>".into()),
        unk: text(2).unwrap_or_else(|| "<|endoftext|>".into()),
        pad: text(4).unwrap_or_else(|| "<|endoftext|>".into()),
        added,
        max_length,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn flags(r: &Resolved) -> Vec<(String, bool)> {
        // last flag per text, in first-seen order
        let mut out: Vec<(String, bool)> = Vec::new();
        for t in &r.added {
            match out.iter_mut().find(|(c, _)| *c == t.content) {
                Some(e) => e.1 = t.normalized,
                None => out.push((t.content.clone(), t.normalized)),
            }
        }
        out
    }

    fn tok(content: &str, normalized: bool) -> Value {
        json!({"__type": "AddedToken", "content": content, "lstrip": false, "normalized": normalized,
               "rstrip": false, "single_word": false})
    }

    #[test]
    fn no_files_gives_clip_defaults() {
        let r = resolve(None, None).unwrap();
        assert_eq!(
            (r.bos.as_str(), r.eos.as_str(), r.pad.as_str()),
            ("<|startoftext|>", "<|endoftext|>", "<|endoftext|>")
        );
        assert_eq!(
            flags(&r),
            [
                ("<|startoftext|>".to_string(), false),
                ("<|endoftext|>".to_string(), false)
            ]
        );
        assert_eq!(r.max_length, None);
    }

    #[test]
    fn legacy_sd15_pad_string_wins() {
        let p = Path::new("x");
        let cfg = json!({"bos_token": tok("<|startoftext|>", true), "eos_token": tok("<|endoftext|>", true),
                         "unk_token": tok("<|endoftext|>", true), "pad_token": "<|endoftext|>",
                         "model_max_length": 77});
        let map = json!({"bos_token": {"content": "<|startoftext|>", "normalized": true},
                         "eos_token": {"content": "<|endoftext|>", "normalized": true},
                         "unk_token": {"content": "<|endoftext|>", "normalized": true},
                         "pad_token": "<|endoftext|>"});
        let r = resolve(Some((p, &cfg)), Some((p, &map))).unwrap();
        assert_eq!(
            flags(&r),
            [
                ("<|startoftext|>".to_string(), true),
                ("<|endoftext|>".to_string(), false)
            ]
        );
        assert_eq!(r.max_length, Some(77));
    }

    #[test]
    fn legacy_sd2_special_map_overrides_config_pad() {
        let p = Path::new("x");
        let cfg = json!({"eos_token": tok("<|endoftext|>", true), "unk_token": tok("<|endoftext|>", true),
                         "bos_token": tok("<|startoftext|>", true), "pad_token": "<|endoftext|>"});
        let map = json!({"unk_token": {"content": "<|endoftext|>", "normalized": true},
                         "eos_token": {"content": "<|endoftext|>", "normalized": true}, "pad_token": "!"});
        let r = resolve(Some((p, &cfg)), Some((p, &map))).unwrap();
        assert_eq!(r.pad, "!");
        assert_eq!(
            flags(&r),
            [
                ("<|startoftext|>".to_string(), true),
                ("<|endoftext|>".to_string(), true),
                ("!".to_string(), false)
            ]
        );
    }

    #[test]
    fn decoder_table_is_authoritative() {
        let p = Path::new("x");
        let cfg = json!({"added_tokens_decoder": {
                            "49407": {"content": "<|endoftext|>", "normalized": true, "special": true},
                            "49406": {"content": "<|startoftext|>", "normalized": true, "special": true}},
                         "pad_token": "<|endoftext|>", "model_max_length": 1e30});
        let map = json!({"pad_token": {"content": "<|endoftext|>", "normalized": false}});
        let r = resolve(Some((p, &cfg)), Some((p, &map))).unwrap();
        assert_eq!(
            flags(&r),
            [
                ("<|startoftext|>".to_string(), true),
                ("<|endoftext|>".to_string(), true)
            ]
        );
        assert_eq!(r.max_length, None);
    }

    #[test]
    fn unsupported_settings_are_errors() {
        let p = Path::new("cfg.json");
        for cfg in [
            json!({"pad_token": {"content": "!", "lstrip": true}}),
            json!({"additional_special_tokens": ["<x>"]}),
            json!({"padding_side": "left"}),
            json!({"model_max_length": 1}),
            json!({"model_max_length": "77"}),
            json!({"pad_token": 5}),
            json!([1, 2]),
        ] {
            let e = resolve(Some((p, &cfg)), None).unwrap_err();
            assert!(e.to_string().contains("cfg.json"), "{e}");
        }
    }
}
