//! A UNet's own recommended sampling settings, read from an optional
//! `sampling_defaults.json` beside its weights.
//!
//! Diffusers has no place for them: a pipeline call defaults to 50 steps and guidance
//! 7.5 whatever the model, and a model card says in prose what works. For Stable
//! Diffusion 1.5 that default is right; for the built-in model it is not (on held-out
//! prompts 200-599, guidance 5 draws 88.9 % of the colours and 38.8 % of the pictures
//! wholly right, 3.5 draws 91.4 % and 45.5 %, and 7 is worse than 5:
//! `tools/train/README.md`, "Default guidance"), and a person who types
//! `brume generate "..."` must get the model's best picture without knowing that.
//! So a UNet folder may carry its settings, in diffusers' own argument names;
//! diffusers ignores the file, so the folder stays a standard one. A file a person
//! wrote by hand is checked like a config: an error names the file and field.

use std::path::Path;

use crate::error::LoadError;
use crate::models::config::ConfigReader;
use crate::samplers::SamplerKind;

/// The file's name inside a UNet folder (`unet/`, `unet_lcm/`).
pub const FILE: &str = "sampling_defaults.json";

/// Diffusers' pipeline default, for models that say nothing.
pub const GUIDANCE: f64 = 7.5;
/// Steps for the ~20-step samplers (DDIM, Euler, DPM-Solver++) when nothing says otherwise.
pub const STEPS: usize = 20;
/// Steps for the few-step samplers (LCM, TCD) when nothing says otherwise.
pub const FEW_STEPS: usize = 4;
/// img2img strength when nothing says otherwise (diffusers' pipeline says 0.8, which
/// keeps little of the picture at 20-50 steps).
pub const STRENGTH: f64 = 0.6;

/// The settings a file may hold (keys starting with `_` are comments, as in diffusers' configs).
const KEYS: [&str; 3] = ["guidance_scale", "num_inference_steps", "strength"];
/// Most steps a file may name: a schedule has 1000 training timesteps.
const MAX_STEPS: usize = 1000;
/// Largest guidance a file may name; past it every picture saturates, so a larger
/// number is a typo (a scale of 75 for 7.5), not a choice.
const MAX_GUIDANCE: f64 = 50.0;

/// What a UNet folder recommends; `None` where it says nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingDefaults {
    /// `guidance_scale`: classifier-free guidance (for an LCM UNet, the scale it embeds).
    pub guidance_scale: Option<f64>,
    /// `num_inference_steps`, meant for the model's own scheduler.
    pub steps: Option<usize>,
    /// `strength` of img2img. It is a share of the steps, so what noise level it starts
    /// from depends on the scheduler's timesteps: at 4 LCM steps 0.6 runs two, from
    /// timestep 499, where 25 DDIM steps at 0.6 run fifteen from 561, and the built-in
    /// LCM UNet then recolours two objects in three where DDIM recolours nine in ten
    /// (`brume eval edits`). A few-step UNet therefore names its own.
    pub strength: Option<f64>,
}

/// The settings a run without explicit ones uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Resolved {
    pub steps: usize,
    pub guidance_scale: f64,
}

impl SamplingDefaults {
    /// Reads a parsed `sampling_defaults.json`, checking each value's range.
    pub fn from_reader(r: &ConfigReader) -> Result<Self, LoadError> {
        // A misspelt key would otherwise be a setting silently not applied.
        if let Some(k) = r.raw().keys().find(|k| !k.starts_with('_') && !KEYS.contains(&k.as_str())) {
            return Err(r.error(k, format!("not a sampling default (expected one of {})", KEYS.join(", "))));
        }
        let guidance_scale = match r.get("guidance_scale") {
            Some(_) => {
                let g = r.f64("guidance_scale", GUIDANCE)?;
                if !(g.is_finite() && (0.0..=MAX_GUIDANCE).contains(&g)) {
                    return Err(r.error("guidance_scale", format!("{g} is not a guidance scale in 0..={MAX_GUIDANCE}")));
                }
                Some(g)
            }
            None => None,
        };
        let steps = r.opt_usize("num_inference_steps")?;
        if let Some(s) = steps {
            if !(1..=MAX_STEPS).contains(&s) {
                return Err(r.error("num_inference_steps", format!("{s} is not a step count in 1..={MAX_STEPS}")));
            }
        }
        let strength = match r.get("strength") {
            Some(_) => {
                let s = r.f64("strength", STRENGTH)?;
                if !crate::pipelines::img2img::strength_in_range(s) {
                    return Err(r.error("strength", format!("{s} is not an img2img strength in (0, 1]")));
                }
                Some(s)
            }
            None => None,
        };
        Ok(Self { guidance_scale, steps, strength })
    }

    /// Reads `dir/sampling_defaults.json`; a folder without one recommends nothing.
    pub fn read_dir(dir: &Path) -> Result<Self, LoadError> {
        let path = dir.join(FILE);
        if path.is_file() {
            Self::from_reader(&ConfigReader::open(&path)?)
        } else {
            Ok(Self::default())
        }
    }

    /// img2img's strength: the explicit one, else the folder's, else [`STRENGTH`]. Like
    /// guidance it applies to any sampler (a few-step UNet names it for its few steps).
    pub fn img2img_strength(&self, explicit: Option<f64>) -> f64 {
        explicit.or(self.strength).unwrap_or(STRENGTH)
    }

    /// The settings for a run on sampler `kind`, where `own` is the model's own
    /// scheduler; explicit `steps` and `guidance` win. The recommended step count is
    /// for the model's own scheduler, so another sampler takes its family's default
    /// (four steps for a few-step sampler, twenty for the rest); guidance belongs to
    /// the model and applies to any sampler.
    pub fn resolve(&self, kind: SamplerKind, own: SamplerKind, steps: Option<usize>, guidance: Option<f64>) -> Resolved {
        let family = if kind.is_few_step() { FEW_STEPS } else { STEPS };
        let recommended = if kind == own { self.steps } else { None };
        Resolved {
            steps: steps.or(recommended).unwrap_or(family),
            guidance_scale: guidance.or(self.guidance_scale).unwrap_or(GUIDANCE),
        }
    }
}
