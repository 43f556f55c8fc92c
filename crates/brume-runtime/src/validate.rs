//! Checks a job against the service's limits and the model before it queues,
//! so a bad request is refused at once with the field named, not failed later.

use crate::error::SubmitError;
use crate::job::{Edit, JobSpec};
use crate::registry::ModelInfo;

/// The limits a runtime enforces on every job.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Largest side of a requested or uploaded picture, in pixels.
    pub max_side: usize,
    /// Smallest side of a generated picture.
    pub min_side: usize,
    pub max_steps: usize,
    pub max_batch: usize,
    /// Largest prompt, in bytes (the text encoder reads 77 tokens; this bounds work).
    pub max_prompt_bytes: usize,
    pub max_feather: usize,
    /// Classifier-free guidance scale range (A1111 offers 1-30; beyond ~50 the
    /// pictures saturate to black).
    pub max_guidance: f64,
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_side: 4096, min_side: 64, max_steps: 150, max_batch: 8, max_prompt_bytes: 8192, max_feather: 256, max_guidance: 50.0 }
    }
}

fn invalid(field: &'static str, message: impl Into<String>) -> SubmitError {
    SubmitError::invalid(field, message)
}

/// Checks `spec` against `limits` and `model` (the one it names, resolved).
pub fn check(spec: &JobSpec, model: &ModelInfo, limits: &Limits) -> Result<(), SubmitError> {
    let unet_name = spec.unet.as_deref().unwrap_or("unet");
    let Some(unet) = model.unet(unet_name) else {
        let known: Vec<&str> = model.unets.iter().map(|u| u.name.as_str()).collect();
        return Err(invalid("unet", format!("model `{}` has no UNet `{unet_name}` (it has: {})", model.name, known.join(", "))));
    };
    if spec.prompt.len() > limits.max_prompt_bytes {
        return Err(invalid("prompt", format!("{} bytes; the limit is {}", spec.prompt.len(), limits.max_prompt_bytes)));
    }
    if spec.negative_prompt.as_ref().is_some_and(|n| n.len() > limits.max_prompt_bytes) {
        return Err(invalid("negative_prompt", format!("longer than {} bytes", limits.max_prompt_bytes)));
    }
    if let Some(steps) = spec.steps {
        if steps == 0 || steps > limits.max_steps {
            return Err(invalid("steps", format!("must be 1..={}, got {steps}", limits.max_steps)));
        }
    }
    if let Some(g) = spec.guidance {
        if !g.is_finite() || !(0.0..=limits.max_guidance).contains(&g) {
            return Err(invalid("guidance", format!("must be a number in 0..={}, got {g}", limits.max_guidance)));
        }
    }
    if !spec.eta.is_finite() || !(0.0..=1.0).contains(&spec.eta) {
        return Err(invalid("eta", format!("must be in 0..=1, got {}", spec.eta)));
    }
    if spec.clip_skip >= model.text_layers {
        return Err(invalid("clip_skip", format!("must be below the text encoder's {} layers, got {}", model.text_layers, spec.clip_skip)));
    }
    if spec.batch == 0 || spec.batch > limits.max_batch {
        return Err(invalid("batch", format!("must be 1..={}, got {}", limits.max_batch, spec.batch)));
    }
    let side = |field: &'static str, v: usize| -> Result<(), SubmitError> {
        let m = model.size_multiple;
        if v < limits.min_side || v > limits.max_side || v % m != 0 {
            return Err(invalid(field, format!("sides must be multiples of {m} in {}..={}, got {v}", limits.min_side, limits.max_side)));
        }
        Ok(())
    };
    let image_side = |field: &'static str, (w, h): (u32, u32)| -> Result<(), SubmitError> {
        let (w, h) = (w as usize, h as usize);
        if w > limits.max_side || h > limits.max_side {
            return Err(invalid(field, format!("is {w}x{h}; the largest side accepted is {}", limits.max_side)));
        }
        if w < model.size_multiple || h < model.size_multiple {
            return Err(invalid(field, format!("is {w}x{h}; each side must be at least {} pixels", model.size_multiple)));
        }
        Ok(())
    };
    let strength = |s: Option<f64>| -> Result<(), SubmitError> {
        match s {
            Some(s) if !brume::pipelines::img2img::strength_in_range(s) => Err(invalid("strength", format!("must be in (0, 1], got {s}"))),
            _ => Ok(()),
        }
    };
    let feather = |f: usize| -> Result<(), SubmitError> {
        if f > limits.max_feather {
            return Err(invalid("feather", format!("must be 0..={}, got {f}", limits.max_feather)));
        }
        Ok(())
    };
    match &spec.edit {
        Edit::None => {
            if unet.inpainting {
                return Err(invalid("mode", format!("UNet `{unet_name}` is an inpainting UNet: send an image and a mask")));
            }
            side("width", spec.width.unwrap_or(model.default_size))?;
            side("height", spec.height.unwrap_or(model.default_size))?;
        }
        Edit::Img2img { image, strength: s } => {
            if unet.inpainting {
                return Err(invalid("mask", format!("UNet `{unet_name}` is an inpainting UNet: it needs a mask")));
            }
            image_side("image", image.size())?;
            strength(*s)?;
        }
        Edit::Inpaint { image, mask, strength: s, feather: f } => {
            image_side("image", image.size())?;
            if mask.size() != image.size() {
                let (mw, mh) = mask.size();
                let (iw, ih) = image.size();
                return Err(invalid("mask", format!("is {mw}x{mh} but the image is {iw}x{ih}; they must be the same size")));
            }
            strength(*s)?;
            feather(*f)?;
        }
        Edit::Outpaint { image, extend, feather: f } => {
            image_side("image", image.size())?;
            let (w, h) = image.size();
            if extend.iter().all(|&e| e == 0) {
                return Err(invalid("extend", "all four sides are 0: nothing to outpaint"));
            }
            let (nw, nh) = (w as usize + extend[0] + extend[2], h as usize + extend[1] + extend[3]);
            if extend.iter().any(|&e| e > limits.max_side) || nw > limits.max_side || nh > limits.max_side {
                return Err(invalid("extend", format!("the canvas would be {nw}x{nh}; the largest side accepted is {}", limits.max_side)));
            }
            feather(*f)?;
        }
    }
    Ok(())
}
