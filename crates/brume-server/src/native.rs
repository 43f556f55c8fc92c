//! brume's own API under `/api/v1` (the contract in notes/native-api.md):
//! models, samplers, capabilities, jobs (JSON or multipart), their events as
//! Server-Sent Events per job and over a WebSocket per client.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::time::Duration;

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{FromRequest, Multipart, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use brume_gallery::ImageId;
use brume_runtime::{
    Edit, EventKind, JobEvent, JobId, JobOutput, JobSpec, JobState, JobStatus, Lane, PreviewPolicy,
    Priority,
};
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast::error::RecvError;
use utoipa::ToSchema;

use crate::error::{ApiError, ErrorBody, ErrorResponse};
use crate::extract::{decode_base64, from_value, is_multipart, parse_json, read_multipart, Part};
use crate::jobs::{decode_image, gallery_id, label, parse_sampler, sampler_error};
use crate::state::{blocking, AppState};

// ---------------------------------------------------------------- models

#[derive(Debug, Serialize, ToSchema)]
pub struct UnetView {
    pub name: String,
    /// Its scheduler's sampler (brume's name).
    pub sampler: String,
    pub steps: usize,
    pub guidance: f64,
    /// img2img strength.
    pub strength: f64,
    /// A distilled UNet for 1-8 steps.
    pub few_step: bool,
    /// A 9-channel inpainting UNet.
    pub inpainting: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelView {
    pub name: String,
    pub default: bool,
    /// Native output side in pixels.
    pub default_size: usize,
    /// Generated sides are multiples of this.
    pub size_multiple: usize,
    /// First 10 hex digits of the weights' fingerprint.
    pub hash: String,
    pub tiny_vae: bool,
    pub unets: Vec<UnetView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelsResponse {
    pub models: Vec<ModelView>,
}

#[utoipa::path(get, path = "/api/v1/models", tag = "models", responses((status = 200, body = ModelsResponse)))]
pub async fn models(State(st): State<AppState>) -> Json<ModelsResponse> {
    let models = st
        .runtime
        .models()
        .iter()
        .map(|m| ModelView {
            name: m.name.clone(),
            default: m.default,
            default_size: m.default_size,
            size_multiple: m.size_multiple,
            hash: m.hash.clone(),
            tiny_vae: m.tiny_vae,
            unets: m
                .unets
                .iter()
                .map(|u| UnetView {
                    name: u.name.clone(),
                    sampler: u.sampler.clone(),
                    steps: u.steps,
                    guidance: u.guidance,
                    strength: u.strength,
                    few_step: u.few_step,
                    inpainting: u.inpainting,
                })
                .collect(),
        })
        .collect();
    Json(ModelsResponse { models })
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SamplerView {
    /// brume's name (send this, or the label).
    pub name: String,
    /// A1111's name.
    pub label: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SamplersResponse {
    pub samplers: Vec<SamplerView>,
}

#[utoipa::path(get, path = "/api/v1/samplers", tag = "models", responses((status = 200, body = SamplersResponse)))]
pub async fn samplers() -> Json<SamplersResponse> {
    let samplers = brume::samplers::SamplerKind::ALL
        .iter()
        .map(|k| SamplerView {
            name: k.cli_name().to_string(),
            label: label(*k).to_string(),
        })
        .collect();
    Json(SamplersResponse { samplers })
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Capabilities {
    pub version: String,
    pub max_side: usize,
    pub min_side: usize,
    pub max_steps: usize,
    pub max_batch: usize,
    pub max_guidance: f64,
    pub max_prompt_bytes: usize,
    pub queue_limit: usize,
    pub body_limit: usize,
    pub modes: Vec<String>,
}

#[utoipa::path(get, path = "/api/v1/capabilities", tag = "models", responses((status = 200, body = Capabilities)))]
pub async fn capabilities(State(st): State<AppState>) -> Json<Capabilities> {
    let l = st.runtime.limits();
    Json(Capabilities {
        version: env!("CARGO_PKG_VERSION").to_string(),
        max_side: l.max_side,
        min_side: l.min_side,
        max_steps: l.max_steps,
        max_batch: l.max_batch,
        max_guidance: l.max_guidance,
        max_prompt_bytes: l.max_prompt_bytes,
        queue_limit: st.settings.queue_limit,
        body_limit: st.settings.body_limit,
        modes: ["txt2img", "img2img", "inpaint", "outpaint"]
            .map(String::from)
            .to_vec(),
    })
}

// ---------------------------------------------------------------- jobs

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Txt2img,
    Img2img,
    Inpaint,
    Outpaint,
}

#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum PriorityName {
    Interactive,
    Batch,
}

#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum LaneName {
    Queue,
    Latest,
}

/// A job. Every setting left out (or null) takes the model's default.
#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct JobRequest {
    /// Inferred when absent: image + mask = inpaint, image + extend = outpaint, image = img2img, else txt2img.
    #[serde(default)]
    pub mode: Option<Mode>,
    pub prompt: String,
    #[serde(default)]
    pub negative_prompt: Option<String>,
    /// A served model's name; null: the default model.
    #[serde(default)]
    pub model: Option<String>,
    /// A UNet folder of the model (`unet_lcm` for few steps); null: `unet`.
    #[serde(default)]
    pub unet: Option<String>,
    /// brume's name (`dpmpp_2m_karras`) or A1111's (`DPM++ 2M Karras`).
    #[serde(default)]
    pub sampler: Option<String>,
    #[serde(default)]
    pub steps: Option<usize>,
    #[serde(default)]
    pub guidance: Option<f64>,
    /// img2img / inpaint strength in (0, 1].
    #[serde(default)]
    pub strength: Option<f64>,
    /// null: random (the result reports the seed used).
    #[serde(default)]
    pub seed: Option<u64>,
    /// txt2img only; edits keep the picture's size.
    #[serde(default)]
    pub width: Option<usize>,
    #[serde(default)]
    pub height: Option<usize>,
    #[serde(default)]
    pub batch: Option<usize>,
    #[serde(default)]
    pub eta: Option<f64>,
    #[serde(default)]
    pub clip_skip: Option<usize>,
    /// The picture to edit: base64, with or without a `data:image/...;base64,` prefix.
    #[serde(default)]
    pub image: Option<String>,
    /// Inpainting: white = repaint, the image's size.
    #[serde(default)]
    pub mask: Option<String>,
    /// Outpainting: pixels added [left, top, right, bottom].
    #[serde(default)]
    pub extend: Option<Vec<usize>>,
    #[serde(default)]
    pub feather: Option<usize>,
    /// Default batch; interactive jobs go first and preempt batch ones.
    #[serde(default)]
    pub priority: Option<PriorityName>,
    /// Groups a client's jobs (WebSocket events, the latest lane).
    #[serde(default)]
    pub client: Option<String>,
    /// latest: supersedes this client's queued and running latest-lane job.
    #[serde(default)]
    pub lane: Option<LaneName>,
    /// A preview every k steps; 0: none. Default 1 (throttled to 10 per second).
    #[serde(default)]
    pub preview_every: Option<usize>,
    /// The gallery id of the picture this edit started from.
    #[serde(default)]
    pub parent: Option<i64>,
}

/// Pictures sent as multipart files rather than base64 text.
#[derive(Default)]
pub struct Files {
    pub image: Option<Vec<u8>>,
    pub mask: Option<Vec<u8>>,
}

const MAX_CLIENT_CHARS: usize = 128;

/// Builds the runtime's job from a request (decoding its pictures).
pub async fn build_spec(st: &AppState, req: JobRequest, files: Files) -> Result<JobSpec, ApiError> {
    let image_bytes = match (files.image, &req.image) {
        (Some(b), _) => Some(b),
        (None, Some(t)) => Some(decode_base64("image", t)?),
        (None, None) => None,
    };
    let mask_bytes = match (files.mask, &req.mask) {
        (Some(b), _) => Some(b),
        (None, Some(t)) => Some(decode_base64("mask", t)?),
        (None, None) => None,
    };
    let extend: Option<[usize; 4]> = match &req.extend {
        Some(v) => Some(<[usize; 4]>::try_from(v.as_slice()).map_err(|_| {
            ApiError::invalid(
                "extend",
                format!(
                    "needs 4 numbers [left, top, right, bottom], got {}",
                    v.len()
                ),
            )
        })?),
        None => None,
    };
    let mode = req
        .mode
        .unwrap_or(match (&image_bytes, &mask_bytes, &extend) {
            (Some(_), Some(_), _) => Mode::Inpaint,
            (Some(_), None, Some(_)) => Mode::Outpaint,
            (Some(_), None, None) => Mode::Img2img,
            _ => Mode::Txt2img,
        });
    let sampler = match &req.sampler {
        Some(s) => Some(parse_sampler(s).ok_or_else(|| sampler_error("sampler", s))?),
        None => None,
    };
    if let Some(c) = &req.client {
        if c.is_empty() || c.chars().count() > MAX_CLIENT_CHARS || c.chars().any(char::is_control) {
            return Err(ApiError::invalid(
                "client",
                format!("must be 1..={MAX_CLIENT_CHARS} printable characters"),
            ));
        }
    }
    if let Some(p) = req.parent {
        if p <= 0 {
            return Err(ApiError::invalid(
                "parent",
                "must be a gallery id (a positive integer)",
            ));
        }
        let g = st.gallery.clone();
        match blocking(move || g.get(ImageId(p))).await? {
            Ok(_) => {}
            Err(e) if e.is_not_found() => {
                return Err(ApiError::invalid("parent", format!("no gallery image {p}")))
            }
            Err(e) => return Err(e.into()),
        }
    }
    let need = |b: Option<Vec<u8>>, field: &str| {
        b.ok_or_else(|| {
            ApiError::invalid(field, format!("{mode:?} needs `{field}`").to_lowercase())
        })
    };
    let edit = match mode {
        Mode::Txt2img => {
            for (given, field) in [
                (image_bytes.is_some(), "image"),
                (mask_bytes.is_some(), "mask"),
                (extend.is_some(), "extend"),
            ] {
                if given {
                    return Err(ApiError::invalid(
                        field,
                        "txt2img takes no picture; set mode to img2img, inpaint or outpaint",
                    ));
                }
            }
            Edit::None
        }
        Mode::Img2img => {
            let image = decode_image(need(image_bytes, "image")?, "image").await?;
            Edit::Img2img {
                image,
                strength: req.strength,
            }
        }
        Mode::Inpaint => {
            let image = decode_image(need(image_bytes, "image")?, "image").await?;
            let mask = decode_image(need(mask_bytes, "mask")?, "mask").await?;
            Edit::Inpaint {
                image,
                mask,
                strength: req.strength,
                feather: req.feather.unwrap_or(4),
            }
        }
        Mode::Outpaint => {
            let image = decode_image(need(image_bytes, "image")?, "image").await?;
            let extend = extend.ok_or_else(|| {
                ApiError::invalid(
                    "extend",
                    "outpaint needs `extend` [left, top, right, bottom]",
                )
            })?;
            Edit::Outpaint {
                image,
                extend,
                feather: req.feather.unwrap_or(4),
            }
        }
    };
    if mode != Mode::Txt2img {
        for (given, field) in [
            (req.width.is_some(), "width"),
            (req.height.is_some(), "height"),
        ] {
            if given {
                return Err(ApiError::invalid(
                    field,
                    "edits keep the picture's size; leave width and height out",
                ));
            }
        }
    }
    let mut spec = JobSpec::txt2img(req.prompt);
    spec.negative_prompt = req.negative_prompt;
    spec.model = req.model;
    spec.unet = req.unet;
    spec.sampler = sampler;
    spec.steps = req.steps;
    spec.guidance = req.guidance;
    spec.width = req.width;
    spec.height = req.height;
    spec.seed = req.seed;
    spec.eta = req.eta.unwrap_or(0.0);
    spec.clip_skip = req.clip_skip.unwrap_or(0);
    spec.batch = req.batch.unwrap_or(1);
    spec.edit = edit;
    spec.priority = match req.priority {
        Some(PriorityName::Interactive) => Priority::Interactive,
        _ => Priority::Batch,
    };
    spec.client = req.client;
    spec.lane = match req.lane {
        Some(LaneName::Latest) => Lane::Latest,
        _ => Lane::Queue,
    };
    spec.previews = match req.preview_every {
        Some(0) => PreviewPolicy::OFF,
        Some(k) => PreviewPolicy {
            every: k,
            ..PreviewPolicy::default()
        },
        None => PreviewPolicy::default(),
    };
    spec.parent = req.parent.map(|p| p.to_string());
    if mode == Mode::Txt2img && req.strength.is_some() {
        return Err(ApiError::invalid("strength", "txt2img has no strength"));
    }
    Ok(spec)
}

/// Fields a multipart form sends as text that are numbers, lists or booleans in JSON.
const STRING_FIELDS: &[&str] = &[
    "mode",
    "prompt",
    "negative_prompt",
    "model",
    "unet",
    "sampler",
    "priority",
    "client",
    "lane",
    "image",
    "mask",
];

/// A multipart job form as the JSON request plus its files.
pub async fn form_request(mp: Multipart) -> Result<(JobRequest, Files), ApiError> {
    let mut map = serde_json::Map::new();
    let mut files = Files::default();
    for (name, part) in read_multipart(mp).await? {
        match (name.as_str(), part) {
            ("image", Part::File(b)) => files.image = Some(b),
            ("mask", Part::File(b)) => files.mask = Some(b),
            (n, Part::File(_)) => {
                return Err(ApiError::invalid(n, "only `image` and `mask` may be files"))
            }
            (n, Part::Text(t)) => {
                let v = if STRING_FIELDS.contains(&n) {
                    serde_json::Value::String(t)
                } else {
                    serde_json::from_str(t.trim()).map_err(|_| {
                        ApiError::invalid(n, format!("`{t}` is not a number, list or true/false"))
                    })?
                };
                map.insert(n.to_string(), v);
            }
        }
    }
    Ok((from_value(serde_json::Value::Object(map))?, files))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Accepted {
    pub id: String,
    pub state: String,
    pub position: usize,
}

/// Queues a job (JSON, or multipart/form-data with the same field names and `image`/`mask` as files).
#[utoipa::path(post, path = "/api/v1/jobs", tag = "jobs", request_body = JobRequest,
    responses((status = 202, body = Accepted), (status = 400, body = ErrorResponse), (status = 422, body = ErrorResponse),
              (status = 429, body = ErrorResponse, description = "queue full; see Retry-After")))]
pub async fn create_job(
    State(st): State<AppState>,
    headers: HeaderMap,
    req: Request,
) -> Result<Response, ApiError> {
    let (job, files) = if is_multipart(&headers) {
        let mp = Multipart::from_request(req, &st)
            .await
            .map_err(|e| ApiError::bad_request(None, e.body_text()))?;
        form_request(mp).await?
    } else {
        let bytes = crate::extract::body_bytes(req, &st).await?;
        (parse_json::<JobRequest>(&bytes)?, Files::default())
    };
    let spec = build_spec(&st, job, files).await?;
    let (id, position) = submit(&st, spec)?;
    Ok((
        StatusCode::ACCEPTED,
        Json(Accepted {
            id: id.to_string(),
            state: "queued".into(),
            position,
        }),
    )
        .into_response())
}

fn submit(st: &AppState, spec: JobSpec) -> Result<(JobId, usize), ApiError> {
    let mode = spec.edit.mode();
    let id = st.runtime.submit(spec)?;
    tracing::info!(job = %id, ?mode, "job queued");
    let position = match st.runtime.status(id).map(|s| s.state) {
        Some(JobState::Queued { position }) => position,
        _ => 0,
    };
    Ok((id, position))
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResultImage {
    pub gallery_id: Option<i64>,
    pub url: Option<String>,
    pub thumb_url: Option<String>,
    pub width: u32,
    pub height: u32,
    pub seed: u64,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TimingsView {
    pub queued_ms: f64,
    pub text_encoder_ms: f64,
    /// The prompt's encoding came from the cache (the text encoder did not run).
    pub text_encoder_cached: bool,
    pub encode_ms: f64,
    pub denoise_ms: f64,
    pub decode_ms: f64,
    pub total_ms: f64,
    pub steps: usize,
    pub preemptions: u32,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct JobResult {
    pub images: Vec<ResultImage>,
    pub timings: TimingsView,
    pub model: String,
    pub unet: String,
    pub seed: u64,
    pub memory_plan: String,
    /// How the request was read, for the user (a prompt cut at the text encoder's length).
    pub notices: Vec<String>,
}

pub fn result_view(out: &JobOutput) -> JobResult {
    let t = &out.timings;
    JobResult {
        images: out
            .images
            .iter()
            .map(|img| {
                let gid = gallery_id(img);
                ResultImage {
                    gallery_id: gid,
                    url: gid.map(|g| format!("/api/v1/gallery/{g}/image")),
                    thumb_url: gid.map(|g| format!("/api/v1/gallery/{g}/thumb")),
                    width: img.width,
                    height: img.height,
                    seed: img.recipe.seed,
                }
            })
            .collect(),
        timings: TimingsView {
            queued_ms: t.queued_ms,
            text_encoder_ms: t.text_encoder_ms,
            text_encoder_cached: t.text_encoder_cached,
            encode_ms: t.encode_ms,
            denoise_ms: t.denoise_ms,
            decode_ms: t.decode_ms,
            total_ms: t.total_ms,
            steps: t.steps,
            preemptions: t.preemptions,
        },
        model: out.model.clone(),
        unet: out.unet.clone(),
        seed: out.seed,
        memory_plan: out.memory_plan.clone(),
        notices: out.notices.clone(),
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct JobView {
    pub id: String,
    /// queued, running, done, failed or cancelled.
    pub state: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub position: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eta_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
    /// Why it was cancelled: user, superseded, timeout or shutdown.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<JobResult>,
}

pub fn job_view(s: &JobStatus) -> JobView {
    let mut v = JobView {
        id: s.id.to_string(),
        state: s.state.name().to_string(),
        position: None,
        step: None,
        total: None,
        eta_ms: None,
        error: None,
        reason: None,
        result: None,
    };
    match &s.state {
        JobState::Queued { position } => v.position = Some(*position),
        JobState::Running {
            step,
            total,
            eta_ms,
        } => {
            v.step = Some(*step);
            v.total = Some(*total);
            v.eta_ms = *eta_ms;
        }
        JobState::Done => v.result = s.output.as_deref().map(result_view),
        JobState::Failed(e) => {
            v.error = Some(ErrorBody {
                field: e.field.map(str::to_string),
                message: e.message.clone(),
            })
        }
        JobState::Cancelled(r) => v.reason = Some(r.name().to_string()),
    }
    v
}

fn job_id(id: &str) -> Result<JobId, ApiError> {
    id.parse::<JobId>()
        .map_err(|_| ApiError::not_found(format!("no job `{}`", crate::respond::clip(id, 40))))
}

fn status_of(st: &AppState, id: &str) -> Result<JobStatus, ApiError> {
    let jid = job_id(id)?;
    st.runtime
        .status(jid)
        .ok_or_else(|| ApiError::not_found(format!("no job {jid} (unknown, or finished long ago)")))
}

#[utoipa::path(get, path = "/api/v1/jobs/{id}", tag = "jobs", params(("id" = String, Path)),
    responses((status = 200, body = JobView), (status = 404, body = ErrorResponse)))]
pub async fn get_job(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<JobView>, ApiError> {
    Ok(Json(job_view(&status_of(&st, &id)?)))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CancelResponse {
    pub id: String,
    pub state: String,
}

/// Cancels a job: a queued one at once, a running one at its next step.
#[utoipa::path(post, path = "/api/v1/jobs/{id}/cancel", tag = "jobs", params(("id" = String, Path)),
    responses((status = 200, body = CancelResponse), (status = 404, body = ErrorResponse)))]
pub async fn cancel_job(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<CancelResponse>, ApiError> {
    let s = status_of(&st, &id)?;
    st.runtime.cancel(s.id);
    let now = st
        .runtime
        .status(s.id)
        .map(|s| s.state.name())
        .unwrap_or("cancelled");
    Ok(Json(CancelResponse {
        id: s.id.to_string(),
        state: now.to_string(),
    }))
}

// ---------------------------------------------------------------- events

/// One event of a job, as SSE `data:` lines and WebSocket messages carry it.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EventView {
    Queued {
        id: String,
        position: usize,
    },
    Started {
        id: String,
    },
    Step {
        id: String,
        step: usize,
        total: usize,
        eta_ms: Option<u64>,
    },
    /// A step preview as a PNG data URL.
    Preview {
        id: String,
        step: usize,
        image: String,
    },
    /// `result` is left out for a job finished long ago (the runtime keeps the
    /// pictures of its last 64 jobs; the gallery has them all).
    Done {
        id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        result: Option<JobResult>,
    },
    /// How the request was read (a prompt cut at the text encoder's length); may quote the prompt.
    Notice {
        id: String,
        message: String,
    },
    Failed {
        id: String,
        error: ErrorBody,
    },
    Cancelled {
        id: String,
        reason: String,
    },
}

impl EventView {
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            EventView::Done { .. } | EventView::Failed { .. } | EventView::Cancelled { .. }
        )
    }
}

pub fn event_view(e: &JobEvent) -> Option<EventView> {
    let id = e.job.to_string();
    Some(match &e.kind {
        EventKind::Queued { position } => EventView::Queued {
            id,
            position: *position,
        },
        EventKind::Started => EventView::Started { id },
        EventKind::Step {
            step,
            total,
            eta_ms,
        } => EventView::Step {
            id,
            step: *step,
            total: *total,
            eta_ms: *eta_ms,
        },
        EventKind::Preview { step, png } => EventView::Preview {
            id,
            step: *step,
            image: format!(
                "data:image/png;base64,{}",
                crate::extract::encode_base64(png)
            ),
        },
        EventKind::Done { output } => EventView::Done {
            id,
            result: Some(result_view(output)),
        },
        EventKind::Notice { message } => EventView::Notice {
            id,
            message: message.clone(),
        },
        EventKind::Failed { error } => EventView::Failed {
            id,
            error: ErrorBody {
                field: error.field.map(str::to_string),
                message: error.message.clone(),
            },
        },
        EventKind::Cancelled { reason } => EventView::Cancelled {
            id,
            reason: reason.name().to_string(),
        },
        EventKind::Planned { .. } | EventKind::Loaded { .. } | EventKind::Preempted => return None,
        // Kinds added to the runtime later are not sent until this API names them.
        #[allow(unreachable_patterns)]
        _ => return None,
    })
}

/// Where a job stands, as the events that tell it (sent first on a stream).
pub fn snapshot(s: &JobStatus) -> Vec<EventView> {
    let id = s.id.to_string();
    match &s.state {
        JobState::Queued { position } => vec![EventView::Queued {
            id,
            position: *position,
        }],
        JobState::Running {
            step,
            total,
            eta_ms,
        } => {
            let mut v = vec![EventView::Started { id: id.clone() }];
            if *total > 0 {
                v.push(EventView::Step {
                    id,
                    step: *step,
                    total: *total,
                    eta_ms: *eta_ms,
                });
            }
            v
        }
        JobState::Done => vec![EventView::Done {
            id,
            result: s.output.as_deref().map(result_view),
        }],
        JobState::Failed(e) => {
            vec![EventView::Failed {
                id,
                error: ErrorBody {
                    field: e.field.map(str::to_string),
                    message: e.message.clone(),
                },
            }]
        }
        JobState::Cancelled(r) => vec![EventView::Cancelled {
            id,
            reason: r.name().to_string(),
        }],
    }
}

fn sse_event(ev: &EventView) -> Event {
    Event::default().data(serde_json::to_string(ev).unwrap_or_else(|_| "{}".into()))
}

/// The job's events as Server-Sent Events: where it stands now, then each
/// change, ending after done / failed / cancelled.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/events", tag = "jobs", params(("id" = String, Path)),
    responses((status = 200, content_type = "text/event-stream", body = EventView, description = "one JSON event per data: line"),
              (status = 404, body = ErrorResponse)))]
