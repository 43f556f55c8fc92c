//! The text conditioning of a generation, and the cache that makes a repeated
//! prompt free.
//!
//! The text encoder's output and every cross-attention layer's keys and values
//! depend only on the prompt, never on the step: they are computed once per
//! prompt (and negative prompt), reused on every step and every image of a batch,
//! and kept in a small LRU so the next generation with the same prompt and model
//! skips the text encoder entirely.

use std::collections::VecDeque;
use std::rc::Rc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

use super::model::SdModel;
use super::request::{Flow, GenerationRequest, Progress, ProgressFn};
use crate::error::{Result, RunError};
use crate::loading::Segment;
use crate::models::attention::KvCache;

/// Encoded prompt(s) ready for the UNet.
pub struct Conditioning {
    /// [uncond x batch, cond x batch] when guided, else [cond x batch]; tokens x width.
    pub context: Tensor,
    pub guided: bool,
    /// Cross-attention keys/values of `context`, filled on the first UNet step.
    pub kv: KvCache,
    /// Time the text encoder took (load + run) when this was computed.
    pub encode_time: Duration,
}

#[derive(Debug, Clone, PartialEq)]
struct Key {
    model: std::path::PathBuf,
    dtype: DType,
    prompt: String,
    negative: Option<String>,
    clip_skip: usize,
    batch: usize,
    guided: bool,
}

/// A small LRU of conditionings, keyed by model, prompt, negative prompt,
/// clip skip, batch size and guidance on/off.
pub struct ConditioningCache {
    entries: VecDeque<(Key, Rc<Conditioning>)>,
    capacity: usize,
    hits: usize,
    misses: usize,
}

impl Default for ConditioningCache {
    fn default() -> Self {
        Self::new(4)
    }
}

impl ConditioningCache {
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: VecDeque::new(),
            capacity: capacity.max(1),
            hits: 0,
            misses: 0,
        }
    }

    /// (hits, misses) so far.
    pub fn stats(&self) -> (usize, usize) {
        (self.hits, self.misses)
    }

    fn get(&mut self, key: &Key) -> Option<Rc<Conditioning>> {
        let i = self.entries.iter().position(|(k, _)| k == key)?;
        let entry = self.entries.remove(i)?;
        let c = entry.1.clone();
        self.entries.push_front(entry);
        Some(c)
    }

    fn put(&mut self, key: Key, c: Rc<Conditioning>) {
        self.entries.push_front((key, c));
        self.entries.truncate(self.capacity);
    }
}

/// Tokenises and encodes one prompt: [1, tokens, width].
pub fn encode_prompt(
    model: &SdModel,
    text_encoder: &crate::models::ClipTextModel,
    prompt: &str,
    clip_skip: usize,
    device: &Device,
) -> Result<Tensor> {
    if let Some(cut) = truncated_words(&model.tokenizer, prompt) {
        // The words only at debug: a service's log must not carry prompts. Whoever
        // runs the job tells its user (the runtime reports it as a notice).
        tracing::debug!(
            "the prompt is longer than the text encoder's {} tokens; this end of it was cut: \"{}\"",
            model.tokenizer.max_length(),
            crate::output::escape_control(&cut)
        );
    }
    let ids = model.tokenizer.encode_padded(prompt);
    let ids = Tensor::from_vec(ids.clone(), (1, ids.len()), device)?;
    let hidden = text_encoder.forward(&ids, clip_skip)?.hidden;
    super::denoise::ensure_finite(&hidden, || {
        "the text encoder's output is not finite (NaN or infinity): its weights may hold non-finite numbers".to_string()
    })?;
    Ok(hidden)
}

/// The words at the end of `prompt` that fall past the tokenizer's length
/// (what diffusers silently drops), or `None` when it all fits.
pub fn truncated_words(tokenizer: &brume_tokenizer::ClipTokenizer, prompt: &str) -> Option<String> {
    let max = tokenizer.max_length();
    if tokenizer.encode(prompt).len() <= max {
        return None;
    }
    let words: Vec<&str> = prompt.split_whitespace().collect();
    // The most words that fit (bos + tokens + eos within max): a binary search.
    let (mut lo, mut hi) = (0usize, words.len());
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if tokenizer.encode(&words[..mid].join(" ")).len() <= max {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let cut = words[lo..].join(" ");
    Some(if cut.chars().count() > 200 { format!("{}...", cut.chars().take(200).collect::<String>()) } else { cut })
}

/// The conditioning for `req`: from `cache` when it holds it, else the text
/// encoder is loaded, run for the prompt (and negative prompt) and dropped.
pub fn conditioning(
    model: &SdModel,
    req: &GenerationRequest,
    device: &Device,
    dtype: DType,
    cache: Option<&mut ConditioningCache>,
    progress: ProgressFn,
) -> Result<Rc<Conditioning>> {
    let guided = req.guided(model);
    let key = Key {
        model: model.root.clone(),
        dtype,
        prompt: req.prompt.clone(),
        negative: if guided { Some(req.negative_prompt.clone().unwrap_or_default()) } else { None },
        clip_skip: req.clip_skip,
        batch: req.batch,
        guided,
    };
    let mut cache = cache;
    if let Some(c) = cache.as_deref_mut() {
        if let Some(hit) = c.get(&key) {
            c.hits += 1;
            tracing::debug!("conditioning cache hit");
            return Ok(hit);
        }
        c.misses += 1;
    }
    let start = Instant::now();
    let context = {
        let te = model.text_encoder(device, dtype)?;
        if progress(&Progress::Loaded(Segment::TextEncoder)) == Flow::Cancel {
            return Err(RunError::Cancelled);
        }
        let repeat = |t: Tensor| -> Result<Tensor> { Ok(Tensor::cat(&vec![&t; req.batch], 0)?) };
        let cond = repeat(encode_prompt(model, &te, &req.prompt, req.clip_skip, device)?)?;
        if guided {
            let neg = req.negative_prompt.as_deref().unwrap_or("");
            let uncond = repeat(encode_prompt(model, &te, neg, req.clip_skip, device)?)?;
            Tensor::cat(&[&uncond, &cond], 0)?
        } else {
            cond
        }
    };
    let c = Rc::new(Conditioning {
        context,
        guided,
        kv: KvCache::new(),
        encode_time: start.elapsed(),
    });
    if let Some(cache) = cache {
        cache.put(key, c.clone());
    }
    Ok(c)
}
