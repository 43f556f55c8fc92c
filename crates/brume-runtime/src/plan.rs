//! Memory planning for a job: the budget, the plan that fits it (or the
//! refusal that names the smallest need), and the run options with the guard
//! that re-checks headroom before each segment and step. The CLI and the
//! service plan through this one place.

use std::path::PathBuf;
use std::rc::Rc;

use brume::memory::planner::{self, fixed, ResolutionFallback};
use brume::memory::{Branches, Guard, ModelProfile, Plan, PrecisionVariant, RequestShape, Residency, Strategy, VaeDecode};
use brume::pipelines::{GenerationRequest, OpenOptions, RunOptions, SdModel};
use brume::runtime::budget::Budget;
use brume::RunError;
use candle_core::DType;

/// How jobs meet the memory budget (the CLI's memory options).
#[derive(Debug, Clone)]
pub struct MemoryPolicy {
    /// A device class's safe budget (`a17-pro`, `m2`, `desktop-16gb`, ...).
    pub device_tier: Option<String>,
    /// An explicit budget (`1.2GB`); neither: what the OS says is available now.
    pub memory_budget: Option<String>,
    /// `auto`, or a fixed plan: resident, sequential, split, chunked, tiled.
    pub memory_plan: String,
    /// When only a smaller picture fits: upscale, report or off.
    pub resolution_fallback: String,
    /// Lower-precision copies of the model tried when nothing else fits.
    pub precision_variants: Vec<PathBuf>,
}

impl Default for MemoryPolicy {
    fn default() -> Self {
        Self {
            device_tier: None,
            memory_budget: None,
            memory_plan: "auto".into(),
            resolution_fallback: "upscale".into(),
            precision_variants: Vec::new(),
        }
    }
}

/// What a planned job does, which decides what the plan may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanJob {
    /// txt2img at the requested size, or smaller if the resolution fallback allows it.
    Generate,
    /// txt2img that must keep the requested size (the judge of `eval adherence`).
    GenerateAtSize,
    /// img2img / inpaint / outpaint: the VAE encoder runs too, the size is the
    /// input picture's, and the pipelines load segment by segment.
    Edit,
}

impl PlanJob {
    fn encodes_image(self) -> bool {
        self == PlanJob::Edit
    }

    fn keeps_size(self) -> bool {
        self != PlanJob::Generate
    }
}

/// A planned run: the options to pass to a pipeline, and the model to run (the
/// requested one, or a lower-precision variant the plan chose).
pub struct PlannedRun {
    pub plan: Plan,
    pub opts: RunOptions,
    pub variant: Option<SdModel>,
}

impl MemoryPolicy {
    pub fn budget(&self) -> Result<Budget, RunError> {
        Budget::resolve(self.device_tier.as_deref(), self.memory_budget.as_deref())
    }

    /// Checks the policy's words before any job runs (a bad plan name is the
    /// user's typo, not a job failure).
    pub fn validate(&self) -> Result<(), RunError> {
        self.budget()?;
        ResolutionFallback::parse(&self.resolution_fallback)?;
        if !matches!(self.memory_plan.as_str(), "auto" | "resident" | "sequential" | "split" | "chunked" | "tiled") {
            return Err(RunError::Invalid(format!(
                "memory plan `{}`: expected auto, resident, sequential, split, chunked or tiled",
                self.memory_plan
            )));
        }
        Ok(())
    }

