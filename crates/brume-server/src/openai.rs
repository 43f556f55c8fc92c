//! OpenAI's images API, enough for the official SDKs pointed at brume through
//! `base_url`: POST /v1/images/generations, POST /v1/images/edits (multipart;
//! a mask's alpha 0 marks the area to repaint), GET /v1/models. Errors leave
//! in OpenAI's shape (`respond`'s middleware renders them).

use std::io::Cursor;
use std::sync::Arc;

use axum::extract::{Multipart, State};
use axum::http::HeaderMap;
use axum::Json;
use brume_runtime::{Edit, InputImage, JobSpec, JobState, JobStatus, PreviewPolicy};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::extract::{encode_base64, read_multipart, ApiJson, Part};
use crate::jobs::{decode_image, run_to_end};
use crate::state::{blocking, AppState};

fn rename(field: &str) -> Option<&'static str> {
    Some(match field {
        "batch" => "n",
        "width" | "height" => "size",
        "request" => "prompt",
        _ => return None,
    })
}

#[derive(Debug, Deserialize)]
struct Generation {
    prompt: String,
    #[serde(default)]
    n: Option<usize>,
    #[serde(default)]
    size: Option<String>,
    #[serde(default)]
    response_format: Option<String>,
    #[serde(default)]
    output_format: Option<String>,
    #[serde(default)]
    output_compression: Option<u8>,
    #[serde(default)]
    model: Option<String>,
    /// brume's extensions (not in OpenAI's API).
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    negative_prompt: Option<String>,
    #[serde(default)]
    steps: Option<usize>,
}

#[derive(Clone, Copy, PartialEq)]
enum Format {
    Png,
    Jpeg,
    Webp,
}

struct Output {
    format: Format,
    url: bool,
    compression: u8,
}

fn output(
    response_format: Option<&str>,
    output_format: Option<&str>,
    compression: Option<u8>,
) -> Result<Output, ApiError> {
    let url = match response_format {
        None | Some("b64_json") => false,
        // A gallery URL on this server (it needs the token, when there is one).
        Some("url") => true,
        Some(o) => {
            return Err(ApiError::bad_request(
                Some("response_format"),
                format!(
                    "`{}`: expected b64_json or url",
                    crate::respond::clip(o, 40)
                ),
            ))
        }
    };
    let format = match output_format {
        None | Some("png") => Format::Png,
        Some("jpeg" | "jpg") => Format::Jpeg,
        Some("webp") => Format::Webp,
        Some(o) => {
            return Err(ApiError::bad_request(
                Some("output_format"),
                format!(
                    "`{}`: expected png, jpeg or webp",
                    crate::respond::clip(o, 40)
                ),
            ))
        }
    };
    if compression.is_some_and(|c| c > 100) {
        return Err(ApiError::bad_request(
            Some("output_compression"),
            "must be 0..=100",
        ));
    }
    Ok(Output {
        format,
        url,
        compression: compression.unwrap_or(100),
    })
}

/// A served model, or the default for OpenAI's own names (and none).
fn model(st: &AppState, name: Option<&str>) -> Result<Option<String>, ApiError> {
    match name.map(str::trim).filter(|n| !n.is_empty()) {
        None => Ok(None),
        Some(n) if st.runtime.models().iter().any(|m| m.name == n) => Ok(Some(n.to_string())),
        Some(n) if n.starts_with("dall-e") || n.starts_with("gpt-image") => Ok(None),
        Some(n) => {
            let known: Vec<&str> = st
                .runtime
                .models()
                .iter()
                .map(|m| m.name.as_str())
                .collect();
            Err(ApiError::bad_request(
                Some("model"),
                format!(
                    "no model `{}` (serving: {})",
                    crate::respond::clip(n, 80),
                    known.join(", ")
                ),
            ))
        }
    }
}

/// "WxH", or "auto" / absent (the model's own size).
fn size(s: Option<&str>) -> Result<Option<(usize, usize)>, ApiError> {
    match s.map(str::trim) {
        None | Some("auto") | Some("") => Ok(None),
        Some(s) => {
            let parsed = s
                .split_once(['x', 'X'])
                .and_then(|(w, h)| Some((w.trim().parse().ok()?, h.trim().parse().ok()?)));
            parsed.map(Some).ok_or_else(|| {
                ApiError::bad_request(
                    Some("size"),
                    format!(
                        "`{}`: expected WIDTHxHEIGHT, like 512x512, or auto",
                        crate::respond::clip(s, 40)
                    ),
                )
            })
        }
    }
}

fn n(v: Option<usize>) -> Result<usize, ApiError> {
    match v.unwrap_or(1) {
        0 => Err(ApiError::bad_request(Some("n"), "must be at least 1")),
        n => Ok(n),
    }
}

