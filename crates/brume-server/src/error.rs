//! One error type for every handler: a status, the request field at fault
//! (named as the client's API names it) and words a person can act on. It is
//! rendered as JSON in the flavour of the API the request came through
//! (brume's and A1111's `{"error": {"field", "message"}}`, OpenAI's
//! `{"error": {"message", "type", "param", "code"}}`) by [`crate::respond`]'s
//! middleware, which also turns axum's own plain-text rejections (unknown
//! route, wrong method, body too large) into the same shape. A bad request is
//! always a 4xx; a 5xx means the server itself failed (disk, database).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use brume_gallery::GalleryError;
use brume_runtime::SubmitError;
use serde::Serialize;

/// What went wrong with a request.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    /// The request field at fault (`steps`, `init_images[0]`, `size`), when one is.
    pub field: Option<String>,
    pub message: String,
    /// Seconds, for 429 (and 503 while shutting down).
    pub retry_after: Option<u64>,
}

/// The JSON body of a native (and A1111) error.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// The request field at fault, or null.
    pub field: Option<String>,
    pub message: String,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ErrorResponse {
    pub error: ErrorBody,
}

impl ApiError {
    pub fn new(status: StatusCode, field: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            status,
            field: field.map(str::to_string),
            message: message.into(),
            retry_after: None,
        }
    }

    /// Malformed: not JSON, not a form, a value that cannot be read.
    pub fn bad_request(field: Option<&str>, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, field, message)
    }

    /// Well-formed but not acceptable: out of range, not fitting the model.
    pub fn invalid(field: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, Some(field), message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, None, message)
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            Some("Authorization"),
            "this server needs its token: `Authorization: Bearer TOKEN`, or HTTP Basic with the token as the password",
        )
    }

    pub fn forbidden(field: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, Some(field), message)
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, None, message)
    }

    pub fn queue_full(limit: usize, retry_after_secs: u64) -> Self {
        let secs = retry_after_secs.max(1);
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            field: None,
            message: format!("the queue is full ({limit} jobs); retry in {secs} s"),
            retry_after: Some(secs),
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            retry_after: Some(5),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, None, message)
        }
    }

    /// The server's own failure (disk, database): logged in full, answered in brief.
    pub fn internal(context: &str, err: impl std::fmt::Display) -> Self {
        tracing::error!("{context}: {err}");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            format!("{context}: the server could not complete this (see its log)"),
        )
    }

    /// Renames the field through `map` (runtime names -> a client API's names).
    pub fn rename_field(mut self, map: impl Fn(&str) -> Option<&'static str>) -> Self {
        if let Some(f) = &self.field {
            if let Some(to) = map(f) {
                self.field = Some(to.to_string());
            }
        }
        self
    }

    pub fn body(&self) -> ErrorResponse {
        ErrorResponse {
            error: ErrorBody {
                field: self.field.clone(),
                message: self.message.clone(),
            },
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.field {
            Some(field) => write!(f, "{}: {field}: {}", self.status.as_u16(), self.message),
            None => write!(f, "{}: {}", self.status.as_u16(), self.message),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // The native shape; the flavour middleware re-renders it from the
        // extension for the other APIs.
        let mut res = (self.status, axum::Json(self.body())).into_response();
        add_headers(&mut res, &self);
        res.extensions_mut().insert(self);
        res
    }
}

/// Retry-After and WWW-Authenticate, whatever the flavour.
pub(crate) fn add_headers(res: &mut Response, e: &ApiError) {
    if let Some(secs) = e.retry_after {
        if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
            res.headers_mut().insert(header::RETRY_AFTER, v);
        }
    }
    if e.status == StatusCode::UNAUTHORIZED {
        res.headers_mut().append(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"brume\""),
        );
        res.headers_mut().append(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Basic realm=\"brume\", charset=\"UTF-8\""),
        );
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Invalid { field, message } => ApiError::invalid(field, message),
            SubmitError::QueueFull { limit, retry_after } => {
                ApiError::queue_full(limit, retry_after.as_secs())
            }
            SubmitError::Stopped => ApiError::unavailable("the server is shutting down"),
        }
    }
}

impl From<GalleryError> for ApiError {
    fn from(e: GalleryError) -> Self {
        match e {
            GalleryError::NotFound(id) => {
                ApiError::not_found(format!("gallery image {id} not found"))
            }
            GalleryError::Invalid { field, message } => ApiError::invalid(field, message),
            e @ (GalleryError::BadPng { .. }
            | GalleryError::Metadata { .. }
            | GalleryError::NoRecipe(_)) => ApiError::invalid("file", e.to_string()),
            e => ApiError::internal("gallery", e),
        }
    }
}

/// An engine error about an uploaded picture (decoding, limits): the client's fault.
pub(crate) fn image_error(field: &str, e: brume::RunError) -> ApiError {
    match e {
        brume::RunError::Invalid(m) => ApiError::invalid(field, m),
        other => ApiError::invalid(field, other.to_string()),
    }
}
