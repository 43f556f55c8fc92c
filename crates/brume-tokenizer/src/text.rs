//! Text cleanup (normalizer) and word splitting (pre-tokenizer), as transformers 5.x `CLIPTokenizer` configures
//! its `tokenizers` backend. See the crate documentation for the rules and their origin.

use std::sync::OnceLock;

use regex::Regex;
use unicode_normalization_alignments::UnicodeNormalization;

/// `\s+`: runs of Unicode `White_Space` characters (the same set as Oniguruma's `\s` used by `tokenizers`).
fn whitespace_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"\s+").expect("valid regex"))
}

/// CLIP's word pattern; the text between matches (only spaces after normalization) is dropped.
fn clip_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(
            r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+",
        )
        .expect("valid regex")
    })
}

/// GPT-2's pattern, applied by the `ByteLevel` pre-tokenizer (`use_regex = true`) to every CLIP word. Its
/// original ends in `\s+(?!\S)|\s+`; CLIP words never contain whitespace, so the look-ahead alternative (which
/// the `regex` crate does not support) can never matter and `\s+` stands for both.
fn gpt2_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+")
            .expect("valid regex")
    })
}

/// NFC (Unicode 9.0 tables, as `tokenizers`), every run of whitespace to one space, then per-character
/// lower-casing (`char::to_lowercase`, so no final-sigma rule).
pub fn normalize(text: &str) -> String {
    let nfc: String;
    let text = if text.is_ascii() {
        text // ASCII is always in NFC
    } else {
        nfc = text.nfc().map(|(c, _)| c).collect();
        &nfc
    };
    let collapsed = whitespace_re().replace_all(text, " ");
    let mut out = String::with_capacity(collapsed.len());
    for c in collapsed.chars() {
        if c.is_ascii() {
            out.push(c.to_ascii_lowercase());
        } else {
            out.extend(c.to_lowercase());
        }
    }
    out
}

/// Split normalized text into the words that are BPE-encoded one by one (each with its own `</w>`).
pub fn for_each_word<'a>(normalized: &'a str, mut f: impl FnMut(&'a str)) {
    for m in clip_re().find_iter(normalized) {
        let word = m.as_str();
        // Only the literal special-token strings ("<|startoftext|>" -> "<|", "startoftext", "|>") are split
        // further by GPT-2's pattern; run it on every word anyway so nothing depends on that analysis.
        for sub in gpt2_re().find_iter(word) {
            f(sub.as_str());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<&str> {
        let mut v = Vec::new();
        for_each_word(s, |w| v.push(w));
        v
    }

    #[test]
    fn normalize_collapses_whitespace_and_lowercases() {
        assert_eq!(normalize("  A\t\tB \n"), " a b ");
        assert_eq!(normalize("a\u{a0}b\u{3000}c\u{85}d\u{2028}e"), "a b c d e");
        // not White_Space: kept
        assert_eq!(
            normalize("a\u{200b}b\u{180e}c\u{1c}d"),
            "a\u{200b}b\u{180e}c\u{1c}d"
        );
    }

    #[test]
    fn normalize_is_nfc_then_per_char_lowercase() {
        assert_eq!(normalize("Cafe\u{301}"), "caf\u{e9}");
        assert_eq!(normalize("\u{212b}"), "\u{e5}"); // ANGSTROM SIGN -> å
        assert_eq!(normalize("\u{2126}"), "\u{3c9}"); // OHM SIGN -> ω
        assert_eq!(normalize("ΟΔΟΣ"), "οδοσ"); // no final sigma
        assert_eq!(normalize("İ"), "i\u{307}");
        assert_eq!(normalize("ẞ"), "ß");
        assert_eq!(normalize("\u{1100}\u{1161}"), "\u{ac00}"); // Hangul jamo compose
    }

    #[test]
    fn nfc_uses_unicode_9_tables() {
        // Dives Akuru (Unicode 13) has a canonical composition that Unicode 9 tables do not know.
        assert_eq!(normalize("\u{11935}\u{11930}"), "\u{11935}\u{11930}");
    }

    #[test]
    fn words_follow_clip_pattern() {
        assert_eq!(words("a photo of a cat"), ["a", "photo", "of", "a", "cat"]);
        assert_eq!(words("it's we're"), ["it", "'s", "we", "'re"]);
        assert_eq!(words("12.5"), ["1", "2", ".", "5"]);
        assert_eq!(words("!!'s ''s"), ["!!'", "s", "''", "s"]);
        assert_eq!(
            words("(masterpiece:1.2)"),
            ["(", "masterpiece", ":", "1", ".", "2", ")"]
        );
        assert_eq!(words("it’s"), ["it", "’", "s"]);
        assert_eq!(words("<|startoftext|>x"), ["<|", "startoftext", "|>", "x"]);
        assert_eq!(words("हिन्दी"), ["ह", "ि", "न", "्", "द", "ी"]);
        assert!(words(" ").is_empty());
        assert!(words("").is_empty());
    }
}
