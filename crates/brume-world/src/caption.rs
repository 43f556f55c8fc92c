//! Caption grammar: generation from a scene (with paraphrases) and parsing back to a [`Spec`].
//!
//! The grammar is small and closed on purpose: every generated caption must parse back to exactly
//! the spec it was generated from (tested exhaustively over templates and synonyms), and the judge
//! must grade an image against a caption it may never have seen, so unknown words are an error
//! rather than silently ignored.
//!
//! ```text
//! caption    := [prefix] objects "on" background | [prefix] background "with" objects
//! prefix     := "there is" | "a picture of" | "an image of"
//! objects    := object [position] | object relation object
//! object     := ("a"|"an") [size] colour shape
//! size       := "small" | "little" | "tiny" | "large" | "big"
//! position   := "on the left" | "on the right" | "at the top" | "at the bottom"
//!             | "in the centre" | "in the center" | "in the middle"
//!             | ("in"|"at") "the" ("top"|"bottom") ("left"|"right") ["corner"]
//! relation   := ["to" "the"] ("left"|"right") "of" | "above" | "below"
//! background := ("a"|"an") ["plain"] colour [("gradient"|"striped"|"checkered")] "background"
//! ```
//! Case, commas, hyphens and a final full stop are ignored; "grey" spells gray.

use crate::colour::Colour;
use crate::rng::{mix, Rng};
use crate::scene::{BackgroundSpec, BgKind, Layout, ObjectSpec, Position, Relation, Scene, Shape, Size, Spec};

/// Number of sentence templates ([`caption_spec`] picks one from the template seed).
pub const TEMPLATES: usize = 4;

/// Caption of a scene. `template_seed` picks the template and synonyms, deterministically.
pub fn caption(scene: &Scene, template_seed: u64) -> String {
    caption_spec(&scene.spec(), template_seed)
}

fn article(next_word: &str) -> &'static str {
    if next_word.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    }
}

fn object_phrase(o: &ObjectSpec, rng: &mut Rng) -> String {
    let mut words = Vec::new();
    if let Some(s) = o.size {
        let syn = rng.chance(0.3);
        words.push(match (s, syn) {
            (Size::Small, false) => "small",
            (Size::Small, true) => "little",
            (Size::Large, false) => "large",
            (Size::Large, true) => "big",
        });
    }
    words.push(o.colour.name());
    words.push(o.shape.name());
    format!("{} {}", article(words[0]), words.join(" "))
}

fn position_phrase(p: Position, rng: &mut Rng) -> String {
    match p {
        Position::Left => "on the left".into(),
        Position::Right => "on the right".into(),
        Position::Top => "at the top".into(),
        Position::Bottom => "at the bottom".into(),
        Position::Centre => rng.pick(&["in the centre", "in the center", "in the middle"]).into(),
        corner => {
            if rng.chance(0.5) {
                format!("in the {} corner", corner.name())
            } else {
                format!("at the {}", corner.name())
            }
        }
    }
}

fn relation_phrase(r: Relation, rng: &mut Rng) -> &'static str {
    let short = rng.chance(0.3);
    match (r, short) {
        (Relation::LeftOf, false) => "to the left of",
        (Relation::LeftOf, true) => "left of",
        (Relation::RightOf, false) => "to the right of",
        (Relation::RightOf, true) => "right of",
        (Relation::Above, _) => "above",
        (Relation::Below, _) => "below",
    }
}

fn background_phrase(b: &BackgroundSpec, rng: &mut Rng) -> String {
    let words = match b.kind {
        BgKind::Plain if rng.chance(0.2) => format!("plain {}", b.colour),
        BgKind::Plain => b.colour.to_string(),
        k => format!("{} {}", b.colour, k.name()),
    };
    format!("{} {} background", article(&words), words)
}

