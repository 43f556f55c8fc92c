//! The gallery under `/api/v1/gallery`: list and search with filters, one
//! image with its recipe and lineage, the PNG (with or without its recipe),
//! the thumbnail, favourites and tags, soft delete, purge, import.

use std::collections::HashMap;

use axum::body::Body;
use axum::extract::{Multipart, Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use brume_gallery::{ImageDetail, ImageId, ImageInfo, Query as GalleryQuery};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::{ApiError, ErrorResponse};
use crate::extract::{read_multipart, ApiJson, Part};
use crate::state::{blocking, AppState};

#[derive(Debug, Serialize, ToSchema)]
pub struct GalleryItem {
    pub id: i64,
    pub prompt: String,
    pub negative_prompt: Option<String>,
    pub model: Option<String>,
    pub model_hash: Option<String>,
    pub sampler: Option<String>,
    pub steps: Option<u32>,
    pub guidance: Option<f64>,
    pub seed: Option<u64>,
    pub width: u32,
    pub height: u32,
    pub mode: Option<String>,
    /// RFC 3339, UTC.
    pub created_at: String,
    pub favourite: bool,
    pub tags: Vec<String>,
    pub parent: Option<i64>,
    pub deleted: bool,
    pub image_url: String,
    pub thumb_url: String,
}

impl From<ImageInfo> for GalleryItem {
    fn from(i: ImageInfo) -> Self {
        GalleryItem {
            id: i.id.0,
            image_url: format!("/api/v1/gallery/{}/image", i.id),
            thumb_url: format!("/api/v1/gallery/{}/thumb", i.id),
            prompt: i.prompt,
            negative_prompt: i.negative_prompt,
            model: i.model,
            model_hash: i.model_hash,
            sampler: i.sampler,
            steps: i.steps,
            guidance: i.guidance,
            seed: i.seed,
            width: i.width,
            height: i.height,
            mode: i.mode,
            created_at: i.created_at,
            favourite: i.favourite,
            tags: i.tags,
            parent: i.parent.map(|p| p.0),
            deleted: i.deleted,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct GalleryPage {
    pub items: Vec<GalleryItem>,
    /// Pass as `cursor` for the next page; null on the last.
    pub next_cursor: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct GalleryDetail {
    #[serde(flatten)]
    pub item: GalleryItem,
    /// The brume recipe (JSON), when brume made the image.
    #[schema(value_type = Option<Object>)]
    pub recipe: Option<serde_json::Value>,
    /// The A1111 "parameters" text.
    pub parameters: Option<String>,
    #[schema(value_type = Option<Object>)]
    pub timings: Option<serde_json::Value>,
    /// Ids from the root of the edit chain to this image.
    pub lineage: Vec<i64>,
}

impl From<ImageDetail> for GalleryDetail {
    fn from(d: ImageDetail) -> Self {
        GalleryDetail {
            lineage: d.lineage.iter().map(|i| i.0).collect(),
            item: d.info.into(),
            recipe: d.recipe,
            parameters: d.parameters,
            timings: d.timings,
        }
    }
}

fn id_of(s: &str) -> Result<ImageId, ApiError> {
    s.parse::<ImageId>().map_err(|_| {
        ApiError::not_found(format!(
            "no gallery image `{}`",
            crate::respond::clip(s, 40)
        ))
    })
}

fn num<T: std::str::FromStr>(
    q: &HashMap<String, String>,
    key: &'static str,
) -> Result<Option<T>, ApiError> {
    match q.get(key).map(|s| s.trim()).filter(|s| !s.is_empty()) {
        None => Ok(None),
        Some(v) => v.parse().map(Some).map_err(|_| {
            ApiError::invalid(
                key,
                format!("`{}` is not a valid number", crate::respond::clip(v, 40)),
            )
        }),
    }
}

/// Lists gallery images, newest first, filtered (every filter optional).
#[utoipa::path(get, path = "/api/v1/gallery", tag = "gallery",
    params(("q" = Option<String>, Query, description = "full-text search over prompts"), ("model" = Option<String>, Query),
           ("sampler" = Option<String>, Query), ("width" = Option<u32>, Query), ("height" = Option<u32>, Query),
           ("seed" = Option<u64>, Query), ("favourite" = Option<bool>, Query), ("tag" = Option<String>, Query),
           ("since" = Option<String>, Query, description = "RFC 3339 or YYYY-MM-DD"), ("until" = Option<String>, Query),
           ("parent" = Option<i64>, Query), ("deleted" = Option<String>, Query, description = "exclude (default), include, only"),
           ("cursor" = Option<String>, Query), ("limit" = Option<usize>, Query)),
    responses((status = 200, body = GalleryPage), (status = 422, body = ErrorResponse)))]
pub async fn list(
    State(st): State<AppState>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Json<GalleryPage>, ApiError> {
    let text = |k: &str| {
        q.get(k)
            .map(|s| s.to_string())
            .filter(|s| !s.trim().is_empty())
    };
    let time = |k: &'static str| -> Result<Option<i64>, ApiError> {
        match text(k) {
            Some(v) => brume_gallery::time::parse_time(&v, k)
                .map(Some)
                .map_err(ApiError::from),
            None => Ok(None),
        }
    };
    let favourite = match text("favourite").as_deref() {
        None => None,
        Some("true" | "1") => Some(true),
        Some("false" | "0") => Some(false),
        Some(_) => return Err(ApiError::invalid("favourite", "must be true or false")),
    };
    let deleted = match text("deleted").as_deref() {
        None | Some("exclude") => brume_gallery::Deleted::Exclude,
        Some("include") => brume_gallery::Deleted::Include,
        Some("only") => brume_gallery::Deleted::Only,
        Some(_) => {
            return Err(ApiError::invalid(
                "deleted",
                "must be exclude, include or only",
            ))
        }
    };
    let query = GalleryQuery {
        text: text("q"),
        model: text("model"),
        sampler: text("sampler"),
        width: num(&q, "width")?,
        height: num(&q, "height")?,
        seed: num(&q, "seed")?,
        since: time("since")?,
        until: time("until")?,
        favourite,
        tag: text("tag"),
        parent: num::<i64>(&q, "parent")?.map(ImageId),
        deleted,
        cursor: text("cursor"),
        limit: num(&q, "limit")?,
    };
    let g = st.gallery.clone();
    let page = blocking(move || g.list(&query)).await??;
    Ok(Json(GalleryPage {
        items: page.items.into_iter().map(Into::into).collect(),
        next_cursor: page.next_cursor,
    }))
}

#[utoipa::path(get, path = "/api/v1/gallery/{id}", tag = "gallery", params(("id" = i64, Path)),
    responses((status = 200, body = GalleryDetail), (status = 404, body = ErrorResponse)))]
pub async fn get(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<GalleryDetail>, ApiError> {
    let id = id_of(&id)?;
    let g = st.gallery.clone();
    Ok(Json(blocking(move || g.get(id)).await??.into()))
}

fn png_response(bytes: Vec<u8>, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "private, max-age=3600"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        Body::from(bytes),
    )
        .into_response()
}

/// The PNG as stored, recipe included; `?metadata=false` strips every text chunk (for sharing).
#[utoipa::path(get, path = "/api/v1/gallery/{id}/image", tag = "gallery", params(("id" = i64, Path), ("metadata" = Option<bool>, Query)),
    responses((status = 200, content_type = "image/png", body = Vec<u8>), (status = 404, body = ErrorResponse)))]
