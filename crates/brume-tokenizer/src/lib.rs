//! CLIP byte-level BPE tokenizer that gives exactly the ids of the tokenizer diffusers' Stable Diffusion
//! pipelines use: transformers' `CLIPTokenizer` (5.x, backed by the `tokenizers` library), called as
//! `tokenizer(prompt, padding="max_length", max_length=tokenizer.model_max_length, truncation=True)`.
//!
//! ```no_run
//! use brume_tokenizer::{ClipTokenizer, PadToken};
//! let tok = ClipTokenizer::builtin(PadToken::EndOfText); // SD 1.x
//! let ids = tok.encode_padded("a photo of a cat"); // 77 ids: 49406, 320, 1125, 539, 320, 2368, 49407, 49407, ...
//! assert_eq!(ids.len(), 77);
//! ```
//!
//! # What happens to a prompt
//!
//! These are the rules of the pinned reference (transformers 5.23.0, tokenizers 0.23.3), read in
//! `transformers/models/clip/tokenization_clip.py` and in the `tokenizer.json` it builds, and checked id for id
//! against it on the corpus in `fixtures/tokenizer/corpus.json`:
//!
//! 1. **Special tokens in the raw text.** Special tokens whose `normalized` flag is false are cut out of the
//!    text first, case-sensitively, leftmost-longest; each becomes its id. For SD 1.x that is `<|endoftext|>`
//!    (49407); for SD 2.x it is the pad token `!` (id 0) -- so with SD 2.x settings *every* `!` in a prompt is id
//!    0, not the BPE token `!</w>` (256); `!!!` is `0 0 0` instead of 995. This is what transformers does.
//! 2. **Text cleanup** (the `tokenizers` normalizer; there is no ftfy step and no HTML unescaping in 5.x, and
//!    nothing else -- no accent stripping, no control-character removal), on each remaining piece:
//!    * Unicode NFC, with the Unicode 9.0 tables of the `unicode-normalization-alignments` crate, the same code
//!      `tokenizers` runs (newer compositions, e.g. Dives Akuru, and reorderings of combining marks added after
//!      Unicode 9 are therefore *not* applied -- matching the reference);
//!    * every run of Unicode `White_Space` (`\s+`: space, tab, CR, LF, VT, FF, U+0085, U+00A0, U+1680,
//!      U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000) becomes one space. Zero-width space U+200B, BOM
//!      U+FEFF, U+180E and the separators U+001C..U+001F are *not* whitespace here (Python's `\s` and
//!      `str.split` count U+001C..U+001F as whitespace) and stay as symbols; leading/trailing spaces are dropped
//!      later by step 4;
//!    * lower-casing character by character (`char::to_lowercase`): `İ` becomes `i̇` (two characters), `ẞ`
//!      becomes `ß`, and there is no final-sigma rule (`ΟΔΟΣ` becomes `οδοσ`).
//! 3. **Special tokens in the cleaned text.** Special tokens with `normalized = true` are cut out of each
//!    cleaned piece (for SD 1.x `<|startoftext|>`, so `<|STARTOFTEXT|>` is id 49406 too; for SD 2.x both
//!    `<|startoftext|>` and `<|endoftext|>`, in any case).
//! 4. **Words.** CLIP's pattern
//!    `<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+` picks the
//!    words; anything between matches (spaces) is dropped. So letters group, every digit is its own word, and
//!    runs of other symbols (punctuation, emoji, combining marks, control characters) group. Contractions are
//!    matched only with the ASCII apostrophe (the curly `’` is punctuation). Then GPT-2's pattern
//!    (the `ByteLevel` pre-tokenizer's `use_regex`) splits each word again, which only changes a literal
//!    `<|startoftext|>`/`<|endoftext|>` that was not taken as a special token: it becomes `<|`, `startoftext`,
//!    `|>`.
//! 5. **BPE.** Each word's UTF-8 bytes are mapped to the byte-level alphabet, `</w>` is appended to the last
//!    symbol, and merges are applied lowest rank first (ties: leftmost). Results are cached per word.
//! 6. **Framing.** `[49406] + ids + [eos]`; for the padded form, over-long prompts keep the first
//!    `max_length - 2` tokens (then eos), short ones are padded on the right with the pad id (49407 for SD 1.x,
//!    0 for SD 2.x).
//!
//! Which special tokens exist and which are "normalized" depends on the model folder's `tokenizer_config.json`
//! and `special_tokens_map.json`; [`ClipTokenizer::from_model_dir`] reproduces transformers' resolution (the
//! rules are documented in `src/config.rs`). [`PadToken::EndOfText`] gives the SD 1.5 result
//! (`<|startoftext|>` normalized, `<|endoftext|>` raw), [`PadToken::Exclamation`] the SD 2.x one (`!` raw, both
//! `<|...|>` tokens normalized). Other SD 1.x-family folders (LCM Dreamshaper v7, SDXL-Turbo's first tokenizer)
//! use an `added_tokens_decoder` that keeps `<|endoftext|>` normalized; load them with `from_model_dir` to get
//! that too (it only changes prompts that type `<|ENDOFTEXT|>` in another case).
//!
//! This is *not* what older references did: transformers 4.x's pure-Python `CLIPTokenizer`, when ftfy was not
//! installed, cleaned text with BERT's `BasicTokenizer(strip_accents=False, do_split_on_punc=False)` (which
//! drops control and format characters such as U+0000 or the emoji joiner U+200D and puts spaces around CJK
//! ideographs, making each one a word), and OpenAI's CLIP (or 4.x with ftfy) ran `ftfy.fix_text` and
//! `html.unescape`. transformers 5.x does none of that (`&amp;` stays `&`, `amp`, `;`), and brume follows 5.x.
//!
//! Unicode tables: letters/digits/whitespace come from the `regex` crate (current Unicode), lower-casing from
//! Rust's standard library, NFC from Unicode 9.0 tables, as in the reference. Characters assigned in very recent
//! Unicode versions could in principle be classified differently by the reference's Oniguruma tables; the
//! corpus includes letters from Unicode 15 and 16 and they agree.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

