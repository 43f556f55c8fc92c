//! The planner: the least lossy way to run a request within a memory budget.
//!
//! Rungs, in order of what they cost: all segments resident (nothing traded);
//! sequential segments (load time, same picture); chunked attention (a little
//! speed, same picture); tiled VAE decoding (seams blended, nearly the same
//! picture); a lower resolution (a different picture, upscaled or reported
//! smaller as the user chose); a lower-precision variant of the model, when
//! one is installed. The first rung whose estimate fits is taken; when none
//! does, the request is refused before any large allocation, naming the
//! budget and the smallest need.

use std::num::NonZeroUsize;

use super::estimate::{estimate, Estimate, ModelProfile, RequestShape};
use super::strategy::{AttentionMode, Branches, Residency, Strategy, TileSpec, VaeDecode};
use crate::error::RunError;
use crate::pipelines::VaeConfig;
use crate::runtime::budget::Budget;
use crate::runtime::memory::mib;

/// Query chunks tried, largest (fastest) first.
const CHUNKS: [usize; 6] = [2048, 1024, 512, 256, 128, 64];
/// Latent tile sizes tried, largest (fewest seams) first; overlap is a quarter.
const TILES: [usize; 4] = [48, 32, 24, 16];
/// Steps of the resolution fallback, in pixels off each side (512 -> 448 -> 384).
const RESOLUTION_STEPS: [usize; 2] = [64, 128];

/// What the user allows when only a smaller picture fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResolutionFallback {
    /// Refuse instead.
    Off,
    /// Generate smaller, then resize the output to the requested size.
    #[default]
    Upscale,
    /// Generate smaller and write the smaller picture, saying so.
    Report,
}

impl ResolutionFallback {
    pub fn parse(s: &str) -> Result<Self, RunError> {
        match s {
            "off" => Ok(Self::Off),
            "upscale" => Ok(Self::Upscale),
            "report" => Ok(Self::Report),
            other => Err(RunError::Invalid(format!("--resolution-fallback `{other}`: expected off, upscale or report"))),
        }
    }
}

/// How the output of a reduced-resolution run reaches the user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReducedOutput {
    Upscaled,
    ReportedSmaller,
}

/// The size a plan runs at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunSize {
    Requested,
    Reduced { width: usize, height: usize, output: ReducedOutput },
}

/// A lower-precision copy of the model the user has installed (e.g. a folder
/// `brume convert` wrote): the planner's last resort before refusing.
pub struct PrecisionVariant<'a> {
    /// What to call it in messages and recipes (e.g. `int8`, or its folder).
    pub label: String,
    pub model: &'a ModelProfile,
}

/// A chosen way to run. Fallbacks are derived from the fields, so the plan
/// cannot claim a fallback it does not take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub strategy: Strategy,
    pub size: RunSize,
    /// Index into the variants given to [`plan`]; `None`: the model itself.
    pub variant: Option<(usize, String)>,
    pub estimate: Estimate,
    pub budget: Budget,
}

impl Plan {
    /// The size to generate at for a request of `requested` (width, height):
    /// smaller than asked after a resolution fallback.
    pub fn run_size(&self, requested: (usize, usize)) -> (usize, usize) {
        match self.size {
            RunSize::Requested => requested,
            RunSize::Reduced { width, height, .. } => (width, height),
        }
    }

    /// The fallbacks taken, least lossy first; empty for the plain path.
    pub fn fallbacks(&self) -> Vec<String> {
        let mut f = Vec::new();
        if self.strategy.residency == Residency::Sequential {
            f.push("sequential segments".to_string());
        }
        if self.strategy.branches == Branches::OneAtATime {
            f.push("guidance branches one at a time".to_string());
        }
        if let AttentionMode::Chunked(c) = self.strategy.attention {
            f.push(format!("chunked attention ({c} queries)"));
        }
        if let VaeDecode::Tiled(t) = self.strategy.vae {
            f.push(format!("tiled VAE decoding ({} latent px tiles, {} overlap)", t.tile(), t.overlap()));
        }
        if let RunSize::Reduced { width, height, output } = self.size {
            f.push(match output {
                ReducedOutput::Upscaled => format!("lower resolution {width}x{height}, upscaled"),
                ReducedOutput::ReportedSmaller => format!("lower resolution {width}x{height}, written at that size"),
            });
        }
        if let Some((_, label)) = &self.variant {
            f.push(format!("lower precision ({label})"));
        }
        f
    }

