//! Scene vocabulary, the caption-level [`Spec`], concrete [`Scene`] geometry, sampling, and the
//! held-out split.
//!
//! A `Spec` is exactly what a caption says (it is what `parse_caption` returns and what the judge
//! grades against); a `Scene` adds the geometry a renderer needs (centres, radii, texture
//! orientation). Keeping the two apart lets the judge grade *any* image against *any* caption.

use crate::colour::Colour;
use crate::rng::{hash_str, mix, Rng};

macro_rules! word_enum {
    ($(#[$m:meta])* $name:ident { $($var:ident => $word:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name { $($var),+ }
        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$var),+];
            /// The canonical caption word(s).
            pub fn name(self) -> &'static str { match self { $($name::$var => $word),+ } }
        }
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.write_str(self.name()) }
        }
    };
}

word_enum!(
    /// Object shapes. All are drawn upright and axis-aligned with the same half-extent `r`
    /// (bounding box `2r` on its longer side), so size is comparable across shapes.
    Shape { Circle => "circle", Square => "square", Triangle => "triangle", Star => "star",
            Ring => "ring", Cross => "cross", Diamond => "diamond" });
word_enum!(
    /// Two sizes with a wide gap between them (half-extent 9–12% vs 19–22% of the image side).
    Size { Small => "small", Large => "large" });
word_enum!(
    /// Where a lone object sits: a 3×3 grid of anchors.
    Position { Left => "left", Right => "right", Top => "top", Bottom => "bottom", Centre => "centre",
               TopLeft => "top left", TopRight => "top right", BottomLeft => "bottom left",
               BottomRight => "bottom right" });
word_enum!(
    /// How the first object of a pair sits relative to the second.
    Relation { LeftOf => "left of", RightOf => "right of", Above => "above", Below => "below" });
word_enum!(
    /// Background texture; the background's colour is its dominant (and first) tone.
    BgKind { Plain => "plain", Gradient => "gradient", Striped => "striped", Checkered => "checkered" });

impl Position {
    /// Grid cell as (column, row), each in 0..3.
    pub fn cell(self) -> (u8, u8) {
        match self {
            Position::TopLeft => (0, 0),
            Position::Top => (1, 0),
            Position::TopRight => (2, 0),
            Position::Left => (0, 1),
            Position::Centre => (1, 1),
            Position::Right => (2, 1),
            Position::BottomLeft => (0, 2),
            Position::Bottom => (1, 2),
            Position::BottomRight => (2, 2),
        }
    }

    pub fn from_cell(col: u8, row: u8) -> Position {
        *Position::ALL.iter().find(|p| p.cell() == (col, row)).expect("cell in 0..3")
    }

    /// Anchor of the cell's centre as fractions of the image (0.25, 0.5 or 0.75).
    pub fn anchor(self) -> (f64, f64) {
        let (c, r) = self.cell();
        (0.25 + 0.25 * c as f64, 0.25 + 0.25 * r as f64)
    }
}

/// Caption-level description of one object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ObjectSpec {
    pub shape: Shape,
    pub colour: Colour,
    /// `None` when a (user-written) caption does not say; generated captions always do.
    pub size: Option<Size>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackgroundSpec {
    pub colour: Colour,
    pub kind: BgKind,
}

/// Spatial part of a spec: one object with an (optional) absolute position, or two objects with
/// the relation of the first to the second.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    Single(Option<Position>),
    Pair(Relation),
}

/// Everything a caption asserts, and nothing more.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Spec {
    pub background: BackgroundSpec,
    pub objects: Vec<ObjectSpec>,
    pub layout: Layout,
}

impl Spec {
    /// Checks the world's invariants: 1 object with `Single`, 2 with `Pair`, and no object sharing
    /// the background's colour (the judge could not tell such an object from the background).
    pub fn validate(&self) -> Result<(), String> {
        let want = match self.layout {
            Layout::Single(_) => 1,
            Layout::Pair(_) => 2,
        };
        if self.objects.len() != want {
            return Err(format!("layout needs {want} object(s), caption has {}", self.objects.len()));
        }
        for o in &self.objects {
            if o.colour == self.background.colour {
                return Err(format!("the {} {} has the background's colour", o.colour, o.shape));
            }
        }
        Ok(())
    }

    /// A canonical, template-independent string for the spec. The held-out split hashes this, so
    /// it must never change (it is pinned by a test).
    pub fn key(&self) -> String {
        let mut k = format!("bg={}/{}", self.background.colour, self.background.kind);
        for o in &self.objects {
            let size = o.size.map_or("any", |s| s.name());
            k += &format!(";obj={}/{}/{}", size, o.colour, o.shape);
        }
        match self.layout {
            Layout::Single(p) => k += &format!(";pos={}", p.map_or("any", |p| p.name())),
            Layout::Pair(r) => k += &format!(";rel={r}"),
        }
        k
    }