/// Caption of a spec (sizes/positions that are `None` are simply not mentioned).
pub fn caption_spec(spec: &Spec, template_seed: u64) -> String {
    let mut rng = Rng::new(mix(template_seed, 0xCA97_1011));
    let template = rng.below(TEMPLATES);
    let objects = match spec.layout {
        Layout::Single(p) => {
            let o = object_phrase(&spec.objects[0], &mut rng);
            match p {
                Some(p) => format!("{o} {}", position_phrase(p, &mut rng)),
                None => o,
            }
        }
        Layout::Pair(r) => {
            let a = object_phrase(&spec.objects[0], &mut rng);
            let rel = relation_phrase(r, &mut rng);
            let b = object_phrase(&spec.objects[1], &mut rng);
            format!("{a} {rel} {b}")
        }
    };
    let bg = background_phrase(&spec.background, &mut rng);
    match template {
        0 => format!("{objects} on {bg}"),
        1 => format!("{bg} with {objects}"),
        2 => format!("there is {objects} on {bg}"),
        _ => format!("a picture of {objects} on {bg}"),
    }
}

/// Why a caption did not parse. Token indices count words after normalisation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParseError {
    Empty,
    /// A word outside the grammar's vocabulary.
    UnknownWord { word: String, index: usize },
    /// Known words in an order the grammar does not allow.
    Unexpected { expected: &'static str, found: Option<String>, index: usize },
    /// Grammatical, but violates the world's rules (e.g. an object coloured like the background).
    Invalid(String),
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ParseError::Empty => write!(f, "empty caption"),
            ParseError::UnknownWord { word, index } => write!(f, "unknown word {word:?} (word {})", index + 1),
            ParseError::Unexpected { expected, found: Some(w), index } => {
                write!(f, "expected {expected}, found {w:?} (word {})", index + 1)
            }
            ParseError::Unexpected { expected, found: None, .. } => {
                write!(f, "expected {expected}, found end of caption")
            }
            ParseError::Invalid(m) => write!(f, "invalid scene: {m}"),
        }
    }
}

impl std::error::Error for ParseError {}

const FUNCTION_WORDS: &[&str] = &[
    "a", "an", "the", "there", "is", "picture", "image", "of", "with", "on", "at", "in", "to", "corner",
    "background", "plain", "left", "right", "top", "bottom", "centre", "center", "middle", "above", "below",
    "small", "little", "tiny", "large", "big", "gradient", "striped", "checkered",
];

fn known(w: &str) -> bool {
    FUNCTION_WORDS.contains(&w) || Colour::from_word(w).is_some() || Shape::ALL.iter().any(|s| s.name() == w)
}

struct Parser {
    toks: Vec<String>,
    i: usize,
}

type PResult<T> = Result<T, ParseError>;

impl Parser {
    fn peek(&self, k: usize) -> Option<&str> {
        self.toks.get(self.i + k).map(|s| s.as_str())
    }

    fn at_seq(&self, words: &[&str]) -> bool {
        words.iter().enumerate().all(|(k, w)| self.peek(k) == Some(w))
    }

    fn accept_seq(&mut self, words: &[&str]) -> bool {
        let ok = self.at_seq(words);
        if ok {
            self.i += words.len();
        }
        ok
    }

    fn fail<T>(&self, expected: &'static str) -> PResult<T> {
        Err(ParseError::Unexpected { expected, found: self.peek(0).map(str::to_string), index: self.i })
    }

    fn expect(&mut self, word: &'static str) -> PResult<()> {
        if self.accept_seq(&[word]) {
            Ok(())
        } else {
            self.fail(word)
        }
    }

    fn article(&mut self) -> PResult<()> {
        if self.accept_seq(&["a"]) || self.accept_seq(&["an"]) {
            Ok(())
        } else {
            self.fail("\"a\" or \"an\"")
        }
    }

    fn colour(&mut self) -> PResult<Colour> {
        match self.peek(0).and_then(Colour::from_word) {
            Some(c) => {
                self.i += 1;
                Ok(c)
            }
            None => self.fail("a colour"),
        }
    }

    fn object(&mut self) -> PResult<ObjectSpec> {
        self.article()?;
        let size = match self.peek(0) {
            Some("small" | "little" | "tiny") => Some(Size::Small),
            Some("large" | "big") => Some(Size::Large),
            _ => None,
        };
        if size.is_some() {
            self.i += 1;
        }
        let colour = self.colour()?;
        let shape = match self.peek(0).and_then(|w| Shape::ALL.iter().find(|s| s.name() == w)) {
            Some(&s) => s,
            None => return self.fail("a shape"),
        };
        self.i += 1;
        Ok(ObjectSpec { shape, colour, size })
    }

