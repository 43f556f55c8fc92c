//! The web editor's files (embedded by brume-web): `/` is the page, `/assets/NAME` its modules.

use axum::extract::Path;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

fn serve(path: &str) -> Result<Response, ApiError> {
    let asset = brume_web::asset(path).ok_or_else(|| {
        ApiError::not_found(format!("no file `{}`", crate::respond::clip(path, 80)))
    })?;
    let mut res = (
        [
            (header::CONTENT_TYPE, asset.mime),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        asset.bytes,
    )
        .into_response();
    if asset.mime.starts_with("text/html") {
        if let Ok(v) = header::HeaderValue::from_str(brume_web::CONTENT_SECURITY_POLICY) {
            res.headers_mut().insert(header::CONTENT_SECURITY_POLICY, v);
        }
        res.headers_mut().insert(
            header::REFERRER_POLICY,
            header::HeaderValue::from_static("no-referrer"),
        );
    }
    Ok(res)
}

pub async fn index() -> Result<Response, ApiError> {
    serve("/")
}

pub async fn asset(Path(path): Path<String>) -> Result<Response, ApiError> {
    serve(&format!("/assets/{path}"))
}