mod bpe;
mod builtin;
mod bytes;
mod config;
mod special;
mod text;

use bpe::BpeModel;
use special::{Matcher, Segment, SpecialToken};

/// Default sequence length of the CLIP text encoders.
pub const DEFAULT_MAX_LENGTH: usize = 77;

/// Id of `<|startoftext|>` in the CLIP vocabulary.
pub const START_OF_TEXT_ID: u32 = 49406;
/// Id of `<|endoftext|>` in the CLIP vocabulary.
pub const END_OF_TEXT_ID: u32 = 49407;

/// Words longer than this (in bytes) are not cached.
const CACHE_MAX_WORD: usize = 256;
/// The cache is cleared when it reaches this many words.
const CACHE_MAX_ENTRIES: usize = 20_000;

/// The padding token, which is also what distinguishes the SD 1.x and SD 2.x tokenizer settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PadToken {
    /// SD 1.x (and SDXL's first tokenizer): pad with `<|endoftext|>`, id 49407.
    EndOfText,
    /// SD 2.x (and SDXL's second tokenizer): pad with `!`, id 0, which is then also a special token.
    Exclamation,
}

impl PadToken {
    /// The token's text.
    pub fn content(self) -> &'static str {
        match self {
            PadToken::EndOfText => "<|endoftext|>",
            PadToken::Exclamation => "!",
        }
    }

    /// The special tokens transformers ends up with for the SD 1.5 / SD 2.1 tokenizer folders.
    fn special_tokens(self) -> Vec<config::TokenSpec> {
        let spec = |content: &str, normalized| config::TokenSpec {
            content: content.to_owned(),
            normalized,
        };
        match self {
            PadToken::EndOfText => {
                vec![spec("<|startoftext|>", true), spec("<|endoftext|>", false)]
            }
            PadToken::Exclamation => vec![
                spec("<|startoftext|>", true),
                spec("<|endoftext|>", true),
                spec("!", false),
            ],
        }
    }
}

/// Errors name the file and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The file could not be read (missing, unreadable).
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid JSON.
    #[error("{}: invalid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// The file is readable but its content is wrong or unsupported.
    #[error("{}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
}

