//! Reading requests: JSON with the failing field named (through serde's path),
//! base64 pictures with or without a `data:` prefix, multipart forms.

use axum::body::Bytes;
use axum::extract::{FromRequest, Multipart, Request};
use base64::Engine;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// JSON body; a syntax error is a 400, a wrong type or a missing field a 422
/// naming the field (`steps`, `extend[2]`), a body over the limit a 413.
/// Any Content-Type is read as JSON (curl's `-d` sends a form type); the
/// origin check, not the type, keeps other web pages out.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = body_bytes(req, state).await?;
        parse_json(&bytes).map(ApiJson)
    }
}

/// The whole body within the configured limit.
pub async fn body_bytes<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, ApiError> {
    Bytes::from_request(req, state).await.map_err(|e| {
        if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large("the request body is larger than this server accepts")
        } else {
            ApiError::bad_request(None, format!("cannot read the request body: {e}"))
        }
    })
}

/// Parses JSON bytes into `T`, naming the field at fault.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(
            None,
            "the request body is empty; send a JSON object",
        ));
    }
    // Every request body is an object; a list would be read as a struct's fields in order.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::new(
            axum::http::StatusCode::UNPROCESSABLE_ENTITY,
            None,
            "send a JSON object ({...})",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(json_error)?;
    de.end()
        .map_err(|e| ApiError::bad_request(None, format!("invalid JSON: {e}")))?;
    Ok(value)
}

/// Converts an already parsed JSON value into `T`, naming the field at fault.
pub fn from_value<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(json_error)
}

fn json_error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    let message = strip_position(&inner.to_string());
    let field = field_of(&path, &message);
    match inner.classify() {
        serde_json::error::Category::Data => match field {
            Some(f) => ApiError::invalid(&f, message),
            None => ApiError::new(axum::http::StatusCode::UNPROCESSABLE_ENTITY, None, message),
        },
        _ => ApiError::bad_request(field.as_deref(), format!("invalid JSON: {message}")),
    }
}

/// The field a serde error is about: its path, plus the name in "missing field `x`".
fn field_of(path: &str, message: &str) -> Option<String> {
    let base = (path != "." && !path.is_empty()).then(|| path.to_string());
    let missing = message
        .strip_prefix("missing field `")
        .and_then(|r| r.split('`').next())
        .map(str::to_string);
    match (base, missing) {
        (Some(b), Some(m)) => Some(format!("{b}.{m}")),
        (None, Some(m)) => Some(m),
        (b, None) => b,
    }
}

/// serde_json appends " at line 1 column 17"; the field name says more.
fn strip_position(m: &str) -> String {
    match m.rfind(" at line ") {
        Some(i) => m[..i].to_string(),
        None => m.to_string(),
    }
}

/// Decodes a base64 picture (standard or URL-safe alphabet, padded or not,
/// with or without a `data:image/...;base64,` prefix and line breaks).
pub fn decode_base64(field: &str, text: &str) -> Result<Vec<u8>, ApiError> {
    let text = text.trim();
    let payload = match text.strip_prefix("data:") {
        Some(rest) => match rest.split_once(',') {
            Some((meta, data)) if meta.ends_with(";base64") => data,
            _ => {
                return Err(ApiError::invalid(
                    field,
                    "a data: URL must be base64 (`data:image/png;base64,...`)",
                ))
            }
        },
        None => text,
    };
    if payload.is_empty() {
        return Err(ApiError::invalid(
            field,
            "is empty: send a picture as base64",
        ));
    }
    let clean: String = payload
        .chars()
        .filter(|c| !c.is_ascii_whitespace())
        .collect();
    let config = base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent)
        .with_decode_allow_trailing_bits(true);
    let standard = base64::engine::GeneralPurpose::new(&base64::alphabet::STANDARD, config);
    let url_safe = base64::engine::GeneralPurpose::new(&base64::alphabet::URL_SAFE, config);
    standard
        .decode(clean.as_bytes())
        .or_else(|_| url_safe.decode(clean.as_bytes()))
        .map_err(|e| ApiError::invalid(field, format!("is not valid base64: {e}")))
}

pub fn encode_base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// One multipart part: a text field or a file.
pub enum Part {
    Text(String),
    File(Vec<u8>),
}

/// Reads every part of a form (within the body limit), in order.
pub async fn read_multipart(mut mp: Multipart) -> Result<Vec<(String, Part)>, ApiError> {
    let mut parts = Vec::new();
    loop {
        let field = match mp.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => return Err(multipart_error(e)),
        };
        let name = field.name().unwrap_or("").to_string();
        let is_file = field.file_name().is_some();
        let bytes = field.bytes().await.map_err(multipart_error)?;
        if parts.len() >= 64 {
            return Err(ApiError::bad_request(None, "more than 64 form fields"));
        }
        let part = if is_file {
            Part::File(bytes.to_vec())
        } else {
            match String::from_utf8(bytes.to_vec()) {
                Ok(s) => Part::Text(s),
                Err(_) => Part::File(bytes.to_vec()),
            }
        };
        parts.push((name, part));
    }
    Ok(parts)
}

fn multipart_error(e: axum::extract::multipart::MultipartError) -> ApiError {
    if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::too_large("the form is larger than this server accepts")
    } else {
        ApiError::bad_request(None, format!("cannot read the form: {}", e.body_text()))
    }
}

/// Whether the request is a multipart form.
pub fn is_multipart(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.trim_start()
                .to_ascii_lowercase()
                .starts_with("multipart/form-data")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct T {
        prompt: String,
        steps: Option<usize>,
        extend: Option<[usize; 4]>,
    }

    #[test]
    fn errors_name_the_field() {
        let e = parse_json::<T>(br#"{"prompt": "x", "steps": -1}"#).unwrap_err();
        assert_eq!(
            (e.status.as_u16(), e.field.as_deref()),
            (422, Some("steps"))
        );
        let e = parse_json::<T>(br#"{"steps": 2}"#).unwrap_err();
        assert_eq!(
            (e.status.as_u16(), e.field.as_deref()),
            (422, Some("prompt"))
        );
        let e = parse_json::<T>(br#"{"prompt": "x", "extend": [1, 2, "a", 4]}"#).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("extend[2]"));
        let e = parse_json::<T>(br#"{"prompt": "x""#).unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        let e = parse_json::<T>(b"").unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
    }

    #[test]
    fn base64_with_and_without_a_data_prefix() {
        assert_eq!(decode_base64("image", "aGVsbG8=").unwrap(), b"hello");
        assert_eq!(
            decode_base64("image", "data:image/png;base64,aGVsbG8").unwrap(),
            b"hello"
        );
        assert_eq!(decode_base64("image", "aGVs\nbG8=").unwrap(), b"hello");
        assert_eq!(
            decode_base64("image", "!!!").unwrap_err().field.as_deref(),
            Some("image")
        );
    }
}
