//! The latency governor: given a target frame time, it picks the working resolution and
//! the number of steps from timings it measures as it goes, re-checks as the machine's
//! load changes, and says what it chose and why.

use std::collections::BTreeMap;
use std::time::Instant;

use image::RgbImage;

use crate::diffuser::FrameDiffuser;
use crate::error::Result;
use crate::pipeline::{Diffuse, Diffused};

/// One operating point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting {
    pub width: u32,
    pub steps: usize,
}

/// Measured milliseconds at one width (moving averages).
#[derive(Debug, Clone, Copy)]
struct Est {
    fixed_ms: f64,
    per_step_ms: f64,
}

/// Chooses settings for a target frame time.
pub struct Governor {
    pub target_ms: f64,
    /// Candidate widths, largest (best) first.
    widths: Vec<u32>,
    max_steps: usize,
    est: BTreeMap<u32, Est>,
    current: Setting,
    since_change: usize,
    frames: u64,
    decisions: Vec<String>,
}

/// How many frames a setting runs before it is judged (the first is a warm-up).
const SETTLE: usize = 4;

impl Governor {
    /// `widths`: what it may choose from (multiples of 8); `max_steps`: the most steps asked for.
    pub fn new(target_ms: f64, mut widths: Vec<u32>, max_steps: usize) -> Self {
        widths.sort_unstable_by(|a, b| b.cmp(a));
        widths.dedup();
        let current = Setting {
            width: widths.first().copied().unwrap_or(128),
            steps: max_steps.max(1),
        };
        Self {
            target_ms,
            widths,
            max_steps: max_steps.max(1),
            est: BTreeMap::new(),
            current,
            since_change: 0,
            frames: 0,
            decisions: Vec::new(),
        }
    }

    pub fn current(&self) -> Setting {
        self.current
    }

    pub fn decisions(&self) -> &[String] {
        &self.decisions
    }

    /// Predicted frame time at `s`: measured at its width, else scaled by pixel count
    /// from the nearest measured width (the convolutions' work grows with pixels).
    pub fn predict(&self, s: Setting) -> Option<f64> {
        let e = match self.est.get(&s.width) {
            Some(e) => *e,
            None => {
                let (&w0, e0) = self.est.iter().min_by_key(|(w, _)| w.abs_diff(s.width))?;
                let r = (s.width as f64 / w0 as f64).powi(2);
                Est {
                    fixed_ms: e0.fixed_ms * r,
                    per_step_ms: e0.per_step_ms * r,
                }
            }
        };
        Some(e.fixed_ms + e.per_step_ms * s.steps as f64)
    }

    /// Records a diffused frame's timings at the current setting.
    pub fn observe(&mut self, total_ms: f64, d: &Diffused) {
        self.frames += 1;
        if d.skipped {
            return;
        }
        self.since_change += 1;
        if self.since_change == 1 && self.frames > 1 {
            return; // the first frame at a new size pays for allocations
        }
        let per_step = d.unet_ms / self.current.steps as f64;
        let fixed = (total_ms - d.unet_ms).max(0.0);
        let e = self.est.entry(self.current.width).or_insert(Est {
            fixed_ms: fixed,
            per_step_ms: per_step,
        });
        e.fixed_ms = 0.7 * e.fixed_ms + 0.3 * fixed;
        e.per_step_ms = 0.7 * e.per_step_ms + 0.3 * per_step;
    }

    /// The best setting predicted to fit the target (moving up only with 15 % to
    /// spare, so it does not oscillate); re-decided once the current one has settled.
    pub fn decide(&mut self) -> Setting {
        if self.since_change < SETTLE {
            return self.current;
        }
        let mut best = None;
        'outer: for &w in &self.widths {
            for steps in (1..=self.max_steps).rev() {
                let s = Setting { width: w, steps };
                let Some(p) = self.predict(s) else { continue };
                let better = (w, steps) > (self.current.width, self.current.steps);
                let budget = if better {
                    0.85 * self.target_ms
                } else {
                    self.target_ms
                };
                if p <= budget {
                    best = Some((s, p));
                    break 'outer;
                }
            }
        }
        let (choice, why) = match best {
            Some((s, p)) => (s, format!("predicted {p:.1} ms")),
            None => {
                let s = Setting {
                    width: *self.widths.last().unwrap_or(&self.current.width),
                    steps: 1,
                };
                (
                    s,
                    format!(
                        "nothing fits: predicted {:.1} ms at the lowest setting",
                        self.predict(s).unwrap_or(f64::NAN)
                    ),
                )
            }
        };
        if choice != self.current {
            let was = self.predict(self.current).unwrap_or(f64::NAN);
            self.decisions.push(format!(
                "governor (target {:.0} ms), frame {}: {} px x {} step(s) measured {:.1} ms -> {} px x {} step(s), {why}",
                self.target_ms, self.frames, self.current.width, self.current.steps, was, choice.width, choice.steps
            ));
            self.current = choice;
            self.since_change = 0;
        }
        self.current
    }
}

/// A [`FrameDiffuser`] run under a [`Governor`].
pub struct Governed {
    pub inner: FrameDiffuser,
    pub governor: Governor,
}

impl Governed {
    pub fn new(inner: FrameDiffuser, governor: Governor) -> Self {
        Self { inner, governor }
    }
}

impl Diffuse for Governed {
    fn diffuse(&mut self, frame: &RgbImage) -> Result<Diffused> {
        let s = self.governor.decide();
        self.inner.set_width(Some(s.width));
        self.inner.set_steps(s.steps)?;
        let t = Instant::now();
        let d = self.inner.process(frame)?;
        self.governor.observe(t.elapsed().as_secs_f64() * 1e3, &d);
        Ok(d)
    }

    fn notes(&mut self) -> Vec<String> {
        let s = self.governor.current();
        let mut v = self.governor.decisions().to_vec();
        v.push(format!(
            "governor (target {:.0} ms) ended at {} px x {} step(s), predicted {:.1} ms",
            self.governor.target_ms,
            s.width,
            s.steps,
            self.governor.predict(s).unwrap_or(f64::NAN)
        ));
        v
    }
}
