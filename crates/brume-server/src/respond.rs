//! The middleware every request passes: the origin guard (other web pages
//! and DNS-rebinding hosts are refused), authentication, and the error
//! flavour (every 4xx/5xx leaves as JSON in the shape of the API it came
//! through, axum's own plain-text rejections included).

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine;

use crate::error::{add_headers, ApiError};
use crate::state::AppState;

/// At most `n` characters of client text echoed in a message.
pub fn clip(s: &str, n: usize) -> String {
    let mut out: String = s.chars().take(n).filter(|c| !c.is_control()).collect();
    if s.chars().count() > n {
        out.push('…');
    }
    out
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Flavour {
    Native,
    A1111,
    OpenAi,
}

fn flavour(path: &str) -> Flavour {
    if path.starts_with("/v1/") || path == "/v1" {
        Flavour::OpenAi
    } else if path.starts_with("/sdapi/") {
        Flavour::A1111
    } else {
        Flavour::Native
    }
}

/// Renders every error response in its API's shape.
pub async fn errors(req: Request, next: Next) -> Response {
    let fl = flavour(req.uri().path());
    let res = next.run(req).await;
    let status = res.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return res;
    }
    let (parts, body) = res.into_parts();
    let err = match parts.extensions.get::<ApiError>() {
        Some(e) => e.clone(),
        None => {
            // axum's own rejection (no route, wrong method, body too large...): plain text.
            let text = axum::body::to_bytes(body, 64 << 10)
                .await
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default();
            let message = match (status, text.trim()) {
                (StatusCode::NOT_FOUND, "") => "no such endpoint".to_string(),
                (StatusCode::METHOD_NOT_ALLOWED, "") => {
                    "this endpoint does not take that method".to_string()
                }
                (_, "") => status.canonical_reason().unwrap_or("error").to_string(),
                (_, t) => clip(t, 300),
            };
            let mut e = ApiError::new(status, None, message);
            if let Some(r) = parts
                .headers
                .get(header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
            {
                e.retry_after = Some(r);
            }
            e
        }
    };
    let mut out = render(fl, &err);
    // Keep what outer layers added (CORS headers, Allow on a 405).
    let ours: Vec<header::HeaderName> = out.headers().keys().cloned().collect();
    for (name, value) in parts.headers.iter() {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH && !ours.contains(name) {
            out.headers_mut().append(name.clone(), value.clone());
        }
    }
    out
}

fn render(fl: Flavour, e: &ApiError) -> Response {
    let body = match fl {
        Flavour::Native => {
            serde_json::json!({ "error": { "field": e.field, "message": e.message } })
        }
        // A1111 (FastAPI) clients read `detail`; the field stays where brume's clients find it.
        Flavour::A1111 => serde_json::json!({
            "error": { "field": e.field, "message": e.message },
            "detail": match &e.field { Some(f) => format!("{f}: {}", e.message), None => e.message.clone() },
        }),
        Flavour::OpenAi => {
            let kind = match e.status.as_u16() {
                401 => "authentication_error",
                404 => "not_found_error",
                429 => "rate_limit_exceeded",
                500..=599 => "server_error",
                _ => "invalid_request_error",
            };
            let code = match e.status.as_u16() {
                401 => Some("invalid_api_key"),
                413 => Some("request_too_large"),
                429 => Some("queue_full"),
                _ => None,
            };
            serde_json::json!({ "error": { "message": e.message, "type": kind, "param": e.field, "code": code } })
        }
    };
    // OpenAI answers every invalid request with 400 (its SDKs raise BadRequestError).
    let status = if fl == Flavour::OpenAi && e.status == StatusCode::UNPROCESSABLE_ENTITY {
        StatusCode::BAD_REQUEST
    } else {
        e.status
    };
    let mut res = (status, axum::Json(body)).into_response();
    add_headers(&mut res, e);
    res.extensions_mut().insert(e.clone());
    res
}

/// Constant-time comparison (a token must not leak through timing).
fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether the request carries the token: Bearer, HTTP Basic's password, or
/// `?token=` on the two streaming endpoints browsers cannot set headers for.
fn authorized(token: &str, headers: &HeaderMap, path: &str, query: Option<&str>) -> bool {
    for v in headers.get_all(header::AUTHORIZATION) {
        let Ok(v) = v.to_str() else { continue };
        let v = v.trim();
        let (scheme, rest) = v.split_once(' ').unwrap_or((v, ""));
        let rest = rest.trim();
        if scheme.eq_ignore_ascii_case("bearer") && same(rest.as_bytes(), token.as_bytes()) {
            return true;
        }
        if scheme.eq_ignore_ascii_case("basic") {
            if let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(rest) {
                if let Some(i) = decoded.iter().position(|&b| b == b':') {
                    if same(&decoded[i + 1..], token.as_bytes()) {
                        return true;
                    }
                }
            }
        }
    }
    let streaming =
        path == "/api/v1/ws" || (path.starts_with("/api/v1/jobs/") && path.ends_with("/events"));
    if streaming {
        if let Some(q) = query {
            for pair in q.split('&') {
                if let Some(v) = pair.strip_prefix("token=") {
                    let v = percent_decode(v);
                    if same(v.as_bytes(), token.as_bytes()) {
                        return true;
                    }
                }
            }
        }
    }
    false
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                match u8::from_str_radix(
                    std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("zz"),
                    16,
                ) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                    }
                    Err(_) => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The host part of a `Host` header or an origin's authority (`[::1]:80` -> `::1`).
fn host_only(authority: &str) -> &str {
    let a = authority.trim();
    if let Some(rest) = a.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    a.rsplit_once(':')
        .map(|(h, p)| {
            if p.chars().all(|c| c.is_ascii_digit()) {
                h
            } else {
                a
            }
        })
        .unwrap_or(a)
}

fn is_loopback_name(host: &str) -> bool {
    let h = host.to_ascii_lowercase();
    h == "localhost"
        || h.ends_with(".localhost")
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Refuses requests from other web pages (an `Origin` that is neither this
/// server nor a `--cors` origin) and, on loopback, requests whose `Host` is
/// not a loopback name (a DNS-rebinding page would send its own).
/// Then checks the token.
pub async fn guard(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let fl = flavour(req.uri().path());
    let headers = req.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if st.settings.loopback && !host.is_empty() && !is_loopback_name(host_only(host)) {
        return render(
            fl,
            &ApiError::forbidden(
                "Host",
                "this server listens on loopback and answers only to localhost names",
            ),
        );
    }
    if let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
        let same_site = origin
            .split_once("://")
            .map(|(_, auth)| auth.eq_ignore_ascii_case(host))
            .unwrap_or(false);
        let allowed = st
            .settings
            .cors_origins
            .iter()
            .any(|o| o == "*" || o.eq_ignore_ascii_case(origin));
        if !same_site && !allowed && origin != "null" {
            return render(
                fl,
                &ApiError::forbidden("Origin", format!("requests from {} are refused; start brume serve with --cors {} to allow them", clip(origin, 100), clip(origin, 100))),
            );
        }
    }
    if let Some(token) = &st.settings.token {
        // Preflights carry no credentials; the CORS layer answers them.
        let preflight = req.method() == axum::http::Method::OPTIONS
            && headers.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
        if !preflight && !authorized(token, headers, req.uri().path(), req.uri().query()) {
            return render(fl, &ApiError::unauthorized());
        }
    }
    next.run(req).await
}

/// An empty body with a status (for handlers that answer nothing).
#[allow(dead_code)]
pub fn empty(status: StatusCode) -> Response {
    (status, Body::empty()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_read_from_bearer_basic_and_the_streams_query() {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        assert!(authorized("s3cret", &h, "/api/v1/models", None));
        assert!(!authorized("other", &h, "/api/v1/models", None));
        let basic = base64::engine::general_purpose::STANDARD.encode("user:s3cret");
        h.insert(
            header::AUTHORIZATION,
            format!("Basic {basic}").parse().unwrap(),
        );
        assert!(authorized("s3cret", &h, "/sdapi/v1/options", None));
        let none = HeaderMap::new();
        assert!(authorized(
            "a b",
            &none,
            "/api/v1/ws",
            Some("client=x&token=a%20b")
        ));
        assert!(!authorized(
            "s3cret",
            &none,
            "/api/v1/models",
            Some("token=s3cret")
        ));
    }

    #[test]
    fn hosts() {
        assert_eq!(host_only("127.0.0.1:7860"), "127.0.0.1");
        assert_eq!(host_only("[::1]:7860"), "::1");
        assert_eq!(host_only("localhost"), "localhost");
        assert!(
            is_loopback_name("localhost")
                && is_loopback_name("127.0.0.1")
                && is_loopback_name("::1")
        );
        assert!(!is_loopback_name("evil.example"));
    }
}