pub async fn job_events(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let jid = job_id(&id)?;
    // Subscribe before reading the state, so nothing falls between.
    let mut rx = st.runtime.subscribe();
    let first = st
        .runtime
        .status(jid)
        .ok_or_else(|| ApiError::not_found(format!("no job {jid}")))?;
    let (tx, out) = tokio::sync::mpsc::channel::<Event>(64);
    let runtime = st.runtime.clone();
    let mut shutdown = st.shutdown.clone();
    tokio::spawn(async move {
        for ev in snapshot(&first) {
            let end = ev.is_terminal();
            if tx.send(sse_event(&ev)).await.is_err() || end {
                return;
            }
        }
        loop {
            let ev = tokio::select! {
                r = rx.recv() => r,
                _ = shutdown.changed() => return,
                _ = tx.closed() => return,
            };
            let views = match ev {
                Ok(e) if e.job == jid => event_view(&e).into_iter().collect(),
                Ok(_) => continue,
                // Fell behind: the state itself is still right.
                Err(RecvError::Lagged(_)) => match runtime.status(jid) {
                    Some(s) => snapshot(&s),
                    None => return,
                },
                Err(RecvError::Closed) => return,
            };
            for ev in views {
                let end = ev.is_terminal();
                if tx.send(sse_event(&ev)).await.is_err() || end {
                    return;
                }
            }
        }
    });
    let stream = futures_util::stream::unfold(out, |mut out| async move {
        out.recv().await.map(|e| (Ok::<_, Infallible>(e), out))
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// What a WebSocket client may send.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum WsIn {
    Submit { job: serde_json::Value },
    Cancel { id: String },
    Watch { id: String },
}

/// What the server sends besides job events.
#[derive(Debug, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum WsReply {
    /// A submit was queued.
    Accepted { id: String, position: usize },
    /// A submit was refused (submits are answered in order: accepted or rejected).
    Rejected { error: ErrorBody },
    /// Any other message could not be read or done (an unknown job to cancel or watch).
    Error { error: ErrorBody },
}

/// A WebSocket per client: every event of the client's jobs and of the jobs it
/// watches; it may submit, cancel and watch jobs. `?token=` authenticates
/// browsers, which cannot set headers here.
#[utoipa::path(get, path = "/api/v1/ws", tag = "jobs", params(("client" = Option<String>, Query), ("token" = Option<String>, Query)),
    responses((status = 101, description = "WebSocket: EventView / WsReply messages out, WsIn messages in")))]