    /// The budget's working set when this plan's estimated RSS exceeds it: the
    /// run fits in private memory but its mapped weights will be paged from
    /// storage as they are used, which is slow, not fatal.
    pub fn over_working_set(&self) -> Option<u64> {
        self.budget.working_set().filter(|&ws| self.estimate.peak.rss > ws)
    }

    /// One line for stderr and the recipe.
    pub fn summary(&self) -> String {
        let fb = self.fallbacks();
        // Only a plan that gave something up says "fallback".
        let what = if fb.is_empty() { "runs as asked".to_string() } else { format!("fallback: {}", fb.join(", ")) };
        let mut line = format!(
            "memory plan {}: {what}; estimated peak {} private, {} RSS; budget {}",
            self.strategy.label(),
            mib(self.estimate.peak.private_dirty),
            mib(self.estimate.peak.rss),
            self.budget
        );
        if let Some(ws) = self.over_working_set() {
            line.push_str(&format!(
                "; warning: the estimated RSS exceeds the {} working set, so the mapped weights will be read from \
                 storage again as they are used (slow); a smaller precision fits better (`brume convert --precision \
                 int4-attn-fp16`, then `--precision-variant DIR`)",
                mib(ws)
            ));
        }
        line
    }
}

/// What a plan must leave free beyond its estimate: one eighth of it plus 16 MiB.
/// Over the SD 1.5 grid the estimate runs 6-8 % below the measured peak, and at
/// small budgets up to 32 MiB below it (temporaries the liveness walk does not
/// model, and freed heap the allocator keeps in its per-thread arenas); a plan
/// that overruns an enforced limit is killed, not refused, so a plan counts as
/// fitting only with this headroom.
pub fn with_headroom(need: u64) -> u64 {
    need.saturating_add(need / 8).saturating_add(16 << 20)
}

/// Whether `need` (an estimate) fits `budget` with headroom.
pub fn within(need: u64, budget: u64) -> bool {
    with_headroom(need) <= budget
}

fn fits(e: &Estimate, budget: u64) -> bool {
    within(e.peak.private_dirty, budget)
}

fn within_working_set(e: &Estimate, budget: &Budget) -> bool {
    budget.working_set().is_none_or(|ws| e.peak.rss <= ws)
}

/// `chosen` with sequential segments when that fits and lowers RSS: over the
/// working set, holding one segment's mapped weights at a time pages less, and
/// gives the same picture.
fn least_paging(model: &ModelProfile, shape: &RequestShape, chosen: Plan) -> Plan {
    let seq = Strategy { residency: Residency::Sequential, ..chosen.strategy };
    let e = estimate(model, shape, &seq);
    if seq != chosen.strategy && fits(&e, chosen.budget.bytes()) && e.peak.rss < chosen.estimate.peak.rss {
        Plan { strategy: seq, estimate: e, ..chosen }
    } else {
        chosen
    }
}

/// The fastest chunking whose estimate fits `budget`, else the smallest chunk;
/// `None` where the fused attention kernel runs, which forms no score matrix to
/// chunk (the rung would change nothing).
pub fn cheapest_attention(model: &ModelProfile, shape: &RequestShape, s: &Strategy, budget: u64) -> Option<AttentionMode> {
    if model.kernels.fused_attention {
        return None;
    }
    let modes: Vec<AttentionMode> = CHUNKS.iter().filter_map(|&c| NonZeroUsize::new(c)).map(AttentionMode::Chunked).collect();
    let fitting = modes.iter().find(|&&m| {
        let t = Strategy { attention: m, ..*s };
        within(estimate(model, shape, &t).unet.private_dirty, budget)
    });
    fitting.or(modes.last()).copied()
}

