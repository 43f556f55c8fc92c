//! Opened models kept between jobs, least recently used evicted first.
//!
//! "Warm" here is an opened model: its configs, tokenizer and weight maps, so a
//! job skips re-reading and re-parsing them. Each job's segments (text
//! encoder, UNet, VAE) are built from those maps under the memory plan's
//! residency, which decides what stays in private memory, so the planner's
//! accounting holds whatever is warm.

use std::rc::Rc;
use std::time::Instant;

use brume::pipelines::SdModel;

use crate::registry::ModelEntry;

struct WarmModel {
    model: String,
    unet: String,
    sd: Rc<SdModel>,
    used: Instant,
}

pub(crate) struct Warm {
    models: Vec<WarmModel>,
    limit: usize,
}

impl Warm {
    pub(crate) fn new(limit: usize) -> Self {
        Self { models: Vec::new(), limit: limit.max(1) }
    }

    /// The model with UNet folder `unet`, opened now or kept from an earlier job.
    pub(crate) fn get(&mut self, entry: &ModelEntry, unet: &str) -> Result<Rc<SdModel>, brume::error::LoadError> {
        if let Some(w) = self.models.iter_mut().find(|w| w.model == entry.name && w.unet == unet) {
            w.used = Instant::now();
            return Ok(w.sd.clone());
        }
        let sd = Rc::new(entry.open(Some(unet))?);
        tracing::info!(model = %entry.name, unet, "opened model");
        self.models.push(WarmModel { model: entry.name.clone(), unet: unet.to_string(), sd: sd.clone(), used: Instant::now() });
        while self.models.len() > self.limit {
            let Some(oldest) = self.models.iter().enumerate().min_by_key(|(_, w)| w.used).map(|(i, _)| i) else { break };
            let w = self.models.remove(oldest);
            tracing::info!(model = %w.model, unet = %w.unet, "evicted model (least recently used)");
        }
        Ok(sd)
    }

    /// Drops every model (after a failure that may have left one half-loaded).
    pub(crate) fn clear(&mut self) {
        self.models.clear();
    }

    pub(crate) fn len(&self) -> usize {
        self.models.len()
    }
}
