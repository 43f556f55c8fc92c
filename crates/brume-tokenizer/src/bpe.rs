//! The byte-level BPE model: vocabulary, ranked merges, and the merge loop for one pre-tokenized word.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::bytes::byte_table;

/// Suffix CLIP appends to the last symbol of every word.
pub const END_OF_WORD: &str = "</w>";

/// Vocabulary and merges. Immutable once built; shared between tokenizers through an `Arc`.
#[derive(Debug)]
pub struct BpeModel {
    vocab: HashMap<String, u32>,
    /// (left id, right id) -> (rank, id of the merged token). Lower rank merges first.
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// Id of the single-byte symbol for each byte (not at the end of a word).
    byte_ids: [Option<u32>; 256],
    /// Id of the single-byte symbol + `</w>` for each byte (the last symbol of a word).
    byte_eow_ids: [Option<u32>; 256],
}

/// Why a merge list entry cannot be used.
#[derive(Debug, PartialEq, Eq)]
pub enum MergeError {
    /// The token (left part, right part, or their concatenation) is not in the vocabulary.
    NotInVocab(String),
}

impl BpeModel {
    /// Build from a vocabulary and merges in rank order (first = highest priority). A pair listed twice keeps
    /// its last rank, as the `tokenizers` library does.
    pub fn new(
        vocab: HashMap<String, u32>,
        merges: &[(String, String)],
    ) -> Result<Self, (usize, MergeError)> {
        let mut merge_map = HashMap::with_capacity(merges.len());
        for (rank, (a, b)) in merges.iter().enumerate() {
            let lookup = |t: &str| {
                vocab
                    .get(t)
                    .copied()
                    .ok_or_else(|| (rank, MergeError::NotInVocab(t.to_owned())))
            };
            let a_id = lookup(a)?;
            let b_id = lookup(b)?;
            let merged = lookup(&format!("{a}{b}"))?;
            merge_map.insert((a_id, b_id), (rank as u32, merged));
        }
        let table = byte_table();
        let mut byte_ids = [None; 256];
        let mut byte_eow_ids = [None; 256];
        let mut buf = String::new();
        for b in 0..256 {
            buf.clear();
            buf.push(table[b]);
            byte_ids[b] = vocab.get(&buf).copied();
            buf.push_str(END_OF_WORD);
            byte_eow_ids[b] = vocab.get(&buf).copied();
        }
        Ok(Self {
            vocab,
            merges: merge_map,
            byte_ids,
            byte_eow_ids,
        })
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.vocab.get(token).copied()
    }

    pub fn vocab_len(&self) -> usize {
        self.vocab.len()
    }

    #[cfg(test)]
    pub fn merges_len(&self) -> usize {
        self.merges.len()
    }

    #[cfg(test)]
    pub fn vocab(&self) -> &HashMap<String, u32> {
        &self.vocab
    }