/// CLIP tokenizer. Cheap to share: `Send + Sync`, the BPE model of [`ClipTokenizer::builtin`] is built once per
/// process and shared.
#[derive(Debug)]
pub struct ClipTokenizer {
    model: Arc<BpeModel>,
    /// Special tokens matched in the raw text.
    raw_specials: Matcher,
    /// Special tokens matched in the normalized text.
    normalized_specials: Matcher,
    specials: Vec<SpecialToken>,
    bos: u32,
    eos: u32,
    pad: u32,
    unk: Option<u32>,
    max_length: usize,
    vocab_size: usize,
    cache: Mutex<HashMap<String, Vec<u32>>>,
}

impl ClipTokenizer {
    /// Reads `vocab.json` + `merges.txt`, and `tokenizer_config.json` / `special_tokens_map.json` when present
    /// (special tokens and their matching rules, pad token, `model_max_length`; defaults: CLIPTokenizer's
    /// special tokens, pad `<|endoftext|>`, 77).
    ///
    /// A folder with the configs but neither `vocab.json` nor `merges.txt` uses the embedded OpenAI
    /// vocabulary (every SD 1.x/2.x model ships exactly that vocabulary), so random-weight models and
    /// converted models need not carry 1.5 MB of copies.
    pub fn from_model_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let (vocab, merges) = (dir.join("vocab.json"), dir.join("merges.txt"));
        let model = if !vocab.exists() && !merges.exists() {
            builtin::model()?
        } else {
            Arc::new(load_model(&vocab, &merges)?)
        };
        let config_path = dir.join("tokenizer_config.json");
        let map_path = dir.join("special_tokens_map.json");
        let config = read_optional_json(&config_path)?;
        let map = read_optional_json(&map_path)?;
        let resolved = config::resolve(
            config.as_ref().map(|v| (config_path.as_path(), v)),
            map.as_ref().map(|v| (map_path.as_path(), v)),
        )?;
        let max_length = resolved.max_length.unwrap_or(DEFAULT_MAX_LENGTH);
        Self::assemble(
            model,
            &resolved.added,
            &resolved.bos,
            &resolved.eos,
            &resolved.unk,
            &resolved.pad,
            max_length,
        )
        .map_err(|message| TokenizerError::Invalid {
            path: dir.to_owned(),
            message,
        })
    }

    /// Reads a vocabulary and merges, with the special tokens of SD 1.5 (`EndOfText`) or SD 2.x
    /// (`Exclamation`).
    pub fn from_files(
        vocab_json: &Path,
        merges_txt: &Path,
        pad: PadToken,
        max_length: usize,
    ) -> Result<Self, TokenizerError> {
        let model = Arc::new(load_model(vocab_json, merges_txt)?);
        Self::with_pad(model, pad, max_length).map_err(|message| TokenizerError::Invalid {
            path: vocab_json.to_owned(),
            message,
        })
    }

    /// The OpenAI CLIP vocabulary embedded in the binary, with the given pad token and a length of 77.
    ///
    /// The embedded data is fixed at compile time and checked by the crate's tests, so this does not fail.
    pub fn builtin(pad: PadToken) -> Self {
        let model = builtin::model().expect("embedded CLIP vocabulary is valid (checked by tests)");
        Self::with_pad(model, pad, DEFAULT_MAX_LENGTH)
            .expect("embedded CLIP vocabulary has the special tokens")
    }

    fn with_pad(model: Arc<BpeModel>, pad: PadToken, max_length: usize) -> Result<Self, String> {
        Self::assemble(
            model,
            &pad.special_tokens(),
            "<|startoftext|>",
            "<|endoftext|>",
            "<|endoftext|>",
            pad.content(),
            max_length,
        )
    }

    fn assemble(
        model: Arc<BpeModel>,
        added: &[config::TokenSpec],
        bos: &str,
        eos: &str,
        unk: &str,
        pad: &str,
        max_length: usize,
    ) -> Result<Self, String> {
        if max_length < 2 {
            return Err(format!(
                "max_length {max_length} leaves no room for the bos and eos tokens"
            ));
        }
        // Like `tokenizers`: a special token keeps the vocabulary id of its text; texts not in the vocabulary get
        // new ids after it. Adding the same text again replaces its flag.
        let mut specials: Vec<SpecialToken> = Vec::new();
        let mut next_id = model.vocab_len() as u32;
        for spec in added {
            if spec.content.is_empty() {
                continue;
            }
            if let Some(t) = specials.iter_mut().find(|t| t.content == spec.content) {
                t.normalized = spec.normalized;
                continue;
            }
            let id = model.token_id(&spec.content).unwrap_or_else(|| {
                next_id += 1;
                next_id - 1
            });
            specials.push(SpecialToken {
                content: spec.content.clone(),
                id,
                normalized: spec.normalized,
            });
        }
        let id_of = |text: &str| -> Option<u32> {
            specials
                .iter()
                .find(|t| t.content == text)
                .map(|t| t.id)
                .or_else(|| model.token_id(text))
        };
        let bos_id =
            id_of(bos).ok_or_else(|| format!("bos token {bos:?} is not in the vocabulary"))?;
        let eos_id =
            id_of(eos).ok_or_else(|| format!("eos token {eos:?} is not in the vocabulary"))?;
        let pad_id =
            id_of(pad).ok_or_else(|| format!("pad token {pad:?} is not in the vocabulary"))?;
        let unk_id = id_of(unk);
        let raw_specials = Matcher::new(
            specials
                .iter()
                .filter(|t| !t.normalized)
                .map(|t| (t.content.clone(), t.id)),
        );
        // A normalized special token is matched by its normalized text.
        let normalized_specials = Matcher::new(
            specials
                .iter()
                .filter(|t| t.normalized)
                .map(|t| (text::normalize(&t.content), t.id)),
        );
        let extra = specials
            .iter()
            .filter(|t| model.token_id(&t.content).is_none())
            .count();
        Ok(Self {
            vocab_size: model.vocab_len() + extra,
            model,
            raw_specials,
            normalized_specials,
            specials,
            bos: bos_id,
            eos: eos_id,
            pad: pad_id,
            unk: unk_id,
            max_length,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// bos + tokens + eos, no truncation or padding.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = vec![self.bos];
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        self.raw_specials.split(text, |seg| match seg {
            Segment::Token(id) => ids.push(id),
            Segment::Text(piece) => {
                let normalized = text::normalize(piece);
                self.normalized_specials
                    .split(&normalized, |seg| match seg {
                        Segment::Token(id) => ids.push(id),
                        Segment::Text(piece) => text::for_each_word(piece, |word| {
                            self.encode_word(word, &mut cache, &mut ids)
                        }),
                    });
            }
        });
        ids.push(self.eos);
        ids
    }

    fn encode_word(&self, word: &str, cache: &mut HashMap<String, Vec<u32>>, out: &mut Vec<u32>) {
        if let Some(ids) = cache.get(word) {
            out.extend_from_slice(ids);
            return;
        }
        let start = out.len();
        self.model.encode_word(word.as_bytes(), self.unk, out);
        if word.len() <= CACHE_MAX_WORD {
            if cache.len() >= CACHE_MAX_ENTRIES {
                cache.clear();
            }
            cache.insert(word.to_owned(), out[start..].to_vec());
        }
    }

    /// Exactly what diffusers gets: truncated to `max_length` (bos, the first `max_length - 2` tokens, eos) and
    /// padded on the right with the pad id to `max_length`.
    pub fn encode_padded(&self, text: &str) -> Vec<u32> {
        let mut ids = self.encode(text);
        if ids.len() > self.max_length {
            ids.truncate(self.max_length - 1);
            ids.push(self.eos);
        } else {
            ids.resize(self.max_length, self.pad);
        }
        ids
    }

    /// Id of `<|startoftext|>` (49406).
    pub fn bos_id(&self) -> u32 {
        self.bos
    }

    /// Id of `<|endoftext|>` (49407).
    pub fn eos_id(&self) -> u32 {
        self.eos
    }

    /// Padding id: 49407 (SD 1.x) or 0 (SD 2.x).
    pub fn pad_id(&self) -> u32 {
        self.pad
    }

    /// Length of [`encode_padded`](Self::encode_padded) output (77).
    pub fn max_length(&self) -> usize {
        self.max_length
    }

    /// Vocabulary size including special tokens that are not in the vocabulary file (49408 for CLIP).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The special tokens: (text, id, matched in the normalized text rather than the raw text).
    pub fn special_tokens(&self) -> impl Iterator<Item = (&str, u32, bool)> {
        self.specials
            .iter()
            .map(|t| (t.content.as_str(), t.id, t.normalized))
    }

    /// Id of a vocabulary entry (byte-level form, e.g. `"cat</w>"`) or special token.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.specials
            .iter()
            .find(|t| t.content == token)
            .map(|t| t.id)
            .or_else(|| self.model.token_id(token))
    }
}

