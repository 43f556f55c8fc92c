//! The OpenAI CLIP vocabulary embedded in the binary (`data/bpe_simple_vocab_16e6.txt.gz`, MIT, see
//! `data/LICENSE-openai-clip`), turned into a vocabulary exactly as CLIP's `SimpleTokenizer` does.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use flate2::read::GzDecoder;

use crate::bpe::{BpeModel, END_OF_WORD};
use crate::bytes::{alphabet_order, byte_to_char};
use crate::TokenizerError;

static VOCAB_GZ: &[u8] = include_bytes!("../data/bpe_simple_vocab_16e6.txt.gz");

/// Number of merges CLIP uses: 49152 - 256 - 2 (the file holds many more).
pub const MERGES: usize = 49152 - 256 - 2;

/// Name used in errors about the embedded file.
pub const BUILTIN_NAME: &str = "<embedded data/bpe_simple_vocab_16e6.txt.gz>";

fn invalid(message: String) -> TokenizerError {
    TokenizerError::Invalid {
        path: PathBuf::from(BUILTIN_NAME),
        message,
    }
}

/// Token -> id, and merges in rank order.
type VocabAndMerges = (HashMap<String, u32>, Vec<(String, String)>);

/// Decompress and build (vocabulary in CLIP's order, merges).
pub fn parse() -> Result<VocabAndMerges, TokenizerError> {
    let reader = BufReader::new(GzDecoder::new(VOCAB_GZ));
    let mut merges = Vec::with_capacity(MERGES);
    // Line 0 is a header; CLIP uses lines 1..=MERGES.
    for (n, line) in reader.split(b'\n').enumerate().take(MERGES + 1) {
        let line = line.map_err(|e| invalid(format!("cannot decompress: {e}")))?;
        if n == 0 {
            continue;
        }
        let line =
            String::from_utf8(line).map_err(|_| invalid(format!("line {}: not UTF-8", n + 1)))?;
        let mut parts = line.split_whitespace();
        match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), None) => merges.push((a.to_owned(), b.to_owned())),
            _ => {
                return Err(invalid(format!(
                    "line {}: expected two symbols: {line:?}",
                    n + 1
                )))
            }
        }
    }
    if merges.len() != MERGES {
        return Err(invalid(format!(
            "only {} merges, expected {MERGES}",
            merges.len()
        )));
    }

    let mut tokens: Vec<String> = Vec::with_capacity(49408);
    let order = alphabet_order();
    tokens.extend(order.iter().map(|&b| byte_to_char(b).to_string()));
    tokens.extend(
        order
            .iter()
            .map(|&b| format!("{}{END_OF_WORD}", byte_to_char(b))),
    );
    tokens.extend(merges.iter().map(|(a, b)| format!("{a}{b}")));
    tokens.push("<|startoftext|>".to_owned());
    tokens.push("<|endoftext|>".to_owned());
    let mut vocab = HashMap::with_capacity(tokens.len());
    for (id, t) in tokens.into_iter().enumerate() {
        if vocab.insert(t, id as u32).is_some() {
            return Err(invalid(format!("token {id} is a duplicate")));
        }
    }
    Ok((vocab, merges))
}

/// The embedded model, built once per process.
pub fn model() -> Result<Arc<BpeModel>, TokenizerError> {
    static MODEL: OnceLock<Result<Arc<BpeModel>, String>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let (vocab, merges) = parse().map_err(|e| e.to_string())?;
            BpeModel::new(vocab, &merges)
                .map(Arc::new)
                .map_err(|(rank, e)| format!("merge {}: {e:?}", rank + 1))
        })
        .clone()
        .map_err(invalid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_vocabulary_has_clip_shape() {
        let (vocab, merges) = parse().unwrap();
        assert_eq!(vocab.len(), 49408);
        assert_eq!(merges.len(), MERGES);
        assert_eq!(vocab["!"], 0);
        assert_eq!(vocab["!</w>"], 256);
        assert_eq!(vocab["<|startoftext|>"], 49406);
        assert_eq!(vocab["<|endoftext|>"], 49407);
        assert_eq!(merges[0], ("i".to_string(), "n".to_string()));
        assert_eq!(vocab["in"], 512);
        let m = model().unwrap();
        assert_eq!(m.vocab_len(), 49408);
        assert_eq!(m.merges_len(), MERGES);
    }
}