    /// True if the tokens from here form a background phrase's start (`a [plain] colour [kind] background`).
    fn at_background(&self) -> bool {
        let mut k = 1;
        if self.peek(k) == Some("plain") {
            k += 1;
        }
        matches!(self.peek(0), Some("a" | "an"))
            && self.peek(k).and_then(Colour::from_word).is_some()
            && (self.peek(k + 1) == Some("background")
                || (matches!(self.peek(k + 1), Some("gradient" | "striped" | "checkered"))
                    && self.peek(k + 2) == Some("background")))
    }

    fn background(&mut self) -> PResult<BackgroundSpec> {
        self.article()?;
        let plain = self.accept_seq(&["plain"]);
        let colour = self.colour()?;
        let kind = match self.peek(0) {
            Some("gradient") => BgKind::Gradient,
            Some("striped") => BgKind::Striped,
            Some("checkered") => BgKind::Checkered,
            _ => BgKind::Plain,
        };
        if kind != BgKind::Plain {
            if plain {
                return Err(ParseError::Invalid(format!("a background cannot be both plain and {}", kind.name())));
            }
            self.i += 1;
        }
        self.expect("background")?;
        Ok(BackgroundSpec { colour, kind })
    }

    fn position(&mut self) -> Option<Position> {
        let simple = [
            (&["on", "the", "left"][..], Position::Left),
            (&["on", "the", "right"][..], Position::Right),
            (&["in", "the", "centre"][..], Position::Centre),
            (&["in", "the", "center"][..], Position::Centre),
            (&["in", "the", "middle"][..], Position::Centre),
        ];
        for (words, p) in simple {
            if self.accept_seq(words) {
                return Some(p);
            }
        }
        for lead in ["in", "at"] {
            for (v, vp) in [("top", 0u8), ("bottom", 2u8)] {
                for (h, hp) in [("left", 0u8), ("right", 2u8)] {
                    if self.accept_seq(&[lead, "the", v, h]) {
                        self.accept_seq(&["corner"]);
                        return Some(Position::from_cell(hp, vp));
                    }
                }
            }
        }
        if self.accept_seq(&["at", "the", "top"]) {
            return Some(Position::Top);
        }
        if self.accept_seq(&["at", "the", "bottom"]) {
            return Some(Position::Bottom);
        }
        None
    }

    fn relation(&mut self) -> Option<Relation> {
        for (words, r) in [
            (&["to", "the", "left", "of"][..], Relation::LeftOf),
            (&["left", "of"][..], Relation::LeftOf),
            (&["to", "the", "right", "of"][..], Relation::RightOf),
            (&["right", "of"][..], Relation::RightOf),
            (&["above"][..], Relation::Above),
            (&["below"][..], Relation::Below),
        ] {
            if self.accept_seq(words) {
                return Some(r);
            }
        }
        None
    }

    fn objects(&mut self) -> PResult<(Vec<ObjectSpec>, Layout)> {
        let a = self.object()?;
        if let Some(r) = self.relation() {
            let b = self.object()?;
            return Ok((vec![a, b], Layout::Pair(r)));
        }
        Ok((vec![a], Layout::Single(self.position())))
    }
}

