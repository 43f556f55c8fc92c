//! Memory as a first-class constraint: what a request will need (the
//! estimator), the ways to need less (strategies), and the planner that picks
//! the least lossy way to fit a budget.
//!
//! On a phone the OS does not fail an allocation when memory runs out: it kills
//! the app. The only defence is to know the need before the first large
//! allocation and to plan for it.

pub mod estimate;
pub mod sim;
pub mod strategy;

pub use estimate::{estimate, segment_weights, Estimate, Footprint, ModelProfile, RequestShape, SegmentWeights};
pub use sim::Kernels;
pub use strategy::{AttentionMode, Branches, Residency, Strategy, TileSpec, VaeDecode};
pub mod guard;
pub mod planner;

pub use guard::{Checkpoint, Guard};
pub use planner::{plan, Plan, PrecisionVariant, ReducedOutput, ResolutionFallback, RunSize};