pub async fn ws(
    State(st): State<AppState>,
    Query(q): Query<HashMap<String, String>>,
    upgrade: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    let client = q.get("client").cloned().filter(|c| !c.is_empty());
    if let Some(c) = &client {
        if c.chars().count() > MAX_CLIENT_CHARS || c.chars().any(char::is_control) {
            return Err(ApiError::invalid(
                "client",
                format!("must be 1..={MAX_CLIENT_CHARS} printable characters"),
            ));
        }
    }
    let limit = st.settings.body_limit;
    Ok(upgrade
        .max_message_size(limit)
        .max_frame_size(limit)
        .on_upgrade(move |socket| ws_session(st, client, socket)))
}

async fn ws_session(st: AppState, client: Option<String>, mut socket: WebSocket) {
    let mut rx = st.runtime.subscribe();
    let mut shutdown = st.shutdown.clone();
    let mut watched: HashSet<JobId> = HashSet::new();
    loop {
        tokio::select! {
            msg = socket.recv() => {
                let text = match msg {
                    Some(Ok(Message::Text(t))) => t.to_string(),
                    Some(Ok(Message::Binary(_))) => {
                        if send_json(&mut socket, &ws_error(ApiError::bad_request(None, "send JSON text messages"))).await.is_err() { return; }
                        continue;
                    }
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                    Some(Ok(_)) => continue,
                };
                let replies = ws_message(&st, client.as_deref(), &mut watched, &text).await;
                for r in replies {
                    if send_text(&mut socket, r).await.is_err() { return; }
                }
            }
            ev = rx.recv() => {
                let views: Vec<EventView> = match ev {
                    Ok(e) => {
                        let mine = client.is_some() && e.client == client;
                        if !(mine || watched.contains(&e.job)) { continue; }
                        event_view(&e).into_iter().collect()
                    }
                    Err(RecvError::Lagged(_)) => watched.iter().filter_map(|id| st.runtime.status(*id)).flat_map(|s| snapshot(&s)).collect(),
                    Err(RecvError::Closed) => return,
                };
                for v in views {
                    if v.is_terminal() {
                        if let EventView::Done { id, .. } | EventView::Failed { id, .. } | EventView::Cancelled { id, .. } = &v {
                            if let Ok(j) = id.parse() { watched.remove(&j); }
                        }
                    }
                    if send_json(&mut socket, &v).await.is_err() { return; }
                }
            }
            _ = shutdown.changed() => {
                let _ = socket.send(Message::Close(None)).await;
                return;
            }
        }
    }
}

