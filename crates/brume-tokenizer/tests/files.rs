//! Loading from files: a tiny hand-made vocabulary, and errors that name the file.

use std::fs;
use std::path::Path;

use brume_tokenizer::{ClipTokenizer, PadToken, TokenizerError};

/// The byte-level character for an ASCII printable byte is the byte itself; for space (0x20) it is U+0120.
fn byte_tokens() -> Vec<String> {
    let mut chars: Vec<char> = (b'!'..=b'~').map(char::from).collect();
    chars.extend(
        (0xA1u32..=0xACu32)
            .chain(0xAEu32..=0xFFu32)
            .map(|c| char::from_u32(c).unwrap()),
    );
    chars.extend((256u32..256 + 68).map(|c| char::from_u32(c).unwrap()));
    let mut t: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    t.extend(chars.iter().map(|c| format!("{c}</w>")));
    t
}

/// Write a tiny vocabulary: 512 byte tokens, the merges' results, and the two CLIP special tokens.
fn write_tiny(dir: &Path, merges: &[(&str, &str)]) {
    let mut tokens = byte_tokens();
    for (a, b) in merges {
        tokens.push(format!("{a}{b}"));
    }
    tokens.push("<|startoftext|>".into());
    tokens.push("<|endoftext|>".into());
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), serde_json::Value::from(i as u64)))
        .collect();
    fs::write(
        dir.join("vocab.json"),
        serde_json::to_string(&vocab).unwrap(),
    )
    .unwrap();
    let mut m = String::from("#version: 0.2\n");
    for (a, b) in merges {
        m.push_str(&format!("{a} {b}\n"));
    }
    fs::write(dir.join("merges.txt"), m).unwrap();
}

const TINY_MERGES: [(&str, &str); 5] = [
    ("h", "e"),
    ("l", "l"),
    ("he", "ll"),
    ("hell", "o</w>"),
    ("c", "at</w>"),
];

#[test]
fn tiny_vocabulary_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    // "at</w>" must exist for the ("c", "at</w>") merge: add it as a merge of its own first
    let merges: Vec<(&str, &str)> = [("a", "t</w>")].into_iter().chain(TINY_MERGES).collect();
    write_tiny(dir.path(), &merges);
    let tok = ClipTokenizer::from_model_dir(dir.path()).unwrap();
    let id = |t: &str| tok.token_id(t).unwrap();
    let (sot, eot) = (id("<|startoftext|>"), id("<|endoftext|>"));
    assert_eq!((tok.bos_id(), tok.eos_id(), tok.pad_id()), (sot, eot, eot));
    assert_eq!(tok.vocab_size(), 512 + merges.len() + 2);
    assert_eq!(
        tok.encode("Hello, CAT!"),
        [
            sot,
            id("hello</w>"),
            id(",</w>"),
            id("cat</w>"),
            id("!</w>"),
            eot
        ]
    );
    assert_eq!(
        tok.encode("hellos"),
        [sot, id("hell"), id("o"), id("s</w>"), eot]
    );
    // bytes outside ASCII: "é" = C3 A9 -> "Ã" + "©</w>"
    assert_eq!(tok.encode("é"), [sot, id("Ã"), id("©</w>"), eot]);
    // a space inside a word cannot happen; a NBSP is whitespace and splits words
    assert_eq!(
        tok.encode("cat\u{a0}cat"),
        [sot, id("cat</w>"), id("cat</w>"), eot]
    );
    let padded = tok.encode_padded("cat");
    assert_eq!(padded.len(), 77);
    assert_eq!(&padded[..4], &[sot, id("cat</w>"), eot, eot]);

    let sd2 = ClipTokenizer::from_files(
        &dir.path().join("vocab.json"),
        &dir.path().join("merges.txt"),
        PadToken::Exclamation,
        8,
    )
    .unwrap();
    assert_eq!(sd2.pad_id(), id("!"));
    assert_eq!(
        sd2.encode_padded("cat!"),
        [
            sot,
            id("cat</w>"),
            id("!"),
            eot,
            id("!"),
            id("!"),
            id("!"),
            id("!")
        ]
    );
    assert_eq!(
        sd2.encode_padded("cat cat cat cat cat cat cat"),
        [
            sot,
            id("cat</w>"),
            id("cat</w>"),
            id("cat</w>"),
            id("cat</w>"),
            id("cat</w>"),
            id("cat</w>"),
            eot
        ]
    );
}