/// The largest tile whose decode fits `budget`, else the smallest (KL VAEs only).
pub fn cheapest_tiles(model: &ModelProfile, shape: &RequestShape, s: &Strategy, budget: u64) -> Option<TileSpec> {
    if !matches!(model.vae, VaeConfig::Kl(_)) {
        return None;
    }
    let f = model.vae.scale_factor();
    let latent = (shape.width / f).max(shape.height / f);
    let tiles: Vec<TileSpec> = TILES.iter().filter(|&&t| t < latent).filter_map(|&t| TileSpec::new(t, t / 4)).collect();
    let fitting = tiles.iter().find(|&&t| {
        let x = Strategy { vae: VaeDecode::Tiled(t), ..*s };
        within(estimate(model, shape, &x).decode.private_dirty, budget)
    });
    fitting.or(tiles.last()).copied()
}

/// `s` with guidance branches one at a time when the request is guided, `s`
/// batches them, and its UNet phase is what does not fit `budget`: the split
/// shrinks only that phase and slows every step, so it is taken for nothing else.
pub fn split_if_unet_over(model: &ModelProfile, shape: &RequestShape, s: &Strategy, budget: u64) -> Option<Strategy> {
    let over = shape.guided && s.branches == Branches::Batched && !within(estimate(model, shape, s).unet.private_dirty, budget);
    over.then_some(Strategy { branches: Branches::OneAtATime, ..*s })
}

/// The strategies of the rungs that keep the requested size, least lossy first.
/// Guidance branches one at a time only shrink the UNet phase, so the later
/// rungs take them only when that phase is over the budget (else they would
/// slow a run whose decoding is what needs tiles).
pub fn rungs(model: &ModelProfile, shape: &RequestShape, budget: u64) -> Vec<Strategy> {
    let plain = Strategy::PLAIN;
    let seq = Strategy { residency: Residency::Sequential, ..plain };
    let mut out = vec![plain, seq];
    if shape.guided {
        out.push(Strategy { branches: Branches::OneAtATime, ..seq });
    }
    let base = split_if_unet_over(model, shape, &seq, budget).unwrap_or(seq);
    let mut before_tiles = base;
    if let Some(a) = cheapest_attention(model, shape, &base, budget) {
        before_tiles = Strategy { attention: a, ..base };
        out.push(before_tiles);
    }
    if let Some(t) = cheapest_tiles(model, shape, &before_tiles, budget) {
        out.push(Strategy { vae: VaeDecode::Tiled(t), ..before_tiles });
    }
    out
}

/// Picks the least lossy plan for `shape` within `budget`, or refuses. Where the
/// budget has a working set, the first pass also keeps RSS within it (so an
/// installed lower-precision variant beats paging a larger model's weights);
/// when no plan does, the first that fits in private memory runs, with a warning.
pub fn plan(
    model: &ModelProfile,
    shape: &RequestShape,
    budget: &Budget,
    resolution: ResolutionFallback,
    variants: &[PrecisionVariant],
) -> Result<Plan, RunError> {
    check_shape(model, shape)?;
    let b = budget.bytes();
    let mut smallest: Option<(u64, String)> = None;
    let mut consider = |e: &Estimate, label: String| {
        if smallest.as_ref().is_none_or(|(n, _)| e.peak.private_dirty < *n) {
            smallest = Some((e.peak.private_dirty, label));
        }
    };
    let sizes = candidate_sizes(model, shape, resolution);
    let models: Vec<(Option<(usize, String)>, &ModelProfile)> = std::iter::once((None, model))
        .chain(variants.iter().enumerate().map(|(i, v)| (Some((i, v.label.clone())), v.model)))
        .collect();
    let passes: &[bool] = if budget.working_set().is_some() { &[true, false] } else { &[false] };
    for &keep_rss in passes {
        for (variant, m) in &models {
            for (size, run_shape) in &sizes {
                for s in rungs(m, run_shape, b) {
                    let e = estimate(m, run_shape, &s);
                    let candidate = Plan { strategy: s, size: *size, variant: variant.clone(), estimate: e.clone(), budget: budget.clone() };
                    if fits(&e, b) && (!keep_rss || within_working_set(&e, budget)) {
                        // Second pass of a working-set budget: nothing fits it, so page least.
                        let over = !keep_rss && budget.working_set().is_some();
                        return Ok(if over { least_paging(m, run_shape, candidate) } else { candidate });
                    }
                    consider(&e, candidate.fallbacks().join(", "));
                }
            }
        }
    }
    let (need, label) = smallest.unwrap_or((0, String::new()));
    Err(RunError::OverBudget {
        when: "before loading any weights".into(),
        budget: budget.to_string(),
        need: mib(with_headroom(need)),
        plan: label,
    })
}