fn read_file(path: &Path) -> Result<String, TokenizerError> {
    std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_owned(),
        source,
    })
}

fn parse_json(path: &Path, text: &str) -> Result<serde_json::Value, TokenizerError> {
    serde_json::from_str(text).map_err(|source| TokenizerError::Json {
        path: path.to_owned(),
        source,
    })
}

fn read_optional_json(path: &Path) -> Result<Option<serde_json::Value>, TokenizerError> {
    match std::fs::read_to_string(path) {
        Ok(text) => parse_json(path, &text).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Read vocab.json and merges.txt (the format `tokenizers` reads: `#version` lines skipped, every other line
/// exactly two tokens separated by one space).
fn load_model(vocab_json: &Path, merges_txt: &Path) -> Result<BpeModel, TokenizerError> {
    let invalid = |path: &Path, message: String| TokenizerError::Invalid {
        path: path.to_owned(),
        message,
    };
    let value = parse_json(vocab_json, &read_file(vocab_json)?)?;
    let obj = value.as_object().ok_or_else(|| {
        invalid(
            vocab_json,
            "expected a JSON object mapping tokens to ids".into(),
        )
    })?;
    let mut vocab = HashMap::with_capacity(obj.len());
    for (token, id) in obj {
        let id = id
            .as_u64()
            .filter(|&id| id <= u32::MAX as u64)
            .ok_or_else(|| {
                invalid(
                    vocab_json,
                    format!("token {token:?} has id {id}, expected a non-negative integer"),
                )
            })?;
        vocab.insert(token.clone(), id as u32);
    }
    if vocab.is_empty() {
        return Err(invalid(vocab_json, "the vocabulary is empty".into()));
    }

    let text = read_file(merges_txt)?;
    let mut merges = Vec::new();
    let mut line_numbers = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.starts_with("#version") {
            continue;
        }
        let mut parts = line.split(' ');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), None) => {
                merges.push((a.to_owned(), b.to_owned()));
                line_numbers.push(n + 1);
            }
            _ => {
                return Err(invalid(
                    merges_txt,
                    format!(
                        "line {}: expected two tokens separated by one space, found {line:?}",
                        n + 1
                    ),
                ))
            }
        }
    }
    BpeModel::new(vocab, &merges).map_err(|(index, bpe::MergeError::NotInVocab(token))| {
        invalid(
            merges_txt,
            format!(
                "line {}: {token:?} is not in {}",
                line_numbers[index],
                vocab_json.display()
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<ClipTokenizer>();
    }

    #[test]
    fn builtin_basics() {
        let t = ClipTokenizer::builtin(PadToken::EndOfText);
        assert_eq!(
            t.encode("a photo of a cat"),
            [49406, 320, 1125, 539, 320, 2368, 49407]
        );
        assert_eq!((t.bos_id(), t.eos_id(), t.pad_id()), (49406, 49407, 49407));
        assert_eq!((t.max_length(), t.vocab_size()), (77, 49408));
        let t2 = ClipTokenizer::builtin(PadToken::Exclamation);
        assert_eq!(t2.pad_id(), 0);
        assert_eq!(t.encode("hello!"), [49406, 3306, 256, 49407]);
        assert_eq!(t2.encode("hello!"), [49406, 3306, 0, 49407]);
    }
}
