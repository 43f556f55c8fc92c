//! The memory options every model-running command takes, and turning them into
//! a plan (budget, strategy, fallbacks) and run options with a headroom guard.

use std::path::PathBuf;
use std::rc::Rc;

use anyhow::{bail, Context};
use brume::memory::planner::{self, fixed, ResolutionFallback};
use brume::memory::{Branches, Guard, ModelProfile, Plan, PrecisionVariant, RequestShape, Residency, Strategy, VaeDecode};
use brume::pipelines::{GenerationRequest, OpenOptions, RunOptions, SdModel};
use brume::runtime::budget::Budget;
use candle_core::DType;

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

/// What a planned command does, which decides what the plan may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Job {
    /// txt2img at the requested size, or smaller if the user's
    /// `--resolution-fallback` allows it.
    Generate,
    /// txt2img that must keep the requested size (the judge of `eval adherence`
    /// needs the native size): no resolution fallback.
    GenerateAtSize,
    /// img2img / inpaint / outpaint: the VAE encoder runs too, the size is the
    /// input picture's, and the pipelines load segment by segment.
    Edit,
}

impl Job {
    fn encodes_image(self) -> bool {
        self == Job::Edit
    }

    fn keeps_size(self) -> bool {
        self != Job::Generate
    }
}

/// A planned run: the options to pass to a pipeline, and the model to run
/// (the requested one, or a lower-precision variant the plan chose).
pub struct PlannedRun {
    pub plan: Plan,
    pub opts: RunOptions,
    pub variant: Option<SdModel>,
}

impl MemoryArgs {
    pub fn budget(&self) -> anyhow::Result<Budget> {
        Ok(Budget::resolve(self.device_tier.as_deref(), self.memory_budget.as_deref())?)
    }

    /// Plans `req` on `model` within the budget, tells the user which fallback
    /// it took (stderr), and returns run options carrying the plan and a guard.
    /// Refuses (an error naming the budget and the smallest need) before any
    /// weight is loaded when nothing fits.
    pub fn plan(&self, model: &SdModel, req: &GenerationRequest, job: Job) -> anyhow::Result<PlannedRun> {
        let encodes_image = job.encodes_image();
        let budget = self.budget()?;
        let dtype = DType::F32;
        let profile = ModelProfile::of(model, dtype);
        let shape = RequestShape { batch: req.batch, guided: req.guided(model), width: req.width, height: req.height, encodes_image };
        let resolution = if job.keeps_size() { ResolutionFallback::Off } else { ResolutionFallback::parse(&self.resolution_fallback)? };
        let mut variant_models = Vec::new();
        for dir in &self.precision_variant {
            let m = SdModel::open(dir, &OpenOptions::default()).with_context(|| format!("opening precision variant {}", dir.display()))?;
            variant_models.push(m);
        }
        let profiles: Vec<ModelProfile> = variant_models.iter().map(|m| ModelProfile::of(m, dtype)).collect();
        let variants: Vec<PrecisionVariant> = profiles
            .iter()
            .zip(&self.precision_variant)
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
        eprintln!("{}", plan.summary());
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

/// The strategy `--memory-plan NAME` fixes (chunk and tile sizes the largest that fit `budget`).
pub fn fixed_strategy(name: &str, profile: &ModelProfile, shape: &RequestShape, budget: u64) -> anyhow::Result<Strategy> {
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
        other => bail!("--memory-plan `{other}`: expected auto, resident, sequential, split, chunked or tiled"),
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
