//! What a client asks the runtime for: a job's settings, its input pictures,
//! and how it queues (priority, lane).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use brume::pipelines::recipe::InputFile;
use brume::samplers::{RngKind, SamplerKind};

/// A job's number, unique for the runtime's life; clients see it as a string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(pub u64);

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::str::FromStr for JobId {
    type Err = std::num::ParseIntError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse().map(JobId)
    }
}

/// Which jobs go first. Interactive work (a person waiting at the editor) runs
/// before batch work and preempts it at a step boundary; the preempted job goes
/// back to the head of the batch queue and restarts from its seed, so it gives
/// the same pictures it would have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Priority {
    Interactive,
    #[default]
    Batch,
}

/// How a job shares the queue with the same client's other jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Lane {
    /// Every job runs, in order.
    #[default]
    Queue,
    /// "Latest wins": a new job supersedes this client's queued and running jobs of
    /// this lane (the live editor: only the newest stroke matters). The running one
    /// stops at its next step.
    Latest,
}

/// An input picture, decoded, with where it came from for the recipe.
#[derive(Clone)]
pub struct InputImage {
    pub image: Arc<image::DynamicImage>,
    /// The file (path and SHA-256) an edit's recipe records, so `--from` can find
    /// and check it; uploads record their hash under a synthetic name.
    pub source: Option<InputFile>,
}

impl std::fmt::Debug for InputImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "InputImage({}x{}, {:?})", self.image.width(), self.image.height(), self.source)
    }
}

impl InputImage {
    /// A picture read from a file (decoded with the engine's limits).
    pub fn from_path(path: &std::path::Path) -> Result<Self, brume::RunError> {
        let bytes = std::fs::read(path).map_err(|e| brume::RunError::Invalid(format!("{}: cannot read: {e}", path.display())))?;
        let image = brume::pipelines::image_io::decode_image(&bytes, &path.display().to_string())?;
        Ok(Self { image: Arc::new(image), source: Some(InputFile::of(path)?) })
    }

    /// A picture uploaded as bytes; `field` names it in errors (e.g. `init_images[0]`).
    pub fn from_bytes(bytes: &[u8], field: &str) -> Result<Self, brume::RunError> {
        let image = brume::pipelines::image_io::decode_image(bytes, field)?;
        Ok(Self {
            image: Arc::new(image),
            source: Some(InputFile { path: PathBuf::from(format!("upload:{field}")), sha256: sha256_hex(bytes) }),
        })
    }

    pub fn size(&self) -> (u32, u32) {
        (self.image.width(), self.image.height())
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Which pipeline, with its inputs.
#[derive(Debug, Clone, Default)]
pub enum Edit {
    /// Text to image.
    #[default]
    None,
    /// Re-imagine a picture; `strength` in (0, 1] (None: the UNet's default).
    Img2img { image: InputImage, strength: Option<f64> },
    /// Repaint where the mask is white (same size as the picture); the rest is
    /// pasted back with a feathered edge.
    Inpaint { image: InputImage, mask: InputImage, strength: Option<f64>, feather: usize },
    /// Extend the canvas by (left, top, right, bottom) pixels and paint the new area.
    Outpaint { image: InputImage, extend: [usize; 4], feather: usize },
}

impl Edit {
    pub fn mode(&self) -> brume::pipelines::recipe::Mode {
        use brume::pipelines::recipe::Mode;
        match self {
            Edit::None => Mode::Txt2img,
            Edit::Img2img { .. } => Mode::Img2img,
            Edit::Inpaint { .. } => Mode::Inpaint,
            Edit::Outpaint { .. } => Mode::Outpaint,
        }
    }
}

/// When step previews are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreviewPolicy {
    /// Every k steps; 0 turns previews off.
    pub every: usize,
    /// At most one per this interval, so a fast model does not spend its time
    /// encoding previews nobody can watch.
    pub min_interval: Duration,
}

impl Default for PreviewPolicy {
    fn default() -> Self {
        Self { every: 1, min_interval: Duration::from_millis(100) }
    }
}

impl PreviewPolicy {
    pub const OFF: PreviewPolicy = PreviewPolicy { every: 0, min_interval: Duration::ZERO };
}

/// Everything a job asks for. `None` settings take the model's (or its UNet
/// folder's `sampling_defaults.json`) defaults, as `brume generate` does.
#[derive(Debug, Clone)]
pub struct JobSpec {
    /// A model name from the runtime's registry; `None`: the default model.
    pub model: Option<String>,
    /// A UNet subfolder of the model (e.g. `unet_lcm`); `None`: `unet`.
    pub unet: Option<String>,
    pub prompt: String,
    pub negative_prompt: Option<String>,
    pub sampler: Option<SamplerKind>,
    pub steps: Option<usize>,
    pub guidance: Option<f64>,
    /// txt2img size; `None`: the model's native size. Edits use the picture's.
    pub width: Option<usize>,
    pub height: Option<usize>,
    /// `None`: a fresh random seed, reported in the result and its recipe.
    pub seed: Option<u64>,
    pub rng: RngKind,
    pub eta: f64,
    pub clip_skip: usize,
    pub batch: usize,
    pub edit: Edit,
    pub priority: Priority,
    /// Groups a client's jobs (events, the latest-wins lane).
    pub client: Option<String>,
    pub lane: Lane,
    pub previews: PreviewPolicy,
    /// Opaque to the runtime: handed to the result sink (e.g. the gallery id of
    /// the picture an edit started from, for its lineage).
    pub parent: Option<String>,
}

impl JobSpec {
    /// A txt2img job with every setting at its default.
    pub fn txt2img(prompt: impl Into<String>) -> Self {
        Self {
            model: None,
            unet: None,
            prompt: prompt.into(),
            negative_prompt: None,
            sampler: None,
            steps: None,
            guidance: None,
            width: None,
            height: None,
            seed: None,
            rng: RngKind::Brume,
            eta: 0.0,
            clip_skip: 0,
            batch: 1,
            edit: Edit::None,
            priority: Priority::Batch,
            client: None,
            lane: Lane::Queue,
            previews: PreviewPolicy::default(),
            parent: None,
        }
    }
}
