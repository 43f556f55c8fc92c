//! The AUTOMATIC1111-compatible subset under `/sdapi/v1`, as Open WebUI and
//! SillyTavern call it. Requests carry many fields brume does not use; they
//! are accepted and ignored, and the ones used are checked and named with
//! A1111's field names. Responses carry `images` (base64 PNGs with the
//! recipe), `parameters` (the request echoed) and `info` (a JSON string).

use std::sync::atomic::Ordering;

use axum::extract::{Query, State};
use axum::Json;
use brume::samplers::SamplerKind;
use brume_runtime::{Edit, InputImage, JobSpec, JobState, ModelSource, PreviewPolicy};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::extract::{decode_base64, encode_base64, from_value, ApiJson};
use crate::jobs::{decode_image, label, parse_sampler, run_to_end, sampler_error, A1111_SAMPLERS};
use crate::state::AppState;

/// The runtime's field names as A1111 names them.
fn rename(field: &str) -> Option<&'static str> {
    Some(match field {
        "guidance" => "cfg_scale",
        "batch" => "batch_size",
        "strength" => "denoising_strength",
        "image" => "init_images",
        "feather" => "mask_blur",
        "sampler" => "sampler_name",
        "model" => "override_settings.sd_model_checkpoint",
        "request" => "init_images",
        _ => return None,
    })
}

/// The fields brume reads; everything else is ignored.
#[derive(Debug, Default, Deserialize)]
struct Request {
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    negative_prompt: Option<String>,
    /// -1 (or any negative): random.
    #[serde(default)]
    seed: Option<serde_json::Number>,
    #[serde(default)]
    steps: Option<usize>,
    #[serde(default)]
    cfg_scale: Option<f64>,
    #[serde(default)]
    width: Option<usize>,
    #[serde(default)]
    height: Option<usize>,
    #[serde(default)]
    sampler_name: Option<String>,
    /// Older clients' name for the sampler.
    #[serde(default)]
    sampler_index: Option<String>,
    #[serde(default)]
    scheduler: Option<String>,
    #[serde(default)]
    batch_size: Option<usize>,
    #[serde(default)]
    n_iter: Option<usize>,
    #[serde(default)]
    eta: Option<f64>,
    /// A1111 counts from 1 (1 = the last layer).
    #[serde(default)]
    clip_skip: Option<usize>,
    #[serde(default)]
    override_settings: Option<Map<String, Value>>,
    // img2img
    #[serde(default)]
    init_images: Option<Vec<String>>,
    #[serde(default)]
    mask: Option<String>,
    #[serde(default)]
    denoising_strength: Option<f64>,
    #[serde(default)]
    inpainting_mask_invert: Option<Value>,
    #[serde(default)]
    mask_blur: Option<f64>,
}

fn model_title(name: &str, hash: &str) -> String {
    format!("{name} [{hash}]")
}

/// A served model by A1111 title (`name [hash]`), name, or hash.
fn resolve_model(st: &AppState, wanted: &str) -> Option<String> {
    let w = wanted.trim();
    st.runtime
        .models()
        .iter()
        .find(|m| {
            m.name == w
                || model_title(&m.name, &m.hash) == w
                || m.hash == w
                || w.strip_suffix(&format!(" [{}]", m.hash)) == Some(m.name.as_str())
        })
        .map(|m| m.name.clone())
}

/// The sampler from `sampler_name` (or `sampler_index`) and A1111 1.9+'s `scheduler`.
fn sampler(req: &Request) -> Result<Option<SamplerKind>, ApiError> {
    let (field, name) = match (&req.sampler_name, &req.sampler_index) {
        (Some(s), _) if !s.trim().is_empty() => ("sampler_name", s),
        (_, Some(s)) if !s.trim().is_empty() => ("sampler_index", s),
        _ => return Ok(None),
    };
    let kind = parse_sampler(name).ok_or_else(|| sampler_error(field, name))?;
    match req
        .scheduler
        .as_deref()
        .map(str::trim)
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        None | Some("") | Some("automatic") => Ok(Some(kind)),
        Some("karras") => match kind {
            SamplerKind::DpmPP2M | SamplerKind::DpmPP2MKarras => {
                Ok(Some(SamplerKind::DpmPP2MKarras))
            }
            other => Err(ApiError::invalid(
                "scheduler",
                format!(
                    "brume offers Karras sigmas only with DPM++ 2M, not {}",
                    label(other)
                ),
            )),
        },
        Some(other) => Err(ApiError::invalid(
            "scheduler",
            format!("`{other}` is not offered (brume has: Automatic, Karras)"),
        )),
    }
}

