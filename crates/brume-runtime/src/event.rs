//! What a job reports while and after it runs.

use std::sync::Arc;

use brume::pipelines::recipe::Recipe;

use crate::error::JobError;
use crate::job::JobId;

/// Why a job was cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelReason {
    /// A client asked (cancel, A1111's interrupt).
    User,
    /// A newer job of the same client's latest-wins lane replaced it.
    Superseded,
    /// It ran past the runtime's time limit per job.
    Timeout,
    /// The runtime shut down before it finished.
    Shutdown,
}

impl CancelReason {
    pub fn name(self) -> &'static str {
        match self {
            CancelReason::User => "user",
            CancelReason::Superseded => "superseded",
            CancelReason::Timeout => "timeout",
            CancelReason::Shutdown => "shutdown",
        }
    }
}

/// Where a job stands.
#[derive(Debug, Clone, PartialEq)]
pub enum JobState {
    /// Waiting; `position` 0 is next.
    Queued { position: usize },
    /// Step `step` of `total` done (0 while loading); `eta_ms` once a step has run.
    Running { step: usize, total: usize, eta_ms: Option<u64> },
    Done,
    Failed(JobError),
    Cancelled(CancelReason),
}

impl JobState {
    pub fn name(&self) -> &'static str {
        match self {
            JobState::Queued { .. } => "queued",
            JobState::Running { .. } => "running",
            JobState::Done => "done",
            JobState::Failed(_) => "failed",
            JobState::Cancelled(_) => "cancelled",
        }
    }

    pub fn is_finished(&self) -> bool {
        matches!(self, JobState::Done | JobState::Failed(_) | JobState::Cancelled(_))
    }
}

/// Where a job's time went, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Timings {
    /// From submission to the start of its (last) run.
    pub queued_ms: f64,
    /// Loading and running the text encoder; 0 when the conditioning cache held the prompt.
    pub text_encoder_ms: f64,
    /// Whether the prompt's conditioning came from the cache (the text encoder did not run).
    pub text_encoder_cached: bool,
    /// VAE encoding of an edit's picture (with its load).
    pub encode_ms: f64,
    /// The UNet's load and every denoising step.
    pub denoise_ms: f64,
    /// VAE decoding (with its load) and the finishing of the pictures.
    pub decode_ms: f64,
    /// From the start of the run to the result, PNGs encoded.
    pub total_ms: f64,
    pub steps: usize,
    /// Times an interactive job preempted this one (each restart runs it again).
    pub preemptions: u32,
}

/// One finished picture.
#[derive(Debug, Clone)]
pub struct GeneratedImage {
    /// The PNG, with the recipe's `parameters` and `brume-recipe` chunks.
    pub png: Arc<Vec<u8>>,
    pub width: u32,
    pub height: u32,
    /// Its place in the batch (0-based).
    pub index: usize,
    pub recipe: Recipe,
    /// What the result sink stored it as (e.g. the gallery id), when there is a sink.
    pub stored_as: Option<String>,
}

/// A finished job's result.
#[derive(Debug, Clone)]
pub struct JobOutput {
    pub images: Vec<GeneratedImage>,
    pub timings: Timings,
    /// The model's registry name and the UNet folder that ran.
    pub model: String,
    pub unet: String,
    /// The seed used (the requested one, or the one drawn for it).
    pub seed: u64,
    /// The memory plan and its fallbacks, as the recipe records it.
    pub memory_plan: String,
    /// What the user should know about how the request was read (a prompt cut
    /// at the text encoder's length); also sent as [`EventKind::Notice`].
    pub notices: Vec<String>,
}

/// What the runtime broadcasts; every event names its job and that job's client.
#[derive(Debug, Clone)]
pub struct JobEvent {
    pub job: JobId,
    pub client: Option<String>,
    pub kind: EventKind,
}

#[derive(Debug, Clone)]
pub enum EventKind {
    Queued { position: usize },
    Started,
    /// The memory plan chosen for the run, in words (the CLI prints it).
    Planned { summary: String },
    /// Something the user should know about how the request was read (a prompt
    /// cut at the text encoder's length). It may quote the prompt: it goes to the
    /// job's client, never to a log.
    Notice { message: String },
    /// A segment was loaded (text encoder, VAE encoder, UNet, VAE decoder).
    Loaded { segment: String },
    Step { step: usize, total: usize, eta_ms: Option<u64> },
    /// A step preview (PNG), throttled by the job's preview policy.
    Preview { step: usize, png: Arc<Vec<u8>> },
    /// An interactive job took the worker; this one is queued again at the head
    /// of the batch queue and will restart.
    Preempted,
    Done { output: Arc<JobOutput> },
    Failed { error: JobError },
    Cancelled { reason: CancelReason },
}