fn expect_err(r: Result<ClipTokenizer, TokenizerError>) -> TokenizerError {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

fn assert_names(e: &TokenizerError, file: &str, what: &str) {
    let msg = e.to_string();
    assert!(msg.contains(file), "error {msg:?} does not name {file}");
    assert!(msg.contains(what), "error {msg:?} does not say {what:?}");
}

#[test]
fn missing_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    // One of the pair present, the other missing: an error naming the missing one.
    write_tiny(dir.path(), &TINY_MERGES[..3]);
    fs::remove_file(dir.path().join("vocab.json")).unwrap();
    let e = expect_err(ClipTokenizer::from_model_dir(dir.path()));
    assert!(matches!(e, TokenizerError::Io { .. }));
    assert_names(&e, "vocab.json", "cannot read");

    write_tiny(dir.path(), &TINY_MERGES[..3]);
    fs::remove_file(dir.path().join("merges.txt")).unwrap();
    let e = expect_err(ClipTokenizer::from_model_dir(dir.path()));
    assert_names(&e, "merges.txt", "cannot read");

    let e = expect_err(ClipTokenizer::from_files(
        &dir.path().join("nope.json"),
        &dir.path().join("merges.txt"),
        PadToken::EndOfText,
        77,
    ));
    assert_names(&e, "nope.json", "cannot read");
}

#[test]
fn configs_without_vocabulary_files_use_the_embedded_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("special_tokens_map.json"), r#"{"pad_token": "!"}"#).unwrap();
    let tok = ClipTokenizer::from_model_dir(dir.path()).unwrap();
    let builtin = ClipTokenizer::builtin(PadToken::Exclamation);
    assert_eq!(tok.pad_id(), 0);
    assert_eq!(tok.vocab_size(), builtin.vocab_size());
    assert_eq!(tok.encode_padded("a photo of a cat!"), builtin.encode_padded("a photo of a cat!"));
}

#[test]
fn corrupt_vocab_json_is_named() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny(dir.path(), &TINY_MERGES[..3]);
    fs::write(dir.path().join("vocab.json"), "{\"a\": 0, ").unwrap();
    let e = expect_err(ClipTokenizer::from_model_dir(dir.path()));
    assert!(matches!(e, TokenizerError::Json { .. }));
    assert_names(&e, "vocab.json", "invalid JSON");

    fs::write(dir.path().join("vocab.json"), "[1, 2, 3]").unwrap();
    assert_names(
        &expect_err(ClipTokenizer::from_model_dir(dir.path())),
        "vocab.json",
        "JSON object",
    );

    fs::write(dir.path().join("vocab.json"), "{\"a\": -1}").unwrap();
    assert_names(
        &expect_err(ClipTokenizer::from_model_dir(dir.path())),
        "vocab.json",
        "\"a\"",
    );
}

#[test]
fn malformed_merges_line_is_named_with_its_line_number() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny(dir.path(), &TINY_MERGES[..3]);
    fs::write(dir.path().join("merges.txt"), "#version: 0.2\nh e\nl l l\n").unwrap();
    let e = expect_err(ClipTokenizer::from_model_dir(dir.path()));
    assert!(matches!(e, TokenizerError::Invalid { .. }));
    assert_names(&e, "merges.txt", "line 3");

    fs::write(dir.path().join("merges.txt"), "h e\n\nl l\n").unwrap();
    assert_names(
        &expect_err(ClipTokenizer::from_model_dir(dir.path())),
        "merges.txt",
        "line 2",
    );

    // a merge whose parts or result are not in the vocabulary
    fs::write(dir.path().join("merges.txt"), "#version: 0.2\nh e\nx y\n").unwrap();
    let e = expect_err(ClipTokenizer::from_model_dir(dir.path()));
    assert_names(&e, "merges.txt", "line 3");
    assert_names(&e, "merges.txt", "\"xy\"");
}

#[test]
fn corrupt_configs_are_named() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny(dir.path(), &TINY_MERGES[..3]);
    fs::write(dir.path().join("tokenizer_config.json"), "{not json").unwrap();
    let e = expect_err(ClipTokenizer::from_model_dir(dir.path()));
    assert_names(&e, "tokenizer_config.json", "invalid JSON");

    fs::write(
        dir.path().join("tokenizer_config.json"),
        "{\"model_max_length\": 77}",
    )
    .unwrap();
    fs::write(
        dir.path().join("special_tokens_map.json"),
        "{\"pad_token\": 3}",
    )
    .unwrap();
    let e = expect_err(ClipTokenizer::from_model_dir(dir.path()));
    assert_names(&e, "special_tokens_map.json", "pad_token");

    // a pad token that is neither in the vocabulary nor addable is impossible (it gets a new id), but bos must exist
    fs::write(
        dir.path().join("special_tokens_map.json"),
        "{\"pad_token\": \"<pad>\"}",
    )
    .unwrap();
    let tok = ClipTokenizer::from_model_dir(dir.path()).unwrap();
    assert_eq!(tok.pad_id() as usize, tok.vocab_size() - 1);
    assert_eq!(tok.encode_padded("")[2], tok.pad_id());
}

#[test]
fn from_files_rejects_impossible_lengths() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny(dir.path(), &TINY_MERGES[..3]);
    let e = expect_err(ClipTokenizer::from_files(
        &dir.path().join("vocab.json"),
        &dir.path().join("merges.txt"),
        PadToken::EndOfText,
        1,
    ));
    assert_names(&e, "vocab.json", "max_length");
}