async fn build(st: &AppState, raw: &Value, img2img: bool) -> Result<JobSpec, ApiError> {
    if !raw.is_object() {
        return Err(ApiError::bad_request(None, "send a JSON object"));
    }
    let req: Request = from_value(raw.clone())?;
    let mut spec = JobSpec::txt2img(req.prompt.clone().unwrap_or_default());
    spec.negative_prompt = req.negative_prompt.clone().filter(|n| !n.is_empty());
    spec.seed = match &req.seed {
        None => None,
        Some(n) if n.as_i64().is_some_and(|v| v < 0) => None,
        Some(n) => Some(
            n.as_u64()
                .ok_or_else(|| ApiError::invalid("seed", "must be a whole number (-1: random)"))?,
        ),
    };
    spec.steps = req.steps;
    spec.guidance = req.cfg_scale;
    spec.sampler = sampler(&req)?;
    spec.eta = req.eta.unwrap_or(0.0);
    let overrides = req.override_settings.clone().unwrap_or_default();
    let clip = match overrides.get("CLIP_stop_at_last_layers") {
        Some(v) if !v.is_null() => Some(v.as_u64().ok_or_else(|| {
            ApiError::invalid(
                "override_settings.CLIP_stop_at_last_layers",
                "must be a whole number",
            )
        })? as usize),
        _ => req.clip_skip,
    };
    spec.clip_skip = clip.unwrap_or(1).saturating_sub(1);
    let batch = req.batch_size.unwrap_or(1);
    let iters = req.n_iter.unwrap_or(1);
    if batch == 0 || iters == 0 {
        return Err(ApiError::invalid(
            if batch == 0 { "batch_size" } else { "n_iter" },
            "must be at least 1",
        ));
    }
    // One runtime job: n_iter batches of batch_size are one batch of the product.
    spec.batch = batch.saturating_mul(iters);
    spec.model = Some(
        match overrides.get("sd_model_checkpoint").and_then(Value::as_str) {
            Some(m) => resolve_model(st, m).ok_or_else(|| {
                ApiError::invalid(
                    "override_settings.sd_model_checkpoint",
                    format!("no model `{}`", crate::respond::clip(m, 80)),
                )
            })?,
            None => st.a1111.current_model(),
        },
    );
    spec.previews = PreviewPolicy::default();
    if img2img {
        let images = req.init_images.as_deref().unwrap_or_default();
        let first = images.first().ok_or_else(|| {
            ApiError::invalid("init_images", "img2img needs one picture in init_images")
        })?;
        let mut image =
            decode_image(decode_base64("init_images[0]", first)?, "init_images[0]").await?;
        let size = match (req.width, req.height) {
            (Some(w), Some(h)) if (w as u32, h as u32) != image.size() => Some((w, h)),
            _ => None,
        };
        if let Some((w, h)) = size {
            check_side(st, "width", w)?;
            check_side(st, "height", h)?;
            image = resized(
                &image,
                w as u32,
                h as u32,
                image::imageops::FilterType::Lanczos3,
            );
        }
        let strength = req.denoising_strength;
        spec.edit = match req.mask.as_deref().filter(|m| !m.is_empty()) {
            None => Edit::Img2img { image, strength },
            Some(m) => {
                let mut mask = decode_image(decode_base64("mask", m)?, "mask").await?;
                if let Some((w, h)) = size {
                    mask = resized(
                        &mask,
                        w as u32,
                        h as u32,
                        image::imageops::FilterType::Nearest,
                    );
                }
                let invert = match &req.inpainting_mask_invert {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(Value::Number(n)) if n.as_u64() == Some(0) => false,
                    Some(Value::Number(n)) if n.as_u64() == Some(1) => true,
                    Some(_) => {
                        return Err(ApiError::invalid(
                            "inpainting_mask_invert",
                            "must be 0 or 1",
                        ))
                    }
                };
                if invert {
                    let mut luma = mask.image.to_luma8();
                    image::imageops::invert(&mut luma);
                    mask = InputImage {
                        image: std::sync::Arc::new(image::DynamicImage::ImageLuma8(luma)),
                        source: mask.source.clone(),
                    };
                }
                let feather = match req.mask_blur {
                    None => 4,
                    Some(b) if b.is_finite() && b >= 0.0 => b.round() as usize,
                    Some(_) => {
                        return Err(ApiError::invalid(
                            "mask_blur",
                            "must be a number of pixels ≥ 0",
                        ))
                    }
                };
                // inpainting_fill (what fills the masked area before denoising) is ignored:
                // brume's inpainting starts from the picture's own latents with fresh noise.
                Edit::Inpaint {
                    image,
                    mask,
                    strength,
                    feather,
                }
            }
        };
    } else {
        spec.width = req.width;
        spec.height = req.height;
    }
    Ok(spec)
}

