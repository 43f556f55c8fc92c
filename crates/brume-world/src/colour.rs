//! The named colour palette and the perceptual distance used to name a pixel.
//!
//! Colours are chosen to be far apart in CIELAB (the smallest pairwise ΔE76 is asserted in a test)
//! so that a judge can still name them after a lossy VAE round trip, which shifts hue and
//! saturation a little and blurs edges.

/// A named colour. Objects and backgrounds draw from the same palette.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Colour {
    Red,
    Orange,
    Yellow,
    Green,
    Cyan,
    Blue,
    Purple,
    Pink,
    White,
    Black,
    Gray,
    Brown,
}

impl Colour {
    pub const ALL: [Colour; 12] = [
        Colour::Red,
        Colour::Orange,
        Colour::Yellow,
        Colour::Green,
        Colour::Cyan,
        Colour::Blue,
        Colour::Purple,
        Colour::Pink,
        Colour::White,
        Colour::Black,
        Colour::Gray,
        Colour::Brown,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Colour::Red => "red",
            Colour::Orange => "orange",
            Colour::Yellow => "yellow",
            Colour::Green => "green",
            Colour::Cyan => "cyan",
            Colour::Blue => "blue",
            Colour::Purple => "purple",
            Colour::Pink => "pink",
            Colour::White => "white",
            Colour::Black => "black",
            Colour::Gray => "gray",
            Colour::Brown => "brown",
        }
    }

    /// Parses a colour word; "grey" is accepted as a spelling of gray.
    pub fn from_word(w: &str) -> Option<Colour> {
        if w == "grey" {
            return Some(Colour::Gray);
        }
        Colour::ALL.into_iter().find(|c| c.name() == w)
    }

    /// The sRGB value objects and plain backgrounds are painted with.
    pub fn rgb(self) -> [u8; 3] {
        match self {
            Colour::Red => [215, 35, 35],
            Colour::Orange => [245, 140, 25],
            Colour::Yellow => [245, 225, 40],
            Colour::Green => [35, 160, 60],
            Colour::Cyan => [30, 200, 215],
            Colour::Blue => [30, 80, 225],
            Colour::Purple => [145, 40, 160],
            Colour::Pink => [250, 140, 200],
            Colour::White => [245, 245, 245],
            Colour::Black => [20, 20, 20],
            Colour::Gray => [128, 128, 128],
            Colour::Brown => [125, 75, 35],
        }
    }

    /// The second tone of textured backgrounds (gradient end, odd stripes, odd checker cells).
    ///
    /// Each is the colour moved part of the way towards black or white, the direction and amount
    /// chosen (offline, by a small search over CIELAB) to change luma by about 30/255 while staying
    /// at most half as far from its own palette entry as from any other. So the texture is learnable
    /// and detectable, yet the background's *dominant colour* stays well defined (both tested).
    pub fn shade(self) -> [u8; 3] {
        match self {
            Colour::Red => [223, 79, 79],
            Colour::Orange => [198, 113, 20],
            Colour::Yellow => [196, 180, 32],
            Colour::Green => [103, 189, 120],
            Colour::Cyan => [118, 221, 231],
            Colour::Blue => [68, 110, 230],
            Colour::Purple => [167, 83, 179],
            Colour::Pink => [188, 105, 150],
            Colour::White => [206, 206, 206],
            Colour::Black => [51, 51, 51],
            Colour::Gray => [90, 90, 90],
            Colour::Brown => [147, 106, 72],
        }
    }

    pub fn lab(self) -> [f32; 3] {
        rgb_to_lab(self.rgb())
    }
}

