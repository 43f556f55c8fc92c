//! No input string makes the tokenizer panic, and the padded output always has the fixed shape.

use std::sync::Arc;
use std::time::Instant;

use brume_tokenizer::{ClipTokenizer, PadToken};

fn check_shape(tok: &ClipTokenizer, text: &str) {
    let ids = tok.encode(text);
    assert!(ids.len() >= 2);
    assert_eq!(ids[0], tok.bos_id());
    assert_eq!(*ids.last().unwrap(), tok.eos_id());
    let padded = tok.encode_padded(text);
    assert_eq!(padded.len(), tok.max_length());
    assert_eq!(padded[0], tok.bos_id());
    assert!(padded.iter().all(|&id| (id as usize) < tok.vocab_size()));
    let n = ids.len().min(tok.max_length());
    assert_eq!(padded[n - 1], tok.eos_id());
    if ids.len() <= tok.max_length() {
        assert_eq!(&padded[..ids.len()], &ids[..]);
        assert!(padded[ids.len()..].iter().all(|&id| id == tok.pad_id()));
    } else {
        assert_eq!(&padded[..n - 1], &ids[..n - 1]);
    }
}

/// Deterministic xorshift so the test needs no extra crates.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn odd_inputs_never_panic() {
    for pad in [PadToken::EndOfText, PadToken::Exclamation] {
        let tok = ClipTokenizer::builtin(pad);
        let fixed = [
            "",
            " ",
            "\t\n\r\u{b}\u{c}\u{85}\u{a0}\u{2028}\u{3000}",
            "\0",
            "\0\0\0\u{1}\u{7f}\u{9f}",
            "\u{feff}\u{200b}\u{200d}\u{2060}",
            "\u{301}\u{301}\u{301}",
            "\u{10ffff}\u{fffe}\u{ffff}\u{e000}",
            "<|endoftext|>",
            "<|startoftext|><|endoftext|>",
            "<|",
            "|>",
            "'",
            "''''''",
            "!",
            "İİİ",
            "ﷺ ﷻ",
            "\u{1f3f4}\u{e0067}\u{e0062}\u{e0073}\u{e0063}\u{e0074}\u{e007f}",
        ];
        for s in fixed {
            check_shape(&tok, s);
        }
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for _ in 0..2000 {
            let len = (rng.next() % 40) as usize;
            let s: String = (0..len)
                .filter_map(|_| {
                    let r = rng.next();
                    let cp = match r % 6 {
                        0 => (r >> 8) % 0x80,
                        1 => (r >> 8) % 0x800,
                        2 => (r >> 8) % 0x10000,
                        3 => (r >> 8) % 0x110000,
                        4 => [0x20, 0x21, 0x27, 0x3c, 0x7c, 0x3e, 0x301, 0x130, 0x3a3]
                            [(r >> 8) as usize % 9],
                        _ => 0x61 + (r >> 8) % 26,
                    };
                    char::from_u32(cp as u32)
                })
                .collect();
            check_shape(&tok, &s);
        }
    }
}

#[test]
fn huge_inputs_are_handled_in_reasonable_time() {
    let tok = ClipTokenizer::builtin(PadToken::EndOfText);
    let inputs = [
        "a".repeat(1 << 20),       // one 1 MiB word
        "word ".repeat(200_000),   // 1 MB of short words
        "!".repeat(1 << 20),       // one 1 MiB punctuation run
        "\u{301}".repeat(300_000), // combining marks only
        "🐱".repeat(200_000),
        " ".repeat(1 << 20),
        "<|endoftext|>".repeat(50_000),
        "猫 ".repeat(200_000),
    ];
    for s in &inputs {
        let t = Instant::now();
        check_shape(&tok, s);
        let secs = t.elapsed().as_secs_f64();
        assert!(secs < 20.0, "{} bytes took {secs:.1}s", s.len());
    }
    assert_eq!(tok.encode(&" ".repeat(1000)), [49406, 49407]);
}

#[test]
fn shared_between_threads() {
    let tok = Arc::new(ClipTokenizer::builtin(PadToken::EndOfText));
    let expected = tok.encode_padded("a photo of an astronaut riding a horse on mars");
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let tok = Arc::clone(&tok);
            std::thread::spawn(move || {
                for j in 0..200 {
                    let _ = tok.encode(&format!("prompt {i} {j} with words {}", j % 7));
                }
                tok.encode_padded("a photo of an astronaut riding a horse on mars")
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), expected);
    }
}

#[test]
fn builtin_tokenizers_share_one_model() {
    // The first call decompresses and builds the vocabulary (tens of milliseconds); later calls reuse it.
    let _warm = ClipTokenizer::builtin(PadToken::EndOfText);
    let t = Instant::now();
    for i in 0..200 {
        let pad = if i % 2 == 0 {
            PadToken::EndOfText
        } else {
            PadToken::Exclamation
        };
        assert_eq!(ClipTokenizer::builtin(pad).vocab_size(), 49408);
    }
    let secs = t.elapsed().as_secs_f64();
    assert!(
        secs < 2.0,
        "200 builtin() calls took {secs:.2}s: the model is not shared"
    );
}