    /// Plans `req` on `model` within the budget. Refuses (an error naming the
    /// budget and the smallest need) before any weight is loaded when nothing fits.
    pub fn plan(&self, model: &SdModel, req: &GenerationRequest, job: PlanJob) -> Result<PlannedRun, RunError> {
        let encodes_image = job.encodes_image();
        let budget = self.budget()?;
        let dtype = DType::F32;
        let profile = ModelProfile::of(model, dtype);
        let shape = RequestShape { batch: req.batch, guided: req.guided(model), width: req.width, height: req.height, encodes_image };
        let resolution = if job.keeps_size() { ResolutionFallback::Off } else { ResolutionFallback::parse(&self.resolution_fallback)? };
        let mut variant_models = Vec::new();
        for dir in &self.precision_variants {
            let m = SdModel::open(dir, &OpenOptions::default())?;
            variant_models.push(m);
        }
        let profiles: Vec<ModelProfile> = variant_models.iter().map(|m| ModelProfile::of(m, dtype)).collect();
        let variants: Vec<PrecisionVariant> = profiles
            .iter()
            .zip(&self.precision_variants)
            .map(|(p, dir)| PrecisionVariant { label: dir.display().to_string(), model: p })
            .collect();
        let mut plan = match self.memory_plan.as_str() {
            "auto" => planner::plan(&profile, &shape, &budget, resolution, &variants)?,
            name => fixed(&profile, &shape, &budget, fixed_strategy(name, &profile, &shape, budget.bytes())?)?,
        };
        if encodes_image && plan.strategy.residency == Residency::AllResident {
            // The editing pipelines load segment by segment; that needs no more than planned.
            plan.strategy.residency = Residency::Sequential;
        }
        let e = &plan.estimate;
        tracing::info!(
            "estimated private peaks: text {}, encode {}, unet {}, decode {}",
            brume::runtime::memory::mib(e.text.private_dirty),
            brume::runtime::memory::mib(e.encode.private_dirty),
            brume::runtime::memory::mib(e.unet.private_dirty),
            brume::runtime::memory::mib(e.decode.private_dirty)
        );
        let (run_profile, variant) = match &plan.variant {
            Some((i, _)) => (profiles[*i].clone(), Some(variant_models.swap_remove(*i))),
            None => (profile, None),
        };
        let (width, height) = plan.run_size((shape.width, shape.height));
        let run_shape = RequestShape { width, height, ..shape };
        let probe_budget = budget.clone();
        let guard = Guard::new(run_profile, run_shape, plan.strategy, Box::new(move || probe_budget.refreshed()));
        let opts = RunOptions { strategy: plan.strategy, guard: Some(Rc::new(guard)), ..RunOptions::default() };
        Ok(PlannedRun { plan, opts, variant })
    }
}

/// The strategy a fixed plan name means (chunk and tile sizes the largest that fit `budget`).
pub fn fixed_strategy(name: &str, profile: &ModelProfile, shape: &RequestShape, budget: u64) -> Result<Strategy, RunError> {
    let seq = Strategy { residency: Residency::Sequential, ..Strategy::PLAIN };
    Ok(match name {
        "resident" => Strategy::PLAIN,
        "sequential" => seq,
        "split" => Strategy { branches: Branches::OneAtATime, ..seq },
        "chunked" | "tiled" => {
            let mut s = seq;
            s.attention = planner::cheapest_attention(profile, shape, &s, budget).unwrap_or(s.attention);
            if name == "tiled" {
                if let Some(t) = planner::cheapest_tiles(profile, shape, &s, budget) {
                    s.vae = VaeDecode::Tiled(t);
                }
            }
            s
        }
        other => {
            return Err(RunError::Invalid(format!(
                "--memory-plan `{other}`: expected auto, resident, sequential, split, chunked or tiled"
            )))
        }
    })
}

impl PlannedRun {
    /// The size to generate at (smaller than requested after a resolution fallback).
    pub fn run_size(&self, req: &GenerationRequest) -> (usize, usize) {
        self.plan.run_size((req.width, req.height))
    }

    /// What the recipe records: the plan and its fallbacks, and any fallback
    /// taken during the run. No budget or estimate figures: they vary from run
    /// to run and the recipe must not (re-creating a picture gives the same PNG).
    pub fn recipe_line(&self) -> String {
        let fb = self.plan.fallbacks();
        let mut s = if fb.is_empty() {
            format!("{}: no fallback", self.plan.strategy.label())
        } else {
            format!("{}: {}", self.plan.strategy.label(), fb.join(", "))
        };
        if let Some(g) = &self.opts.guard {
            for n in g.notes() {
                s.push_str("; ");
                s.push_str(&n);
            }
        }
        s
    }
}