fn check_side(st: &AppState, field: &str, v: usize) -> Result<(), ApiError> {
    let l = st.runtime.limits();
    if v < l.min_side || v > l.max_side {
        return Err(ApiError::invalid(
            field,
            format!("must be in {}..={}, got {v}", l.min_side, l.max_side),
        ));
    }
    Ok(())
}

fn resized(img: &InputImage, w: u32, h: u32, filter: image::imageops::FilterType) -> InputImage {
    InputImage {
        image: std::sync::Arc::new(img.image.resize_exact(w, h, filter)),
        source: img.source.clone(),
    }
}

/// Runs a request and answers like A1111.
async fn generate(st: AppState, raw: Value, img2img: bool) -> Result<Json<Value>, ApiError> {
    let spec = build(&st, &raw, img2img).await?;
    st.a1111.interrupted.store(false, Ordering::SeqCst);
    st.a1111.skipped.store(false, Ordering::SeqCst);
    let status = run_to_end(&st, spec, rename).await?;
    let served = status
        .output
        .as_ref()
        .map(|o| o.model.clone())
        .unwrap_or_default();
    let info_of = |images: &[brume_runtime::GeneratedImage]| -> Value {
        let Some(first) = images.first() else {
            return json!({ "interrupted": true, "all_prompts": [], "all_seeds": [], "infotexts": [] });
        };
        let r = &first.recipe;
        let n = images.len();
        let infotexts: Vec<String> = images.iter().map(|i| i.recipe.parameters_text()).collect();
        json!({
            "prompt": r.prompt,
            "all_prompts": vec![r.prompt.clone(); n],
            "negative_prompt": r.negative_prompt.clone().unwrap_or_default(),
            "all_negative_prompts": vec![r.negative_prompt.clone().unwrap_or_default(); n],
            "seed": r.seed,
            "all_seeds": vec![r.seed; n],
            "subseed": r.seed,
            "all_subseeds": vec![r.seed; n],
            "subseed_strength": 0,
            "width": r.width,
            "height": r.height,
            "sampler_name": brume::samplers::SamplerKind::parse(&r.sampler).map(label).unwrap_or(r.sampler.as_str()),
            "cfg_scale": r.guidance_scale,
            "steps": r.steps,
            "batch_size": n,
            "restore_faces": false,
            "sd_model_name": served,
            "sd_model_hash": r.model_hash,
            "seed_resize_from_w": -1,
            "seed_resize_from_h": -1,
            "denoising_strength": r.strength,
            "clip_skip": r.clip_skip + 1,
            "extra_generation_params": {},
            "index_of_first_image": 0,
            "infotexts": infotexts,
            "styles": [],
            "job_timestamp": "",
            "is_using_inpainting_conditioning": false,
            "version": format!("brume {}", env!("CARGO_PKG_VERSION")),
        })
    };
    let (images, info) = match (&status.state, &status.output) {
        (JobState::Done, Some(out)) => (
            out.images
                .iter()
                .map(|i| encode_base64(&i.png))
                .collect::<Vec<_>>(),
            info_of(&out.images),
        ),
        // Interrupted or skipped: A1111 answers with what it has; brume has no picture yet.
        _ => (Vec::new(), info_of(&[])),
    };
    Ok(Json(
        json!({ "images": images, "parameters": raw, "info": info.to_string() }),
    ))
}

pub async fn txt2img(
    State(st): State<AppState>,
    ApiJson(raw): ApiJson<Value>,
) -> Result<Json<Value>, ApiError> {
    generate(st, raw, false).await
}

pub async fn img2img(
    State(st): State<AppState>,
    ApiJson(raw): ApiJson<Value>,
) -> Result<Json<Value>, ApiError> {
    generate(st, raw, true).await
}

