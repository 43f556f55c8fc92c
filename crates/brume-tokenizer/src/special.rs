//! Special ("added") tokens: literal strings that are cut out of the text before it is tokenized and map to
//! one id. Matching is leftmost-longest, like the `tokenizers` library's Aho-Corasick matcher.

/// One special token, as the `tokenizers` backend holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialToken {
    pub content: String,
    pub id: u32,
    /// `true`: matched in the normalized (cleaned-up, lower-cased) text; `false`: matched in the raw text.
    pub normalized: bool,
}

/// A piece of text, or a special token found in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segment<'a> {
    Text(&'a str),
    Token(u32),
}

/// A set of literal patterns.
#[derive(Debug, Clone, Default)]
pub struct Matcher {
    patterns: Vec<(String, u32)>,
}

impl Matcher {
    pub fn new(patterns: impl IntoIterator<Item = (String, u32)>) -> Self {
        Self {
            patterns: patterns
                .into_iter()
                .filter(|(p, _)| !p.is_empty())
                .collect(),
        }
    }

    /// Cut `text` at every match (leftmost first; of the matches that start at the same place, the longest),
    /// calling `f` for each non-empty text piece and each token in order.
    pub fn split<'a>(&self, text: &'a str, mut f: impl FnMut(Segment<'a>)) {
        if self.patterns.is_empty() {
            f(Segment::Text(text));
            return;
        }
        // Next occurrence of each pattern at or after `pos` (cached, refreshed when passed).
        let find = |p: &str, from: usize| text[from..].find(p).map(|i| i + from);
        let mut next: Vec<Option<usize>> = self.patterns.iter().map(|(p, _)| find(p, 0)).collect();
        let mut pos = 0;
        loop {
            let mut best: Option<(usize, usize, u32)> = None; // (start, len, id)
            for (i, (p, id)) in self.patterns.iter().enumerate() {
                if let Some(start) = next[i] {
                    let start = if start < pos {
                        match find(p, pos) {
                            Some(s) => {
                                next[i] = Some(s);
                                s
                            }
                            None => {
                                next[i] = None;
                                continue;
                            }
                        }
                    } else {
                        start
                    };
                    let better = match best {
                        None => true,
                        Some((bs, bl, _)) => start < bs || (start == bs && p.len() > bl),
                    };
                    if better {
                        best = Some((start, p.len(), *id));
                    }
                }
            }
            match best {
                Some((start, len, id)) => {
                    if start > pos {
                        f(Segment::Text(&text[pos..start]));
                    }
                    f(Segment::Token(id));
                    pos = start + len;
                }
                None => {
                    if pos < text.len() {
                        f(Segment::Text(&text[pos..]));
                    }
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(m: &Matcher, s: &str) -> Vec<String> {
        let mut v = Vec::new();
        m.split(s, |seg| {
            v.push(match seg {
                Segment::Text(t) => format!("T({t})"),
                Segment::Token(id) => format!("#{id}"),
            })
        });
        v
    }

    #[test]
    fn splits_on_all_occurrences() {
        let m = Matcher::new([("<|endoftext|>".to_string(), 7)]);
        assert_eq!(run(&m, "a<|endoftext|>b"), ["T(a)", "#7", "T(b)"]);
        assert_eq!(run(&m, "<|endoftext|><|endoftext|>"), ["#7", "#7"]);
        assert_eq!(run(&m, "<<|endoftext|>>"), ["T(<)", "#7", "T(>)"]);
        assert_eq!(run(&m, "nothing"), ["T(nothing)"]);
        assert!(run(&m, "").is_empty());
    }

    #[test]
    fn leftmost_then_longest() {
        let m = Matcher::new([
            ("ab".to_string(), 1),
            ("abc".to_string(), 2),
            ("bcd".to_string(), 3),
        ]);
        assert_eq!(run(&m, "abcd"), ["#2", "T(d)"]);
        assert_eq!(run(&m, "xbcdab"), ["T(x)", "#3", "#1"]);
        let m = Matcher::new([("!".to_string(), 0)]);
        assert_eq!(run(&m, "a!!b!"), ["T(a)", "#0", "#0", "T(b)", "#0"]);
    }

    #[test]
    fn empty_patterns_are_ignored() {
        let m = Matcher::new([(String::new(), 1)]);
        assert_eq!(run(&m, "abc"), ["T(abc)"]);
    }
}
