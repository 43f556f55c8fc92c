#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde_json::Value;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn fixtures() -> PathBuf {
    repo_root().join("fixtures")
}

/// The SD 1.x tokenizer folder of the parity fixtures (real vocab.json + merges.txt + sd15 configs).
/// The brief named `pipeline_sd1/tokenizer/`; the fixture writer put it under `pipeline_sd1/model/tokenizer/`.
pub fn parity_tokenizer_dir(pipeline: &str) -> PathBuf {
    let candidates = [
        fixtures()
            .join("parity")
            .join(pipeline)
            .join("model/tokenizer"),
        fixtures().join("parity").join(pipeline).join("tokenizer"),
    ];
    for c in &candidates {
        if c.join("vocab.json").is_file() && c.join("merges.txt").is_file() {
            return c.clone();
        }
    }
    panic!(
        "parity tokenizer fixture not found; looked for vocab.json + merges.txt in {:?}",
        candidates
    );
}

pub struct Corpus {
    pub doc: Value,
}

pub struct Entry {
    pub text: String,
    pub sd1: Vec<u32>,
    pub sd2: Vec<u32>,
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

impl Corpus {
    pub fn load() -> Self {
        let path = fixtures().join("tokenizer/corpus.json");
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Self {
            doc: serde_json::from_str(&text).expect("corpus.json is JSON"),
        }
    }

    pub fn max_length(&self) -> usize {
        self.doc["max_length"].as_u64().unwrap() as usize
    }

    pub fn entries(&self) -> Vec<Entry> {
        self.doc["entries"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let sd1 = ids(&e["ids"]);
                let sd2 = if e.get("ids_sd2").is_some() {
                    ids(&e["ids_sd2"])
                } else {
                    sd1.clone()
                };
                Entry {
                    text: e["text"].as_str().unwrap().to_owned(),
                    sd1,
                    sd2,
                }
            })
            .collect()
    }
}

/// What transformers returns for `padding="max_length", truncation=True` (the generator checks this rule
/// against transformers for every corpus entry).
pub fn padded(ids: &[u32], max_length: usize, eos: u32, pad: u32) -> Vec<u32> {
    if ids.len() > max_length {
        let mut v = ids[..max_length - 1].to_vec();
        v.push(eos);
        v
    } else {
        let mut v = ids.to_vec();
        v.resize(max_length, pad);
        v
    }
}
