//! Frame-to-frame techniques, each switchable so it can be measured on and off.

use image::RgbImage;

/// Which techniques run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Techniques {
    /// StreamDiffusion's stochastic similarity filter: skip a frame whose input barely
    /// changed (the previous output is shown again).
    pub similarity_skip: bool,
    /// Start from a blend with the previous frame's result latent (the public Core ML
    /// port's 30 %): steadier output on a steady scene.
    pub latent_blend: bool,
    /// Exponential moving average of displayed frames (output stage).
    pub smoothing: bool,
}

impl Techniques {
    pub const NONE: Techniques = Techniques {
        similarity_skip: false,
        latent_blend: false,
        smoothing: false,
    };
    pub const ALL: Techniques = Techniques {
        similarity_skip: true,
        latent_blend: true,
        smoothing: true,
    };

    /// Parses `none`, `all`, or a comma list of `skip`, `blend`, `ema`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut t = Techniques::NONE;
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part {
                "none" => {}
                "all" => t = Techniques::ALL,
                "skip" => t.similarity_skip = true,
                "blend" => t.latent_blend = true,
                "ema" => t.smoothing = true,
                other => {
                    return Err(format!(
                        "unknown technique `{other}` (known: none, all, skip, blend, ema)"
                    ))
                }
            }
        }
        Ok(t)
    }

    pub fn label(&self) -> String {
        let mut v = Vec::new();
        if self.similarity_skip {
            v.push("skip");
        }
        if self.latent_blend {
            v.push("blend");
        }
        if self.smoothing {
            v.push("ema");
        }
        if v.is_empty() {
            "none".into()
        } else {
            v.join("+")
        }
    }
}

/// Cosine similarity of two equally long vectors (0 when either is all zeros).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let (mut dot, mut na, mut nb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        dot += x as f64 * y as f64;
        na += x as f64 * x as f64;
        nb += y as f64 * y as f64;
    }
    if na == 0.0 || nb == 0.0 {
        0.0
    } else {
        (dot / (na.sqrt() * nb.sqrt())) as f32
    }
}

/// Pixels mapped to [-1, 1] (the model's input range, as StreamDiffusion compares them):
/// in [0, 1] every picture is similar to every other.
pub fn signed_pixels(img: &RgbImage) -> Vec<f32> {
    img.as_raw()
        .iter()
        .map(|&v| v as f32 / 127.5 - 1.0)
        .collect()
}

/// StreamDiffusion's stochastic similarity filter (`SimilarImageFilter`): with cosine
/// similarity `s` of the input to the last processed input, the frame is skipped with
/// probability `max(0, 1 - (1 - s) / (1 - threshold))`, but never more than `max_skips`
/// times in a row, so a still scene is still refreshed.
pub struct SimilarityFilter {
    pub threshold: f32,
    pub max_skips: usize,
    prev: Option<Vec<f32>>,
    run: usize,
    rng: u64,
}

impl SimilarityFilter {
    pub fn new(threshold: f32, max_skips: usize, seed: u64) -> Self {
        Self {
            threshold,
            max_skips,
            prev: None,
            run: 0,
            rng: seed ^ 0x9E37_79B9_7F4A_7C15,
        }
    }

    fn uniform(&mut self) -> f32 {
        // xorshift64*: deterministic per seed, plenty for a coin flip.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        (self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Whether to skip the frame whose pixels (in [-1, 1]) are `x`. A processed frame
    /// becomes the new reference.
    pub fn should_skip(&mut self, x: &[f32]) -> bool {
        let Some(prev) = &self.prev else {
            self.prev = Some(x.to_vec());
            return false;
        };
        let sim = if prev.len() == x.len() {
            cosine(prev, x)
        } else {
            0.0
        };
        let p_skip = if self.threshold >= 1.0 {
            0.0
        } else {
            (1.0 - (1.0 - sim) / (1.0 - self.threshold)).max(0.0)
        };
        let sample = self.uniform();
        if p_skip > sample && self.run < self.max_skips {
            self.run += 1;
            return true;
        }
        self.run = 0;
        self.prev = Some(x.to_vec());
        false
    }

    /// Forget the reference (a size or prompt change).
    pub fn reset(&mut self) {
        self.prev = None;
        self.run = 0;
    }
}

/// Display smoothing: `shown = alpha * new + (1 - alpha) * shown_before`.
pub struct Smoother {
    pub alpha: f32,
    prev: Option<Vec<f32>>,
}

impl Smoother {
    pub fn new(alpha: f32) -> Self {
        Self {
            alpha: alpha.clamp(0.0, 1.0),
            prev: None,
        }
    }

    pub fn apply(&mut self, img: &RgbImage) -> RgbImage {
        let cur: Vec<f32> = img.as_raw().iter().map(|&v| v as f32).collect();
        let next = match self.prev.take() {
            Some(p) if p.len() == cur.len() => cur
                .iter()
                .zip(&p)
                .map(|(c, p)| self.alpha * c + (1.0 - self.alpha) * p)
                .collect(),
            _ => cur,
        };
        let out = RgbImage::from_raw(
            img.width(),
            img.height(),
            next.iter()
                .map(|v| v.round().clamp(0.0, 255.0) as u8)
                .collect(),
        );
        self.prev = Some(next);
        out.unwrap_or_else(|| img.clone())
    }
}

/// Flicker: the mean absolute difference (0..255) between consecutive frames,
/// averaged over the sequence (0 for fewer than two frames).
pub fn flicker(frames: &[RgbImage]) -> f64 {
    let diffs: Vec<f64> = frames
        .windows(2)
        .filter(|w| w[0].dimensions() == w[1].dimensions())
        .map(|w| {
            let (a, b) = (w[0].as_raw(), w[1].as_raw());
            a.iter()
                .zip(b)
                .map(|(&x, &y)| (x as f64 - y as f64).abs())
                .sum::<f64>()
                / a.len().max(1) as f64
        })
        .collect();
    if diffs.is_empty() {
        0.0
    } else {
        diffs.iter().sum::<f64>() / diffs.len() as f64
    }
}