pub async fn progress(
    State(st): State<AppState>,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> Json<Value> {
    let skip_image = matches!(
        q.get("skip_current_image")
            .map(|s| s.to_ascii_lowercase())
            .as_deref(),
        Some("true" | "1")
    );
    let queue = st.runtime.queue();
    let running = st.runtime.running();
    let job_count = queue.queued + usize::from(queue.running.is_some());
    let (progress, eta, step, steps, textinfo, image) = match &running {
        Some(s) => match s.state {
            JobState::Running {
                step,
                total,
                eta_ms,
            } => {
                let p = if total > 0 {
                    step as f64 / total as f64
                } else {
                    0.0
                };
                let img = if skip_image {
                    None
                } else {
                    s.preview.as_ref().map(|png| encode_base64(png))
                };
                let text = if total > 0 {
                    format!("Sampling step {step}/{total}")
                } else {
                    "Loading".to_string()
                };
                (
                    p,
                    eta_ms.map(|e| e as f64 / 1000.0).unwrap_or(0.0),
                    step,
                    total,
                    Some(text),
                    img,
                )
            }
            _ => (0.0, 0.0, 0, 0, None, None),
        },
        None if job_count > 0 => (0.0, 0.0, 0, 0, Some("Waiting...".to_string()), None),
        None => (0.0, 0.0, 0, 0, None, None),
    };
    Json(json!({
        "progress": progress,
        "eta_relative": eta,
        "state": {
            "skipped": st.a1111.skipped.load(Ordering::SeqCst),
            "interrupted": st.a1111.interrupted.load(Ordering::SeqCst),
            "stopping_generation": false,
            "job": running.as_ref().map(|s| format!("job {}", s.id)).unwrap_or_default(),
            "job_count": job_count,
            "job_timestamp": "0",
            "job_no": 0,
            "sampling_step": step,
            "sampling_steps": steps,
        },
        "current_image": image,
        "textinfo": textinfo,
        "current_task": running.as_ref().map(|s| s.id.to_string()),
    }))
}

pub async fn interrupt(State(st): State<AppState>) -> Json<Value> {
    st.a1111.interrupted.store(true, Ordering::SeqCst);
    st.runtime.interrupt();
    Json(Value::Null)
}

/// A1111 skips to the next picture of a batch; brume's batch is one job, so skip stops it too.
pub async fn skip(State(st): State<AppState>) -> Json<Value> {
    st.a1111.skipped.store(true, Ordering::SeqCst);
    st.runtime.interrupt();
    Json(Value::Null)
}

pub async fn get_options(State(st): State<AppState>) -> Json<Value> {
    let mut map = st
        .a1111
        .options
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let current = st.a1111.current_model();
    let info = st.runtime.models().iter().find(|m| m.name == current);
    for (k, v) in [
        ("samples_format", json!("png")),
        ("sd_vae", json!("Automatic")),
        ("CLIP_stop_at_last_layers", json!(1)),
        ("eta_ddim", json!(0.0)),
    ] {
        map.entry(k.to_string()).or_insert(v);
    }
    map.insert(
        "sd_model_checkpoint".into(),
        json!(info
            .map(|m| model_title(&m.name, &m.hash))
            .unwrap_or(current.clone())),
    );
    map.insert(
        "sd_checkpoint_hash".into(),
        json!(info.map(|m| m.hash.clone())),
    );
    Json(Value::Object(map))
}

const MAX_OPTIONS: usize = 256;

pub async fn set_options(
    State(st): State<AppState>,
    ApiJson(raw): ApiJson<Value>,
) -> Result<Json<Value>, ApiError> {
    let Value::Object(map) = raw else {
        return Err(ApiError::bad_request(None, "send a JSON object of options"));
    };
    let mut model = None;
    if let Some(v) = map.get("sd_model_checkpoint") {
        let name = v.as_str().ok_or_else(|| {
            ApiError::invalid("sd_model_checkpoint", "must be a model title or name")
        })?;
        model = Some(resolve_model(&st, name).ok_or_else(|| {
            let known: Vec<String> = st
                .runtime
                .models()
                .iter()
                .map(|m| model_title(&m.name, &m.hash))
                .collect();
            ApiError::invalid(
                "sd_model_checkpoint",
                format!(
                    "no model `{}` (serving: {})",
                    crate::respond::clip(name, 80),
                    known.join(", ")
                ),
            )
        })?);
    }
    {
        let mut opts = st.a1111.options.lock().unwrap_or_else(|p| p.into_inner());
        for (k, v) in map {
            if k == "sd_model_checkpoint" || k == "sd_checkpoint_hash" {
                continue;
            }
            if opts.len() >= MAX_OPTIONS && !opts.contains_key(&k) {
                return Err(ApiError::invalid(
                    "options",
                    format!("at most {MAX_OPTIONS} options are kept"),
                ));
            }
            // Kept only to be read back: brume uses none of them.
            opts.insert(k, v);
        }
    }
    if let Some(m) = model {
        tracing::info!(model = %m, "A1111 clients' model switched");
        *st.a1111.model.write().unwrap_or_else(|p| p.into_inner()) = m;
    }
    Ok(Json(Value::Null))
}

pub async fn sd_models(State(st): State<AppState>) -> Json<Value> {
    let list: Vec<Value> = st
        .runtime
        .models()
        .iter()
        .map(|m| {
            let filename = st
                .settings
                .models
                .iter()
                .find(|e| e.name == m.name)
                .map(|e| match &e.source {
                    ModelSource::Path { path, .. } => path.display().to_string(),
                    ModelSource::Embedded { .. } => m.name.clone(),
                })
                .unwrap_or_else(|| m.name.clone());
            json!({ "title": model_title(&m.name, &m.hash), "model_name": m.name, "hash": m.hash, "sha256": null, "filename": filename, "config": null })
        })
        .collect();
    Json(Value::Array(list))
}

pub async fn samplers() -> Json<Value> {
    let list: Vec<Value> = A1111_SAMPLERS
        .iter()
        .map(|(l, k, aliases)| {
            let mut a: Vec<&str> = vec![k.cli_name()];
            a.extend(aliases.iter());
            json!({ "name": l, "aliases": a, "options": {} })
        })
        .collect();
    Json(Value::Array(list))
}

pub async fn schedulers() -> Json<Value> {
    Json(json!([
        { "name": "automatic", "label": "Automatic", "aliases": null, "default_rho": -1, "need_inner_model": false },
        { "name": "karras", "label": "Karras", "aliases": null, "default_rho": 7.0, "need_inner_model": false },
    ]))
}

/// Upscalers, VAEs, LoRAs...: brume has none to offer through A1111's API.
pub async fn empty_list() -> Json<Value> {
    Json(json!([]))
}

#[derive(Deserialize)]
struct PngInfoRequest {
    image: String,
}

/// The text chunks of a PNG, and its A1111 `parameters` parsed.
pub async fn png_info(ApiJson(raw): ApiJson<Value>) -> Result<Json<Value>, ApiError> {
    let req: PngInfoRequest = from_value(raw)?;
    let bytes = decode_base64("image", &req.image)?;
    let result = crate::state::blocking(move || -> Result<Value, ApiError> {
        const SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";
        if !bytes.starts_with(SIGNATURE) {
            if image::guess_format(&bytes).is_ok() {
                // JPEG/WebP: A1111 reads EXIF; brume writes its recipe only into PNGs.
                return Ok(json!({ "info": "", "items": {}, "parameters": {} }));
            }
            return Err(ApiError::invalid(
                "image",
                "is not a picture (PNG, JPEG or WebP)",
            ));
        }
        let chunks = brume_gallery::pngmeta::chunks(&bytes, "image")
            .map_err(|e| ApiError::invalid("image", e.to_string()))?;
        let texts = brume_gallery::pngmeta::text_chunks(&chunks, "image")
            .map_err(|e| ApiError::invalid("image", e.to_string()))?;
        let mut items = Map::new();
        for (k, v) in &texts {
            items.insert(k.clone(), json!(v));
        }
        let info = texts
            .iter()
            .find(|(k, _)| k == brume::pipelines::recipe::PARAMETERS_KEY)
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        let parsed = brume_gallery::a1111::parse(&info);
        let mut params = Map::new();
        if !info.is_empty() {
            params.insert("Prompt".into(), json!(parsed.prompt));
            params.insert(
                "Negative prompt".into(),
                json!(parsed.negative_prompt.clone().unwrap_or_default()),
            );
            for (k, v) in &parsed.settings {
                params.insert(k.clone(), json!(v));
            }
        }
        Ok(json!({ "info": info, "items": items, "parameters": params }))
    })
    .await??;
    Ok(Json(result))
}