impl std::fmt::Display for Colour {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn srgb_to_linear(v: f32) -> f32 {
    let v = v / 255.0;
    if v <= 0.04045 {
        v / 12.92
    } else {
        ((v + 0.055) / 1.055).powf(2.4)
    }
}

/// sRGB (D65) to CIELAB. Nearest-colour naming in Lab tracks what a person would call the colour
/// far better than RGB distance (e.g. dark blue vs purple, brown vs orange).
pub fn rgb_to_lab(c: [u8; 3]) -> [f32; 3] {
    let [r, g, b] = c.map(|v| srgb_to_linear(v as f32));
    let x = (0.412_456_4 * r + 0.357_576_1 * g + 0.180_437_5 * b) / 0.950_47;
    let y = 0.212_672_9 * r + 0.715_152_2 * g + 0.072_175 * b;
    let z = (0.019_333_9 * r + 0.119_192 * g + 0.950_304_1 * b) / 1.088_83;
    let f = |t: f32| {
        if t > 0.008_856 {
            t.cbrt()
        } else {
            7.787 * t + 16.0 / 116.0
        }
    };
    let (fx, fy, fz) = (f(x), f(y), f(z));
    [116.0 * fy - 16.0, 500.0 * (fx - fy), 200.0 * (fy - fz)]
}

pub fn lab_dist2(a: [f32; 3], b: [f32; 3]) -> f32 {
    (a[0] - b[0]).powi(2) + (a[1] - b[1]).powi(2) + (a[2] - b[2]).powi(2)
}

/// Names colours quickly: a 32×32×32 lookup over quantised sRGB (8 levels per bucket) of the nearest
/// palette entry in Lab. Judging does this per pixel, so the table pays for itself on one image.
pub struct Namer {
    lut: Vec<u8>,
}

impl Namer {
    pub fn new() -> Self {
        let labs: Vec<[f32; 3]> = Colour::ALL.iter().map(|c| c.lab()).collect();
        let mut lut = vec![0u8; 32 * 32 * 32];
        for r in 0..32u32 {
            for g in 0..32u32 {
                for b in 0..32u32 {
                    let c = [r, g, b].map(|v| (v * 8 + 4) as u8);
                    lut[((r * 32 + g) * 32 + b) as usize] = nearest_index(&labs, rgb_to_lab(c)) as u8;
                }
            }
        }
        Namer { lut }
    }

    pub fn name(&self, c: [u8; 3]) -> Colour {
        let i = ((c[0] as usize >> 3) * 32 + (c[1] as usize >> 3)) * 32 + (c[2] as usize >> 3);
        Colour::ALL[self.lut[i] as usize]
    }
}

impl Default for Namer {
    fn default() -> Self {
        Namer::new()
    }
}

fn nearest_index(labs: &[[f32; 3]], lab: [f32; 3]) -> usize {
    let mut best = (f32::INFINITY, 0);
    for (i, &p) in labs.iter().enumerate() {
        let d = lab_dist2(p, lab);
        if d < best.0 {
            best = (d, i);
        }
    }
    best.1
}

/// The palette entry nearest to an sRGB value in Lab (exact, no lookup table).
pub fn nearest(c: [u8; 3]) -> Colour {
    let labs: Vec<[f32; 3]> = Colour::ALL.iter().map(|c| c.lab()).collect();
    Colour::ALL[nearest_index(&labs, rgb_to_lab(c))]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn palette_is_well_separated() {
        let mut min = (f32::INFINITY, Colour::Red, Colour::Red);
        for a in Colour::ALL {
            for b in Colour::ALL {
                if a < b {
                    let d = lab_dist2(a.lab(), b.lab()).sqrt();
                    if d < min.0 {
                        min = (d, a, b);
                    }
                }
            }
        }
        eprintln!("closest palette pair: {} / {} at ΔE {:.1}", min.1, min.2, min.0);
        assert!(min.0 > 38.0, "palette too tight: {min:?}");
    }

    #[test]
    fn shades_stay_their_colour_with_margin() {
        for c in Colour::ALL {
            let s = rgb_to_lab(c.shade());
            let own = lab_dist2(s, c.lab()).sqrt();
            let other = Colour::ALL
                .into_iter()
                .filter(|&o| o != c)
                .map(|o| lab_dist2(s, o.lab()).sqrt())
                .fold(f32::INFINITY, f32::min);
            let luma = |p: [u8; 3]| 0.299 * p[0] as f32 + 0.587 * p[1] as f32 + 0.114 * p[2] as f32;
            let dl = (luma(c.rgb()) - luma(c.shade())).abs();
            eprintln!("{c:>6}: shade {:?} own ΔE {own:.1} nearest other {other:.1} Δluma {dl:.1}", c.shade());
            assert!(own < 0.55 * other, "{c}: shade drifts towards another colour");
            assert!(dl > 25.0, "{c}: shade too faint to see a texture");
        }
    }

    #[test]
    fn namer_agrees_with_exact_nearest_on_palette_and_shades() {
        let n = Namer::new();
        for c in Colour::ALL {
            assert_eq!(n.name(c.rgb()), c);
            assert_eq!(nearest(c.rgb()), c);
            assert_eq!(n.name(c.shade()), c);
        }
        assert_eq!(Colour::from_word("grey"), Some(Colour::Gray));
        assert_eq!(Colour::from_word("mauve"), None);
    }
}