/// Parses a caption of the grammar above back into the spec it asserts.
pub fn parse_caption(text: &str) -> Result<Spec, ParseError> {
    let norm: String = text
        .to_lowercase()
        .chars()
        .map(|c| if matches!(c, ',' | '-' | '.' | ';') { ' ' } else { c })
        .collect();
    let toks: Vec<String> = norm.split_whitespace().map(str::to_string).collect();
    if toks.is_empty() {
        return Err(ParseError::Empty);
    }
    if let Some((index, w)) = toks.iter().enumerate().find(|(_, w)| !known(w)) {
        return Err(ParseError::UnknownWord { word: w.clone(), index });
    }
    let mut p = Parser { toks, i: 0 };
    let _ = p.accept_seq(&["there", "is"]) || p.accept_seq(&["a", "picture", "of"]) || p.accept_seq(&["an", "image", "of"]);
    let (background, (objects, layout)) = if p.at_background() {
        let bg = p.background()?;
        p.expect("with")?;
        (bg, p.objects()?)
    } else {
        let objs = p.objects()?;
        if !p.accept_seq(&["on"]) {
            return p.fail("a position, a relation or \"on\" and a background");
        }
        (p.background()?, objs)
    };
    if p.i != p.toks.len() {
        return p.fail("end of caption");
    }
    let spec = Spec { background, objects, layout };
    spec.validate().map_err(ParseError::Invalid)?;
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scene::{sample_scene, SampleConfig};

    #[test]
    fn generated_captions_round_trip() {
        let cfg = SampleConfig::default();
        let mut templates = std::collections::HashSet::new();
        for seed in 0..5000u64 {
            let scene = sample_scene(seed, &cfg);
            for t in 0..4u64 {
                let c = caption(&scene, seed * 7 + t);
                let spec = parse_caption(&c).unwrap_or_else(|e| panic!("{c:?}: {e}"));
                assert_eq!(spec, scene.spec(), "{c:?}");
                templates.insert(c.split(' ').take(2).collect::<Vec<_>>().join(" "));
            }
        }
        assert!(templates.len() >= 4);
    }

    #[test]
    fn examples_parse() {
        let s = parse_caption("a large red circle on the left on a blue background").unwrap();
        assert_eq!(s.objects, vec![ObjectSpec { shape: Shape::Circle, colour: Colour::Red, size: Some(Size::Large) }]);
        assert_eq!(s.layout, Layout::Single(Some(Position::Left)));
        assert_eq!(s.background, BackgroundSpec { colour: Colour::Blue, kind: BgKind::Plain });

        let s = parse_caption("A small yellow star above a green square on a white background.").unwrap();
        assert_eq!(s.layout, Layout::Pair(Relation::Above));
        assert_eq!(s.objects[0].shape, Shape::Star);
        assert_eq!(s.objects[1].colour, Colour::Green);

        let s = parse_caption("a grey checkered background with a tiny pink ring in the top-left corner").unwrap();
        assert_eq!(s.background, BackgroundSpec { colour: Colour::Gray, kind: BgKind::Checkered });
        assert_eq!(s.layout, Layout::Single(Some(Position::TopLeft)));
        assert_eq!(s.objects[0].size, Some(Size::Small));

        // Size and position may be left unsaid by people; the judge then skips them.
        let s = parse_caption("an orange cross on a black striped background").unwrap();
        assert_eq!(s.objects[0].size, None);
        assert_eq!(s.layout, Layout::Single(None));
        assert_eq!(s.background.kind, BgKind::Striped);
    }

    #[test]
    fn errors_are_clear() {
        assert_eq!(parse_caption("  "), Err(ParseError::Empty));
        assert_eq!(
            parse_caption("a red hexagon on a blue background"),
            Err(ParseError::UnknownWord { word: "hexagon".into(), index: 2 })
        );
        assert_eq!(
            parse_caption("a large red circle floating on a blue background"),
            Err(ParseError::UnknownWord { word: "floating".into(), index: 4 })
        );
        let e = parse_caption("a red circle on the left").unwrap_err();
        assert!(matches!(e, ParseError::Unexpected { found: None, .. }), "{e:?}");
        assert!(e.to_string().contains("end of caption"), "{e}");
        let e = parse_caption("a red on a blue background").unwrap_err();
        assert!(matches!(e, ParseError::Unexpected { expected: "a shape", .. }), "{e:?}");
        let e = parse_caption("a red circle on a red background").unwrap_err();
        assert!(matches!(e, ParseError::Invalid(_)), "{e:?}");
        let e = parse_caption("a red circle on a blue background with a green star").unwrap_err();
        assert!(matches!(e, ParseError::Unexpected { expected: "end of caption", .. }), "{e:?}");
        let e = parse_caption("a plain blue striped background with a red star").unwrap_err();
        assert!(matches!(e, ParseError::Invalid(_)), "{e:?}");
    }
}