    /// The full spec as JSON (for `captions.jsonl` and tools outside Rust).
    pub fn to_json(&self) -> serde_json::Value {
        let objects: Vec<_> = self
            .objects
            .iter()
            .map(|o| {
                serde_json::json!({
                    "shape": o.shape.name(),
                    "colour": o.colour.name(),
                    "size": o.size.map(|s| s.name()),
                })
            })
            .collect();
        let (position, relation) = match self.layout {
            Layout::Single(p) => (p.map(|p| p.name()), None),
            Layout::Pair(r) => (None, Some(r.name())),
        };
        serde_json::json!({
            "background": {"colour": self.background.colour.name(), "kind": self.background.kind.name()},
            "objects": objects,
            "position": position,
            "relation": relation,
        })
    }
}

/// Concrete background: colour and kind plus texture orientation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Background {
    pub colour: Colour,
    pub kind: BgKind,
    /// Gradient/stripes run along x (vertical stripes, left-right gradient) when false, along y when true.
    pub vertical: bool,
    /// Gradient starts with the shade instead of the main colour.
    pub reversed: bool,
}

/// Concrete object geometry in fractions of the image side: bounding-box centre and half-extent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Object {
    pub shape: Shape,
    pub colour: Colour,
    pub size: Size,
    pub cx: f64,
    pub cy: f64,
    pub r: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Scene {
    pub background: Background,
    pub objects: Vec<Object>,
    pub layout: Layout,
}

