//! The runtime's result sink: every picture goes into the gallery before its
//! job is reported done, once (the gallery returns the first row for a
//! repeated job key).

use std::sync::Arc;

use brume_gallery::{Gallery, ImageId, NewImage};
use brume_runtime::{GeneratedImage, ResultSink, StoreContext};

pub struct GallerySink {
    pub gallery: Arc<Gallery>,
    /// Makes job keys unique across restarts (the runtime numbers jobs from 1
    /// each time it starts; the gallery would take a new job 1 for the old one).
    pub session: String,
}

impl GallerySink {
    pub fn new(gallery: Arc<Gallery>) -> Self {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        let session = format!("{ms:x}-{:08x}", rand::random::<u32>());
        Self { gallery, session }
    }
}

impl ResultSink for GallerySink {
    fn store(
        &self,
        job: &StoreContext<'_>,
        images: &[GeneratedImage],
    ) -> Result<Vec<String>, String> {
        let parent = job
            .spec
            .parent
            .as_deref()
            .and_then(|p| p.parse::<ImageId>().ok());
        let timings = serde_json::to_value(job.timings).ok();
        let key = format!("{}:{}", self.session, job.job);
        let mut ids = Vec::with_capacity(images.len());
        for img in images {
            let mut new = NewImage::from_recipe(img.png.to_vec(), &img.recipe);
            new.model = Some(job.model.to_string());
            new.model_hash = Some(job.model_hash.to_string());
            new.timings = timings.clone();
            new.parent = parent;
            new.job = Some((key.clone(), img.index as u32));
            let id = self.gallery.add(new).map_err(|e| e.to_string())?;
            ids.push(id.to_string());
        }
        tracing::debug!(job = %job.job, images = ids.len(), "stored in the gallery");
        Ok(ids)
    }
}
