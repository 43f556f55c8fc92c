//! What the three APIs share about jobs: sampler names (brume's and A1111's),
//! decoding uploaded pictures off the async threads, and running a job to its
//! end for the synchronous APIs (cancelled if the client goes away).

use std::sync::Arc;

use brume::samplers::SamplerKind;
use brume_runtime::{InputImage, JobId, JobSpec, JobState, JobStatus, Runtime};

use crate::error::{image_error, ApiError};
use crate::state::{blocking, AppState};

/// A1111's sampler names for brume's samplers (A1111 1.9+ splits "Karras" off
/// into `scheduler`; both spellings are accepted).
pub const A1111_SAMPLERS: &[(&str, SamplerKind, &[&str])] = &[
    (
        "Euler a",
        SamplerKind::EulerAncestral,
        &["k_euler_a", "k_euler_ancestral", "euler_ancestral"],
    ),
    ("Euler", SamplerKind::Euler, &["k_euler"]),
    ("DPM++ 2M", SamplerKind::DpmPP2M, &["k_dpmpp_2m"]),
    (
        "DPM++ 2M Karras",
        SamplerKind::DpmPP2MKarras,
        &["k_dpmpp_2m_ka"],
    ),
    ("DPM++ 2M SDE", SamplerKind::DpmPP2MSde, &["k_dpmpp_2m_sde"]),
    ("DDIM", SamplerKind::Ddim, &[]),
    ("DDPM", SamplerKind::Ddpm, &[]),
    ("Heun", SamplerKind::Heun, &["k_heun"]),
    ("UniPC", SamplerKind::UniPc, &["unipc"]),
    ("LCM", SamplerKind::Lcm, &[]),
    ("TCD", SamplerKind::Tcd, &[]),
];

/// A sampler's A1111 label.
pub fn label(kind: SamplerKind) -> &'static str {
    A1111_SAMPLERS
        .iter()
        .find(|(_, k, _)| *k == kind)
        .map(|(l, _, _)| *l)
        .unwrap_or(kind.cli_name())
}

/// A sampler by brume's name (`dpmpp_2m_karras`), A1111's label (`DPM++ 2M
/// Karras`, any case) or one of A1111's aliases.
pub fn parse_sampler(name: &str) -> Option<SamplerKind> {
    let n = name.trim();
    SamplerKind::ALL
        .iter()
        .copied()
        .find(|k| k.cli_name().eq_ignore_ascii_case(n))
        .or_else(|| {
            A1111_SAMPLERS
                .iter()
                .find(|(l, _, aliases)| {
                    l.eq_ignore_ascii_case(n) || aliases.iter().any(|a| a.eq_ignore_ascii_case(n))
                })
                .map(|(_, k, _)| *k)
        })
}

pub fn sampler_error(field: &str, name: &str) -> ApiError {
    let labels: Vec<&str> = A1111_SAMPLERS.iter().map(|(l, _, _)| *l).collect();
    ApiError::invalid(
        field,
        format!("unknown sampler `{name}` (known: {})", labels.join(", ")),
    )
}

/// Decodes an uploaded picture with the engine's limits, off the async threads.
pub async fn decode_image(bytes: Vec<u8>, field: &str) -> Result<InputImage, ApiError> {
    let f = field.to_string();
    blocking(move || InputImage::from_bytes(&bytes, &f))
        .await?
        .map_err(|e| image_error(field, e))
}

/// Cancels its job when dropped armed: a synchronous request whose client hung
/// up does not keep the worker busy.
pub struct JobGuard {
    runtime: Runtime,
    id: JobId,
    armed: bool,
}

impl JobGuard {
    pub fn new(runtime: Runtime, id: JobId) -> Self {
        Self {
            runtime,
            id,
            armed: true,
        }
    }

    pub fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for JobGuard {
    fn drop(&mut self) {
        if self.armed && self.runtime.cancel(self.id) {
            tracing::debug!(job = %self.id, "the client went away; job cancelled");
        }
    }
}

/// Submits a job and waits for its end (the A1111 and OpenAI APIs answer
/// with the pictures). `rename` maps the runtime's field names to the API's.
pub async fn run_to_end(
    state: &AppState,
    spec: JobSpec,
    rename: fn(&str) -> Option<&'static str>,
) -> Result<JobStatus, ApiError> {
    let id = state
        .runtime
        .submit(spec)
        .map_err(|e| ApiError::from(e).rename_field(rename))?;
    let guard = JobGuard::new(state.runtime.clone(), id);
    let status = state.runtime.finished(id).await;
    guard.disarm();
    let status = status.ok_or_else(|| {
        ApiError::internal("job", format!("job {id} was forgotten before it finished"))
    })?;
    match &status.state {
        JobState::Failed(e) => Err(job_error(e).rename_field(rename)),
        _ => Ok(status),
    }
}

/// A failed job as a client error: the request did not fit (size, budget, the
/// model), or the server failed (storage, engine).
pub fn job_error(e: &brume_runtime::JobError) -> ApiError {
    use brume_runtime::JobErrorKind as K;
    match e.kind {
        K::Invalid | K::OverBudget => {
            ApiError::invalid(e.field.unwrap_or("request"), e.message.clone())
        }
        K::Model => ApiError::invalid(e.field.unwrap_or("model"), e.message.clone()),
        K::Storage | K::Engine => ApiError::internal("job", &e.message),
    }
}

/// The gallery id a picture was stored as.
pub fn gallery_id(img: &brume_runtime::GeneratedImage) -> Option<i64> {
    img.stored_as.as_deref().and_then(|s| s.parse().ok())
}

pub type Png = Arc<Vec<u8>>;