impl Scene {
    pub fn spec(&self) -> Spec {
        Spec {
            background: BackgroundSpec { colour: self.background.colour, kind: self.background.kind },
            objects: self
                .objects
                .iter()
                .map(|o| ObjectSpec { shape: o.shape, colour: o.colour, size: Some(o.size) })
                .collect(),
            layout: self.layout,
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        let objects: Vec<_> = self
            .objects
            .iter()
            .map(|o| serde_json::json!({"cx": o.cx, "cy": o.cy, "r": o.r}))
            .collect();
        serde_json::json!({
            "vertical": self.background.vertical,
            "reversed": self.background.reversed,
            "objects": objects,
        })
    }
}

/// Distribution knobs for [`sample_scene`].
#[derive(Clone, Debug)]
pub struct SampleConfig {
    /// Probability that a scene has two objects.
    pub pair_probability: f64,
    /// Probability that the background is textured (gradient, striped or checkered) rather than plain.
    pub textured_probability: f64,
}

impl Default for SampleConfig {
    fn default() -> Self {
        SampleConfig { pair_probability: 0.5, textured_probability: 0.4 }
    }
}

/// Gap kept between any object and the image border (fraction of the side), so objects are never
/// clipped and the judge can read the background off the border.
pub const MARGIN: f64 = 0.04;

/// Draws a caption-level spec. Every field is set (no `None`s), objects differ in colour from the
/// background and from each other.
pub fn sample_spec(rng: &mut Rng, cfg: &SampleConfig) -> Spec {
    let bg_colour = rng.pick(&Colour::ALL);
    let kind = if rng.chance(cfg.textured_probability) {
        rng.pick(&[BgKind::Gradient, BgKind::Striped, BgKind::Checkered])
    } else {
        BgKind::Plain
    };
    let pair = rng.chance(cfg.pair_probability);
    let mut objects = Vec::new();
    for _ in 0..if pair { 2 } else { 1 } {
        let colour = loop {
            let c = rng.pick(&Colour::ALL);
            if c != bg_colour && objects.iter().all(|o: &ObjectSpec| o.colour != c) {
                break c;
            }
        };
        objects.push(ObjectSpec { shape: rng.pick(Shape::ALL), colour, size: Some(rng.pick(Size::ALL)) });
    }
    let layout = if pair { Layout::Pair(rng.pick(Relation::ALL)) } else { Layout::Single(Some(rng.pick(Position::ALL))) };
    Spec { background: BackgroundSpec { colour: bg_colour, kind }, objects, layout }
}

fn radius(rng: &mut Rng, size: Size) -> f64 {
    match size {
        Size::Small => rng.range(0.09, 0.12),
        Size::Large => rng.range(0.19, 0.22),
    }
}

/// Gives a spec concrete geometry. Unspecified sizes/positions are drawn at random, so any valid
/// spec (e.g. a parsed user caption) can be rendered as a reference image.
pub fn place(spec: &Spec, rng: &mut Rng) -> Scene {
    let background = Background {
        colour: spec.background.colour,
        kind: spec.background.kind,
        vertical: rng.chance(0.5),
        reversed: rng.chance(0.5),
    };
    let mut objects: Vec<Object> = spec
        .objects
        .iter()
        .map(|o| {
            let size = o.size.unwrap_or_else(|| rng.pick(Size::ALL));
            Object { shape: o.shape, colour: o.colour, size, cx: 0.5, cy: 0.5, r: radius(rng, size) }
        })
        .collect();
    let lo = |r: f64| r + MARGIN;
    let hi = |r: f64| 1.0 - r - MARGIN;
    let layout = match spec.layout {
        Layout::Single(p) => {
            let p = p.unwrap_or_else(|| rng.pick(Position::ALL));
            let (ax, ay) = p.anchor();
            let o = &mut objects[0];
            // Jitter stays well inside the judge's grid cells (boundaries at 0.375 / 0.625).
            o.cx = (ax + rng.range(-0.04, 0.04)).clamp(lo(o.r), hi(o.r));
            o.cy = (ay + rng.range(-0.04, 0.04)).clamp(lo(o.r), hi(o.r));
            Layout::Single(Some(p))
        }
        Layout::Pair(rel) => {
            let (ra, rb) = (objects[0].r, objects[1].r);
            // Along the relation's axis: centres `d` apart with a visible gap, the pair shifted
            // randomly within the margins. Across it: small offsets, at most half of `d`, so the
            // relation is unambiguous.
            let room = 1.0 - 2.0 * MARGIN - 2.0 * (ra + rb);
            let gap = rng.range(0.05, 0.14).min(room);
            let d = ra + rb + gap;
            let first_is_a = matches!(rel, Relation::LeftOf | Relation::Above);
            let (r_first, r_second) = if first_is_a { (ra, rb) } else { (rb, ra) };
            let start = rng.range(MARGIN, 1.0 - MARGIN - (r_first + d + r_second)).max(MARGIN);
            let first = start + r_first;
            let second = first + d;
            let (a_main, b_main) = if first_is_a { (first, second) } else { (second, first) };
            let mut ca = 0.5 + rng.range(-0.12, 0.12);
            let mut cb = 0.5 + rng.range(-0.12, 0.12);
            if (ca - cb).abs() > 0.5 * d {
                let mid = 0.5 * (ca + cb);
                let half = 0.25 * d * (ca - cb).signum();
                ca = mid + half;
                cb = mid - half;
            }
            let ca = ca.clamp(lo(ra), hi(ra));
            let cb = cb.clamp(lo(rb), hi(rb));
            let horizontal = matches!(rel, Relation::LeftOf | Relation::RightOf);
            let (a, b) = objects.split_at_mut(1);
            let (a, b) = (&mut a[0], &mut b[0]);
            if horizontal {
                (a.cx, a.cy, b.cx, b.cy) = (a_main, ca, b_main, cb);
            } else {
                (a.cx, a.cy, b.cx, b.cy) = (ca, a_main, cb, b_main);
            }
            Layout::Pair(rel)
        }
    };
    Scene { background, objects, layout }
}

/// Salt of the held-out split (changing it would silently reshuffle train/test; don't).
const SPLIT_SALT: &str = "brume-world/held-out/v1";

/// Held-out rule: a spec is held out iff `hash(salt + spec.key()) % 1000 < 50` (5% of all specs).
///
/// Because captions parse back to their spec, and the training stream only ever captions
/// non-held-out specs, no held-out prompt can occur verbatim in training, whatever the template or
/// synonym choices. It holds out whole *combinations* (every attribute value is still seen in
/// training), which is what a compositional adherence benchmark wants.
pub fn is_held_out(spec: &Spec) -> bool {
    hash_str(&format!("{SPLIT_SALT}|{}", spec.key())) % 1000 < 50
}

/// A training scene: deterministic in `rng_seed`, never held out.
pub fn sample_scene(rng_seed: u64, cfg: &SampleConfig) -> Scene {
    let mut attempt = 0u64;
    loop {
        let mut rng = Rng::new(mix(rng_seed, attempt));
        let spec = sample_spec(&mut rng, cfg);
        if !is_held_out(&spec) {
            return place(&spec, &mut rng);
        }
        attempt += 1;
    }
}

/// Any scene from the full distribution, held out or not (used for the held-out set itself).
pub fn sample_scene_unfiltered(rng_seed: u64, cfg: &SampleConfig) -> Scene {
    let mut rng = Rng::new(mix(rng_seed, 0));
    let spec = sample_spec(&mut rng, cfg);
    place(&spec, &mut rng)
}

/// Renders-ready geometry for a given spec (e.g. a reference image for a parsed prompt).
pub fn scene_from_spec(spec: &Spec, seed: u64) -> Scene {
    place(spec, &mut Rng::new(mix(seed, 0x5EED)))
}

const HELD_OUT_STREAM: u64 = 0x4845_4C44_4F55_5421; // "HELDOUT!"

/// The held-out benchmark: `n` distinct prompts with their seeds. `held_out_scene(seed)` rebuilds
/// the reference scene; the caption uses the same seed as its template seed. The list for `n` is a
/// prefix of the list for any larger `n`.
pub fn held_out_prompts(n: usize) -> Vec<(String, u64)> {
    let cfg = SampleConfig::default();
    let mut out = Vec::with_capacity(n);
    let mut seen = std::collections::HashSet::new();
    let mut i = 0u64;
    while out.len() < n {
        let seed = mix(HELD_OUT_STREAM, i);
        i += 1;
        let scene = sample_scene_unfiltered(seed, &cfg);
        let spec = scene.spec();
        if is_held_out(&spec) && seen.insert(spec.key()) {
            out.push((crate::caption::caption(&scene, seed), seed));
        }
    }
    out
}

/// The reference scene of a held-out prompt's seed.
pub fn held_out_scene(seed: u64) -> Scene {
    sample_scene_unfiltered(seed, &SampleConfig::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_is_deterministic_and_valid() {
        let cfg = SampleConfig::default();
        for seed in 0..3000 {
            let s = sample_scene(seed, &cfg);
            assert_eq!(s, sample_scene(seed, &cfg));
            s.spec().validate().unwrap();
            assert!(!is_held_out(&s.spec()));
            for o in &s.objects {
                assert!(o.cx - o.r >= MARGIN - 1e-9 && o.cx + o.r <= 1.0 - MARGIN + 1e-9, "{s:?}");
                assert!(o.cy - o.r >= MARGIN - 1e-9 && o.cy + o.r <= 1.0 - MARGIN + 1e-9, "{s:?}");
            }
            match s.layout {
                Layout::Single(Some(p)) => {
                    let o = &s.objects[0];
                    let col = if o.cx < 0.375 { 0 } else if o.cx > 0.625 { 2 } else { 1 };
                    let row = if o.cy < 0.375 { 0 } else if o.cy > 0.625 { 2 } else { 1 };
                    assert_eq!(Position::from_cell(col, row), p, "{s:?}");
                }
                Layout::Pair(rel) => {
                    let (a, b) = (&s.objects[0], &s.objects[1]);
                    // Bounding boxes are disjoint with a gap.
                    let sep_x = (a.cx - b.cx).abs() - a.r - b.r;
                    let sep_y = (a.cy - b.cy).abs() - a.r - b.r;
                    assert!(sep_x.max(sep_y) >= 0.03, "{s:?}");
                    let (dx, dy) = (b.cx - a.cx, b.cy - a.cy);
                    let got = if dx.abs() > dy.abs() {
                        if dx > 0.0 { Relation::LeftOf } else { Relation::RightOf }
                    } else if dy > 0.0 {
                        Relation::Above
                    } else {
                        Relation::Below
                    };
                    assert_eq!(got, rel, "{s:?}");
                    assert!(dx.abs().min(dy.abs()) <= 0.5 * dx.abs().max(dy.abs()) + 1e-9);
                }
                Layout::Single(None) => panic!("generated specs are complete"),
            }
        }
    }

    #[test]
    fn split_is_pinned_and_about_five_percent() {
        let cfg = SampleConfig::default();
        let held = (0..20_000).filter(|&i| is_held_out(&sample_scene_unfiltered(i, &cfg).spec())).count();
        assert!((800..1200).contains(&held), "{held}");
        let spec = Spec {
            background: BackgroundSpec { colour: Colour::Blue, kind: BgKind::Plain },
            objects: vec![ObjectSpec { shape: Shape::Circle, colour: Colour::Red, size: Some(Size::Large) }],
            layout: Layout::Single(Some(Position::Left)),
        };
        assert_eq!(spec.key(), "bg=blue/plain;obj=large/red/circle;pos=left");
        // Pins the split: if this moves, every published held-out score becomes incomparable.
        assert_eq!(hash_str(&format!("{SPLIT_SALT}|{}", spec.key())), 3_648_161_223_271_805_675);
        assert!(!is_held_out(&spec));
    }
}