fn host_url(headers: &HeaderMap) -> String {
    let host = headers
        .get(axum::http::header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("127.0.0.1");
    format!("http://{host}")
}

async fn answer(
    st: &AppState,
    status: JobStatus,
    out: Output,
    headers: &HeaderMap,
) -> Result<Json<Value>, ApiError> {
    let result = match (&status.state, &status.output) {
        (JobState::Done, Some(o)) => o.clone(),
        (JobState::Cancelled(r), _) => {
            return Err(ApiError::new(
                axum::http::StatusCode::CONFLICT,
                None,
                format!("the job was cancelled ({})", r.name()),
            ));
        }
        _ => return Err(ApiError::internal("job", "finished without a result")),
    };
    let base = host_url(headers);
    let mut data = Vec::new();
    let (mut w, mut h) = (0, 0);
    for img in &result.images {
        (w, h) = (img.width, img.height);
        if out.url {
            let id = crate::jobs::gallery_id(img)
                .ok_or_else(|| ApiError::internal("job", "the picture has no gallery id"))?;
            data.push(json!({ "url": format!("{base}/api/v1/gallery/{id}/image"), "revised_prompt": null }));
            continue;
        }
        let png = img.png.clone();
        let (format, q) = (out.format, out.compression);
        let bytes = blocking(move || convert(&png, format, q)).await??;
        data.push(json!({ "b64_json": encode_base64(&bytes), "revised_prompt": null }));
    }
    let fmt = match out.format {
        Format::Png => "png",
        Format::Jpeg => "jpeg",
        Format::Webp => "webp",
    };
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let _ = st;
    Ok(Json(
        json!({ "created": created, "data": data, "output_format": fmt, "size": format!("{w}x{h}") }),
    ))
}

/// PNG (as made: it carries the recipe) or a JPEG / lossless WebP copy (no recipe).
fn convert(png: &Arc<Vec<u8>>, format: Format, quality: u8) -> Result<Vec<u8>, ApiError> {
    if format == Format::Png {
        return Ok(png.to_vec());
    }
    let img = image::load_from_memory_with_format(png, image::ImageFormat::Png)
        .map_err(|e| ApiError::internal("encoding", e))?;
    let rgb = img.to_rgb8();
    let mut out = Cursor::new(Vec::new());
    match format {
        Format::Jpeg => {
            image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, quality.clamp(1, 100))
                .encode_image(&rgb)
        }
        _ => image::codecs::webp::WebPEncoder::new_lossless(&mut out).encode(
            rgb.as_raw(),
            rgb.width(),
            rgb.height(),
            image::ExtendedColorType::Rgb8,
        ),
    }
    .map_err(|e| ApiError::internal("encoding", e))?;
    Ok(out.into_inner())
}

pub async fn generations(
    State(st): State<AppState>,
    headers: HeaderMap,
    ApiJson(raw): ApiJson<Value>,
) -> Result<Json<Value>, ApiError> {
    if !raw.is_object() {
        return Err(ApiError::bad_request(None, "send a JSON object"));
    }
    let g: Generation = crate::extract::from_value(raw).map_err(|e| e.rename_field(|_| None))?;
    let out = output(
        g.response_format.as_deref(),
        g.output_format.as_deref(),
        g.output_compression,
    )?;
    let mut spec = JobSpec::txt2img(g.prompt);
    spec.model = model(&st, g.model.as_deref())?;
    spec.batch = n(g.n)?;
    if let Some((w, h)) = size(g.size.as_deref())? {
        spec.width = Some(w);
        spec.height = Some(h);
    }
    spec.seed = g.seed;
    spec.negative_prompt = g.negative_prompt;
    spec.steps = g.steps;
    spec.previews = PreviewPolicy::OFF;
    let status = run_to_end(&st, spec, rename).await?;
    answer(&st, status, out, &headers).await
}

/// The picture's alpha as brume's mask: alpha 0 (transparent) = white = repaint.
fn alpha_mask(img: &image::DynamicImage) -> image::GrayImage {
    let rgba = img.to_rgba8();
    image::GrayImage::from_fn(rgba.width(), rgba.height(), |x, y| {
        image::Luma([if rgba.get_pixel(x, y)[3] == 0 { 255 } else { 0 }])
    })
}