/// A plan with a fixed strategy at the requested size (`--memory-plan`), still
/// refused when it does not fit.
pub fn fixed(model: &ModelProfile, shape: &RequestShape, budget: &Budget, strategy: Strategy) -> Result<Plan, RunError> {
    check_shape(model, shape)?;
    let e = estimate(model, shape, &strategy);
    if !fits(&e, budget.bytes()) {
        return Err(RunError::OverBudget {
            when: "before loading any weights".into(),
            budget: budget.to_string(),
            need: mib(with_headroom(e.peak.private_dirty)),
            plan: strategy.label(),
        });
    }
    Ok(Plan { strategy, size: RunSize::Requested, variant: None, estimate: e, budget: budget.clone() })
}

fn candidate_sizes(model: &ModelProfile, shape: &RequestShape, resolution: ResolutionFallback) -> Vec<(RunSize, RequestShape)> {
    let mut out = vec![(RunSize::Requested, *shape)];
    let output = match resolution {
        ResolutionFallback::Off => return out,
        ResolutionFallback::Upscale => ReducedOutput::Upscaled,
        ResolutionFallback::Report => ReducedOutput::ReportedSmaller,
    };
    let f = model.vae.scale_factor() * 8;
    for step in RESOLUTION_STEPS {
        // Keep the aspect ratio: shrink the longer side by `step`, the other in proportion,
        // both rounded down to a multiple the UNet divides evenly.
        let long = shape.width.max(shape.height);
        if long <= step + f {
            break;
        }
        let scale = (long - step) as f64 / long as f64;
        let w = ((shape.width as f64 * scale) as usize / f * f).max(f);
        let h = ((shape.height as f64 * scale) as usize / f * f).max(f);
        if (w, h) == (shape.width, shape.height) {
            continue;
        }
        out.push((RunSize::Reduced { width: w, height: h, output }, RequestShape { width: w, height: h, ..*shape }));
    }
    out
}

/// The arguments are checked before any memory is planned: the estimator walks
/// feature maps sized by them, and a size the model cannot run (below the VAE
/// factor, not a multiple of it, huge) must be an error naming it, not a panic
/// or an overflow in the walk.
pub fn check_shape(model: &ModelProfile, shape: &RequestShape) -> Result<(), RunError> {
    let f = model.vae.scale_factor();
    let (w, h) = (shape.width, shape.height);
    if w == 0 || h == 0 || w % f != 0 || h % f != 0 {
        return Err(RunError::Invalid(format!("size {w}x{h} must be positive multiples of {f} (the VAE factor)")));
    }
    if w > 4096 || h > 4096 {
        return Err(RunError::Invalid(format!("size {w}x{h} is over the 4096-pixel limit per side")));
    }
    if shape.batch == 0 || shape.batch > 64 {
        return Err(RunError::Invalid(format!("batch must be 1..=64, got {}", shape.batch)));
    }
    Ok(())
}