pub async fn image(
    State(st): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let id = id_of(&id)?;
    let with = match q.get("metadata").map(String::as_str) {
        None | Some("true" | "1") => true,
        Some("false" | "0") => false,
        Some(_) => return Err(ApiError::invalid("metadata", "must be true or false")),
    };
    let g = st.gallery.clone();
    let bytes = blocking(move || g.export(id, with)).await??;
    Ok(png_response(bytes, "image/png"))
}

#[utoipa::path(get, path = "/api/v1/gallery/{id}/thumb", tag = "gallery", params(("id" = i64, Path)),
    responses((status = 200, content_type = "image/png", body = Vec<u8>), (status = 404, body = ErrorResponse)))]
pub async fn thumb(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = id_of(&id)?;
    let g = st.gallery.clone();
    let bytes = blocking(move || g.thumb_bytes(id)).await??;
    Ok(png_response(bytes, brume_gallery::THUMB_CONTENT_TYPE))
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct GalleryPatch {
    #[serde(default)]
    pub favourite: Option<bool>,
    /// Replaces every tag.
    #[serde(default)]
    pub tags: Option<Vec<String>>,
}

#[utoipa::path(patch, path = "/api/v1/gallery/{id}", tag = "gallery", params(("id" = i64, Path)), request_body = GalleryPatch,
    responses((status = 200, body = GalleryDetail), (status = 404, body = ErrorResponse), (status = 422, body = ErrorResponse)))]