fn rejected(e: ApiError) -> WsReply {
    WsReply::Rejected {
        error: e.body().error,
    }
}

fn ws_error(e: ApiError) -> WsReply {
    WsReply::Error {
        error: e.body().error,
    }
}

async fn send_json<T: Serialize>(socket: &mut WebSocket, v: &T) -> Result<(), axum::Error> {
    let text = serde_json::to_string(v).unwrap_or_else(|_| "{}".into());
    socket.send(Message::Text(text.into())).await
}

async fn send_text(socket: &mut WebSocket, text: String) -> Result<(), axum::Error> {
    socket.send(Message::Text(text.into())).await
}

async fn ws_message(
    st: &AppState,
    client: Option<&str>,
    watched: &mut HashSet<JobId>,
    text: &str,
) -> Vec<String> {
    let msg: WsIn = match parse_json(text.as_bytes()) {
        Ok(m) => m,
        Err(e) => return vec![json(&ws_error(e))],
    };
    match msg {
        WsIn::Submit { job } => {
            let result = async {
                let mut req: JobRequest = from_value(job)?;
                if req.client.is_none() {
                    req.client = client.map(str::to_string);
                }
                let spec = build_spec(st, req, Files::default()).await?;
                submit(st, spec)
            }
            .await;
            match result {
                Ok((id, position)) => {
                    watched.insert(id);
                    vec![json(&WsReply::Accepted {
                        id: id.to_string(),
                        position,
                    })]
                }
                Err(e) => vec![json(&rejected(e))],
            }
        }
        WsIn::Cancel { id } => match status_of(st, &id) {
            Ok(s) => {
                watched.insert(s.id);
                st.runtime.cancel(s.id);
                if s.state.is_finished() {
                    snapshot(&s).iter().map(json).collect()
                } else {
                    Vec::new()
                }
            }
            Err(e) => vec![json(&ws_error(e))],
        },
        WsIn::Watch { id } => match status_of(st, &id) {
            Ok(s) => {
                if !s.state.is_finished() {
                    watched.insert(s.id);
                }
                snapshot(&s).iter().map(json).collect()
            }
            Err(e) => vec![json(&ws_error(e))],
        },
    }
}

fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "{}".into())
}