    /// BPE-encode one word given as raw UTF-8 bytes (each byte is one initial symbol, the last one carries
    /// `</w>`), appending the ids to `out`. A byte whose symbol is not in the vocabulary becomes `unk` (one per
    /// byte, like `tokenizers` with `fuse_unk = false`), or is dropped when there is no unk id.
    pub fn encode_word(&self, word: &[u8], unk: Option<u32>, out: &mut Vec<u32>) {
        #[derive(Clone, Copy)]
        struct Symbol {
            id: u32,
            prev: usize,
            next: usize,
            alive: bool,
        }
        const NONE: usize = usize::MAX;

        let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
        let last = word.len().saturating_sub(1);
        for (i, &b) in word.iter().enumerate() {
            let id = if i == last {
                self.byte_eow_ids[b as usize]
            } else {
                self.byte_ids[b as usize]
            };
            let Some(id) = id.or(unk) else { continue };
            let n = symbols.len();
            symbols.push(Symbol {
                id,
                prev: if n == 0 { NONE } else { n - 1 },
                next: NONE,
                alive: true,
            });
            if n > 0 {
                symbols[n - 1].next = n;
            }
        }
        if symbols.len() < 2 {
            out.extend(symbols.iter().map(|s| s.id));
            return;
        }

        // Min-heap on (rank, position): the lowest-ranked pair merges first, ties go to the leftmost pair.
        // Entries go stale when a neighbour changes; they are recognised by re-checking the pair.
        let mut heap: BinaryHeap<Reverse<(u32, usize, u32)>> = BinaryHeap::new();
        for i in 0..symbols.len() - 1 {
            if let Some(&(rank, new_id)) = self.merges.get(&(symbols[i].id, symbols[i + 1].id)) {
                heap.push(Reverse((rank, i, new_id)));
            }
        }
        while let Some(Reverse((_, pos, new_id))) = heap.pop() {
            let left = symbols[pos];
            if !left.alive || left.next == NONE {
                continue;
            }
            let right_pos = left.next;
            let right = symbols[right_pos];
            match self.merges.get(&(left.id, right.id)) {
                Some(&(_, id)) if id == new_id => {}
                _ => continue,
            }
            symbols[pos].id = new_id;
            symbols[pos].next = right.next;
            symbols[right_pos].alive = false;
            if right.next != NONE {
                symbols[right.next].prev = pos;
            }
            if left.prev != NONE {
                if let Some(&(rank, id)) = self.merges.get(&(symbols[left.prev].id, new_id)) {
                    heap.push(Reverse((rank, left.prev, id)));
                }
            }
            if right.next != NONE {
                if let Some(&(rank, id)) = self.merges.get(&(new_id, symbols[right.next].id)) {
                    heap.push(Reverse((rank, pos, id)));
                }
            }
        }
        out.extend(symbols.iter().filter(|s| s.alive).map(|s| s.id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::byte_to_char;

    /// A tiny vocabulary: all byte symbols (with and without `</w>`) plus the given merges' results.
    fn tiny(merges: &[(&str, &str)]) -> BpeModel {
        let mut vocab = HashMap::new();
        for b in 0..=255u8 {
            let c = byte_to_char(b).to_string();
            let n = vocab.len() as u32;
            vocab.insert(c.clone(), n);
            vocab.insert(format!("{c}</w>"), n + 1);
        }
        let merges: Vec<(String, String)> = merges
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        for (a, b) in &merges {
            let n = vocab.len() as u32;
            vocab.entry(format!("{a}{b}")).or_insert(n);
        }
        BpeModel::new(vocab, &merges).unwrap()
    }

    fn tokens(model: &BpeModel, word: &str) -> Vec<String> {
        let mut ids = Vec::new();
        model.encode_word(word.as_bytes(), None, &mut ids);
        let rev: HashMap<u32, &String> = model.vocab().iter().map(|(k, v)| (*v, k)).collect();
        ids.iter().map(|id| rev[id].clone()).collect()
    }

    #[test]
    fn no_merges_gives_bytes_with_end_of_word_on_the_last() {
        let m = tiny(&[]);
        assert_eq!(tokens(&m, "abc"), ["a", "b", "c</w>"]);
        assert_eq!(tokens(&m, "x"), ["x</w>"]);
        assert!(tokens(&m, "").is_empty());
    }

    #[test]
    fn merges_apply_by_rank_not_by_position() {
        // "b c</w>" ranks before "a b": abc -> a, bc</w> (and "a b" can no longer apply).
        let m = tiny(&[("b", "c</w>"), ("a", "b")]);
        assert_eq!(tokens(&m, "abc"), ["a", "bc</w>"]);
        let m = tiny(&[("a", "b"), ("b", "c</w>")]);
        assert_eq!(tokens(&m, "abc"), ["ab", "c</w>"]);
    }

    #[test]
    fn chained_merges_build_whole_words() {
        let m = tiny(&[
            ("h", "e"),
            ("l", "l"),
            ("l", "o</w>"),
            ("he", "ll"),
            ("hell", "o</w>"),
        ]);
        assert_eq!(tokens(&m, "hello"), ["hello</w>"]);
        // The same word not at the end of a word-suffix position does not get the final merge.
        assert_eq!(tokens(&m, "hellx"), ["hell", "x</w>"]);
    }

    #[test]
    fn equal_rank_pairs_merge_left_to_right_without_overlap() {
        let m = tiny(&[("a", "a")]);
        assert_eq!(tokens(&m, "aaa"), ["aa", "a</w>"]);
        assert_eq!(tokens(&m, "aaaab"), ["aa", "aa", "b</w>"]);
        let m = tiny(&[("a", "a"), ("aa", "aa")]);
        assert_eq!(tokens(&m, "aaaaa"), ["aaaa", "a</w>"]);
    }

    #[test]
    fn non_ascii_bytes_use_the_byte_alphabet() {
        // "é" is C3 A9 -> "Ã" "©</w>"
        let m = tiny(&[("Ã", "©</w>")]);
        assert_eq!(tokens(&m, "é"), ["Ã©</w>"]);
        assert_eq!(tokens(&m, "éé"), ["Ã", "©", "Ã©</w>"]);
    }

    #[test]
    fn missing_byte_symbols_become_unk_or_are_dropped() {
        let mut vocab = HashMap::new();
        vocab.insert("a".to_string(), 0);
        vocab.insert("a</w>".to_string(), 1);
        vocab.insert("<unk>".to_string(), 2);
        let m = BpeModel::new(vocab, &[]).unwrap();
        let mut ids = Vec::new();
        m.encode_word(b"aba", Some(2), &mut ids);
        assert_eq!(ids, [0, 2, 1]);
        ids.clear();
        m.encode_word(b"aba", None, &mut ids);
        assert_eq!(ids, [0, 1]);
    }

    #[test]
    fn merge_with_unknown_token_is_rejected() {
        let mut vocab = HashMap::new();
        vocab.insert("a".to_string(), 0);
        vocab.insert("b".to_string(), 1);
        let err = BpeModel::new(vocab, &[("a".into(), "b".into())]).unwrap_err();
        assert_eq!(err, (0, MergeError::NotInVocab("ab".into())));
    }

    #[test]
    fn long_words_are_fast() {
        let m = tiny(&[("a", "a"), ("aa", "aa"), ("aaaa", "aaaa")]);
        let word = "a".repeat(200_000);
        let mut ids = Vec::new();
        m.encode_word(word.as_bytes(), None, &mut ids);
        // 199_999 "a" + "a</w>": 24_999 x "aaaaaaaa", then "aaaa", "aa", "a", "a</w>" are left over.
        assert_eq!(ids.len(), 24_999 + 4);
    }
}
