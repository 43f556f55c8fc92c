//! The memory options every model-running command takes, and turning them into
//! a plan (budget, strategy, fallbacks) and run options with a headroom guard.

use std::path::PathBuf;

use brume::pipelines::{GenerationRequest, SdModel};
use brume::runtime::budget::Budget;
use brume_runtime::MemoryPolicy;

/// The memory budget and how to meet it, shared by every command that runs a model.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct MemoryArgs {
    /// Plan for a device class's safe model budget: a16, a17-pro, m2, m4,
    /// iphone-8gb, desktop-8gb, desktop-16gb, desktop-32gb (see `brume doctor`).
    #[arg(long, value_name = "NAME", conflicts_with = "memory_budget")]
    pub device_tier: Option<String>,
    /// Plan for this much private memory, e.g. 1.2GB, 700MB, 2GiB
    /// (default: what the OS says is available now).
    #[arg(long, value_name = "SIZE")]
    pub memory_budget: Option<String>,
    /// auto (the least lossy plan that fits), or a fixed one: resident,
    /// sequential, split (sequential + guidance branches through the UNet one at
    /// a time: half its activations, the same picture), chunked (sequential + chunked attention; the same as sequential
    /// where the fused attention kernel runs, which forms no score matrix), tiled
    /// (+ tiled VAE decoding).
    #[arg(long, default_value = "auto", value_name = "PLAN")]
    pub memory_plan: String,
    /// When only a smaller picture fits: upscale (generate smaller, resize the
    /// output to the requested size), report (write the smaller picture), off (refuse).
    #[arg(long, default_value = "upscale", value_name = "HOW")]
    pub resolution_fallback: String,
    /// A lower-precision copy of the model (a diffusers folder), tried when
    /// nothing else fits; repeat for several, most precise first.
    #[arg(long, value_name = "DIR")]
    pub precision_variant: Vec<PathBuf>,
    /// Print the measured peaks (RSS from the kernel, sampled private dirty) on
    /// stderr as one `memory-report` line (used by `brume bench memory`).
    #[arg(long, hide = true)]
    pub memory_report: bool,
}

/// What a planned command does (the runtime's words for it).
pub use brume_runtime::plan::PlanJob as Job;
pub use brume_runtime::plan::{fixed_strategy, PlannedRun};

impl MemoryArgs {
    pub fn budget(&self) -> anyhow::Result<Budget> {
        Ok(Budget::resolve(self.device_tier.as_deref(), self.memory_budget.as_deref())?)
    }

    /// The runtime's memory policy from these options.
    pub fn policy(&self) -> MemoryPolicy {
        MemoryPolicy {
            device_tier: self.device_tier.clone(),
            memory_budget: self.memory_budget.clone(),
            memory_plan: self.memory_plan.clone(),
            resolution_fallback: self.resolution_fallback.clone(),
            precision_variants: self.precision_variant.clone(),
        }
    }

    /// Plans `req` on `model` within the budget (the runtime's planner, which
    /// `generate`, `edit` and `brume serve` use too), and tells the user which
    /// fallback it took (stderr). Refuses before any weight is loaded when nothing fits.
    pub fn plan(&self, model: &SdModel, req: &GenerationRequest, job: Job) -> anyhow::Result<PlannedRun> {
        let planned = self.policy().plan(model, req, job)?;
        eprintln!("{}", planned.plan.summary());
        Ok(planned)
    }
}

/// Prints the `memory-report` line when asked (the bench parses it).
pub struct Report(Option<brume::runtime::memory::PeakWatch>);

impl Report {
    pub fn start(enabled: bool) -> Self {
        Self(enabled.then(|| brume::runtime::memory::PeakWatch::start(std::time::Duration::from_millis(5))))
    }

    pub fn finish(self) {
        if let Some(w) = self.0 {
            let (rss, dirty) = w.finish();
            eprintln!("memory-report peak_rss={} peak_private_dirty={}", rss.unwrap_or(0), dirty.unwrap_or(0));
        }
    }
}
