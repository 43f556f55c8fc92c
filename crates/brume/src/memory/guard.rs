//! Headroom re-checked while a generation runs. The budget given at the start
//! can shrink (another app on a phone, another job on a shared machine): before
//! each segment and each denoising step the guard asks for the current budget
//! and compares it with what the rest of the run needs. When it no longer fits
//! it switches to a cheaper strategy that gives the same picture (chunked
//! attention, tiled decoding) or stops with a clean error; it never lets the
//! run reach the allocation that would get the process killed.

use std::cell::{Cell, RefCell};

use super::estimate::{estimate, Estimate, ModelProfile, RequestShape};
use super::planner::{cheapest_attention, cheapest_tiles, split_if_unet_over, with_headroom, within};
use super::strategy::{Strategy, VaeDecode};
use crate::error::RunError;
use crate::loading::Segment;
use crate::runtime::budget::Budget;
use crate::runtime::memory::mib;

/// Where in a run the guard is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checkpoint {
    BeforeSegment(Segment),
    /// Before denoising step `n` (1-based).
    BeforeStep(usize),
}

impl std::fmt::Display for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Checkpoint::BeforeSegment(s) => write!(f, "before loading {s}"),
            Checkpoint::BeforeStep(n) => write!(f, "before step {n}"),
        }
    }
}

/// The current budget, asked again at every checkpoint.
pub type BudgetProbe = Box<dyn Fn() -> Budget>;

/// Re-checks the plan against the budget as the run goes.
pub struct Guard {
    model: ModelProfile,
    shape: RequestShape,
    strategy: Cell<Strategy>,
    probe: BudgetProbe,
    notes: RefCell<Vec<String>>,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard").field("shape", &self.shape).field("strategy", &self.strategy.get()).finish()
    }
}

impl Guard {
    pub fn new(model: ModelProfile, shape: RequestShape, strategy: Strategy, probe: BudgetProbe) -> Self {
        Self { model, shape, strategy: Cell::new(strategy), probe, notes: RefCell::new(Vec::new()) }
    }

    /// The strategy now in force (it may have fallen back during the run).
    pub fn strategy(&self) -> Strategy {
        self.strategy.get()
    }

    /// The fallbacks taken during the run, one line each.
    pub fn notes(&self) -> Vec<String> {
        self.notes.borrow().clone()
    }

    /// What the phases from `at` onwards need under `s`.
    fn need(&self, s: &Strategy, at: Checkpoint) -> u64 {
        let e: Estimate = estimate(&self.model, &self.shape, s);
        match at {
            Checkpoint::BeforeSegment(Segment::TextEncoder) => e.peak.private_dirty,
            Checkpoint::BeforeSegment(Segment::VaeEncoder) => e.encode.private_dirty.max(e.unet.private_dirty).max(e.decode.private_dirty),
            Checkpoint::BeforeSegment(Segment::Unet) | Checkpoint::BeforeStep(_) => {
                e.unet.private_dirty.max(e.decode.private_dirty)
            }
            Checkpoint::BeforeSegment(Segment::VaeDecoder) => e.decode.private_dirty,
        }
    }

    /// Checks the headroom at `at`; falls back to a same-result cheaper strategy
    /// when the budget has shrunk, or refuses cleanly.
    pub fn check(&self, at: Checkpoint) -> Result<Strategy, RunError> {
        let budget = (self.probe)();
        let mut s = self.strategy.get();
        if within(self.need(&s, at), budget.bytes()) {
            return Ok(s);
        }
        // Chunked attention matters while the UNet is still to run.
        let unet_ahead = !matches!(at, Checkpoint::BeforeSegment(Segment::VaeDecoder));
        // Guidance branches one at a time: the same picture, half the UNet's activations.
        if unet_ahead {
            if let Some(split) = split_if_unet_over(&self.model, &self.shape, &s, budget.bytes()) {
                s = split;
                self.note(format!("{at}: budget now {budget}; falling back to guidance branches one at a time"));
            }
        }
        if unet_ahead && !within(self.need(&s, at), budget.bytes()) {
            if let Some(mode) = cheapest_attention(&self.model, &self.shape, &s, budget.bytes()) {
                if mode != s.attention {
                    s.attention = mode;
                    self.note(format!("{at}: budget now {budget}; falling back to chunked attention ({mode:?})"));
                }
            }
        }
        if !within(self.need(&s, at), budget.bytes()) {
            if let Some(tiles) = cheapest_tiles(&self.model, &self.shape, &s, budget.bytes()) {
                if VaeDecode::Tiled(tiles) != s.vae {
                    s.vae = VaeDecode::Tiled(tiles);
                    self.note(format!("{at}: budget now {budget}; falling back to tiled VAE decoding ({} latent px tiles)", tiles.tile()));
                }
            }
        }
        let need = self.need(&s, at);
        self.strategy.set(s);
        if !within(need, budget.bytes()) {
            return Err(RunError::OverBudget {
                when: at.to_string(),
                budget: budget.to_string(),
                need: mib(with_headroom(need)),
                plan: s.label(),
            });
        }
        Ok(s)
    }

    fn note(&self, line: String) {
        eprintln!("memory: {line}");
        tracing::warn!("{line}");
        self.notes.borrow_mut().push(line);
    }
}