pub async fn edits(
    State(st): State<AppState>,
    headers: HeaderMap,
    mp: Multipart,
) -> Result<Json<Value>, ApiError> {
    let mut text = std::collections::HashMap::new();
    let (mut image, mut mask) = (None, None);
    let mut images = 0;
    for (name, part) in read_multipart(mp).await? {
        match (name.as_str(), part) {
            ("image" | "image[]", p) => {
                images += 1;
                if images > 1 {
                    return Err(ApiError::bad_request(
                        Some("image"),
                        "brume edits one picture at a time",
                    ));
                }
                image = Some(match p {
                    Part::File(b) => b,
                    Part::Text(t) => crate::extract::decode_base64("image", &t)?,
                });
            }
            ("mask", p) => {
                mask = Some(match p {
                    Part::File(b) => b,
                    Part::Text(t) => crate::extract::decode_base64("mask", &t)?,
                })
            }
            (n, Part::Text(t)) => {
                text.insert(n.to_string(), t);
            }
            (n, Part::File(_)) => {
                return Err(ApiError::bad_request(
                    Some(n),
                    "only image and mask may be files",
                ))
            }
        }
    }
    let prompt = text
        .get("prompt")
        .cloned()
        .ok_or_else(|| ApiError::bad_request(Some("prompt"), "is required"))?;
    let image =
        image.ok_or_else(|| ApiError::bad_request(Some("image"), "is required (a PNG file)"))?;
    let number = |k: &'static str| -> Result<Option<usize>, ApiError> {
        text.get(k)
            .map(|v| {
                v.trim()
                    .parse()
                    .map_err(|_| ApiError::bad_request(Some(k), "must be a whole number"))
            })
            .transpose()
    };
    let compression = number("output_compression")?.map(|c| c.min(255) as u8);
    let out = output(
        text.get("response_format").map(String::as_str),
        text.get("output_format").map(String::as_str),
        compression,
    )?;
    let mut spec = JobSpec::txt2img(prompt);
    spec.model = model(&st, text.get("model").map(String::as_str))?;
    spec.batch = n(number("n")?)?;
    spec.seed = number("seed")?.map(|s| s as u64);
    spec.previews = PreviewPolicy::OFF;
    let mut picture = decode_image(image, "image").await?;
    let mut mask_img = match mask {
        Some(m) => {
            let m = decode_image(m, "mask").await?;
            if !m.image.color().has_alpha() {
                return Err(ApiError::bad_request(Some("mask"), "has no alpha channel: its transparent (alpha 0) pixels mark the area to repaint"));
            }
            if m.size() != picture.size() {
                let ((mw, mh), (iw, ih)) = (m.size(), picture.size());
                return Err(ApiError::bad_request(
                    Some("mask"),
                    format!("is {mw}x{mh} but the image is {iw}x{ih}; they must be the same size"),
                ));
            }
            Some(InputImage {
                image: Arc::new(image::DynamicImage::ImageLuma8(alpha_mask(&m.image))),
                source: m.source,
            })
        }
        // Without a mask, the image's own transparent pixels are the area to repaint.
        None if picture.image.color().has_alpha()
            && picture.image.to_rgba8().pixels().any(|p| p[3] == 0) =>
        {
            Some(InputImage {
                image: Arc::new(image::DynamicImage::ImageLuma8(alpha_mask(&picture.image))),
                source: picture.source.clone(),
            })
        }
        None => None,
    };
    if let Some((w, h)) = size(text.get("size").map(String::as_str))? {
        let l = st.runtime.limits();
        if w < l.min_side || h < l.min_side || w > l.max_side || h > l.max_side {
            return Err(ApiError::bad_request(
                Some("size"),
                format!("each side must be in {}..={}", l.min_side, l.max_side),
            ));
        }
        if (w as u32, h as u32) != picture.size() {
            picture = InputImage {
                image: Arc::new(picture.image.resize_exact(
                    w as u32,
                    h as u32,
                    image::imageops::FilterType::Lanczos3,
                )),
                source: picture.source,
            };
            mask_img = mask_img.map(|m| InputImage {
                image: Arc::new(m.image.resize_exact(
                    w as u32,
                    h as u32,
                    image::imageops::FilterType::Nearest,
                )),
                source: m.source,
            });
        }
    }
    // The pipelines read RGB: transparent pixels are repainted anyway.
    let picture = InputImage {
        image: Arc::new(image::DynamicImage::ImageRgb8(picture.image.to_rgb8())),
        source: picture.source,
    };
    spec.edit = match mask_img {
        Some(mask) => Edit::Inpaint {
            image: picture,
            mask,
            strength: None,
            feather: 4,
        },
        None => Edit::Img2img {
            image: picture,
            strength: None,
        },
    };
    let status = run_to_end(&st, spec, rename).await?;
    answer(&st, status, out, &headers).await
}

pub async fn models(State(st): State<AppState>) -> Json<Value> {
    let data: Vec<Value> = st
        .runtime
        .models()
        .iter()
        .map(|m| json!({ "id": m.name, "object": "model", "created": 0, "owned_by": "brume" }))
        .collect();
    Json(json!({ "object": "list", "data": data }))
}

pub async fn model_by_id(
    State(st): State<AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<Value>, ApiError> {
    st.runtime
        .models()
        .iter()
        .find(|m| m.name == id)
        .map(|m| {
            Json(json!({ "id": m.name, "object": "model", "created": 0, "owned_by": "brume" }))
        })
        .ok_or_else(|| {
            ApiError::not_found(format!("no model `{}`", crate::respond::clip(&id, 80)))
                .rename_field(|_| None)
        })
}