pub async fn patch(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(p): ApiJson<GalleryPatch>,
) -> Result<Json<GalleryDetail>, ApiError> {
    let id = id_of(&id)?;
    let g = st.gallery.clone();
    let detail = blocking(
        move || -> Result<ImageDetail, brume_gallery::GalleryError> {
            g.get(id)?;
            if let Some(f) = p.favourite {
                g.set_favourite(id, f)?;
            }
            if let Some(tags) = &p.tags {
                g.set_tags(id, tags)?;
            }
            g.get(id)
        },
    )
    .await??;
    Ok(Json(detail.into()))
}

/// Soft delete (restorable until a purge).
#[utoipa::path(delete, path = "/api/v1/gallery/{id}", tag = "gallery", params(("id" = i64, Path)),
    responses((status = 204), (status = 404, body = ErrorResponse)))]
pub async fn delete(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let id = id_of(&id)?;
    let g = st.gallery.clone();
    blocking(move || g.delete(id)).await??;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PurgeResponse {
    pub rows: usize,
    pub files: usize,
}

/// Removes soft-deleted images for good (rows and files).
#[utoipa::path(post, path = "/api/v1/gallery/purge", tag = "gallery", responses((status = 200, body = PurgeResponse)))]
pub async fn purge(State(st): State<AppState>) -> Result<Json<PurgeResponse>, ApiError> {
    let g = st.gallery.clone();
    let r = blocking(move || g.purge()).await??;
    Ok(Json(PurgeResponse {
        rows: r.rows,
        files: r.files,
    }))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ImportResponse {
    #[serde(flatten)]
    pub item: GalleryDetail,
    /// False when the same PNG was already in the gallery.
    pub created: bool,
}

/// Imports a PNG carrying a brume recipe or A1111 parameters (multipart `file`).
#[utoipa::path(post, path = "/api/v1/gallery/import", tag = "gallery", request_body(content_type = "multipart/form-data", content = Vec<u8>),
    responses((status = 201, body = ImportResponse), (status = 200, body = ImportResponse), (status = 422, body = ErrorResponse)))]
pub async fn import(State(st): State<AppState>, mp: Multipart) -> Result<Response, ApiError> {
    let mut file = None;
    for (name, part) in read_multipart(mp).await? {
        if name == "file" {
            file = Some(match part {
                Part::File(b) => b,
                Part::Text(t) => t.into_bytes(),
            });
        }
    }
    let bytes = file
        .ok_or_else(|| ApiError::invalid("file", "send the PNG as the multipart field `file`"))?;
    let g = st.gallery.clone();
    let (imported, detail) = blocking(move || -> Result<_, brume_gallery::GalleryError> {
        let i = g.import_bytes(bytes, "file")?;
        Ok((i, g.get(i.id)?))
    })
    .await??;
    let status = if imported.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(ImportResponse {
            item: detail.into(),
            created: imported.created,
        }),
    )
        .into_response())
}
