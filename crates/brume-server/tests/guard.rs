//! Refusals: bad requests get a 4xx naming the field and the server keeps
//! serving; the token is required when set; a non-loopback bind without one
//! refuses to start; the queue bound answers 429 with Retry-After; other web
//! pages are refused.

mod common;

use common::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_a_4xx_naming_the_field_and_the_server_keeps_serving() {
    let s = start().await;
    let huge_side = json!({"prompt": "x", "width": 1_000_000});
    let cases: Vec<(&str, &str, String, u16, Option<&str>)> = vec![
        ("POST", "/api/v1/jobs", "{not json".into(), 400, None),
        ("POST", "/api/v1/jobs", "".into(), 400, None),
        ("POST", "/api/v1/jobs", "[1,2]".into(), 422, None),
        ("POST", "/api/v1/jobs", json!({"steps": 2}).to_string(), 422, Some("prompt")),
        ("POST", "/api/v1/jobs", json!({"prompt": 5}).to_string(), 422, Some("prompt")),
        ("POST", "/api/v1/jobs", json!({"prompt": "x", "steps": -3}).to_string(), 422, Some("steps")),
        ("POST", "/api/v1/jobs", json!({"prompt": "x", "steps": 1e40}).to_string(), 422, Some("steps")),
        ("POST", "/api/v1/jobs", json!({"prompt": "x", "steps": 9999}).to_string(), 422, Some("steps")),
        ("POST", "/api/v1/jobs", huge_side.to_string(), 422, Some("width")),
        ("POST", "/api/v1/jobs", json!({"prompt": "x", "guidance": "high"}).to_string(), 422, Some("guidance")),
        ("POST", "/api/v1/jobs", json!({"prompt": "x", "mode": "paint"}).to_string(), 422, Some("mode")),
        ("POST", "/api/v1/jobs", json!({"prompt": "x", "sampler": "fastest"}).to_string(), 422, Some("sampler")),
        ("POST", "/api/v1/jobs", json!({"prompt": "x", "model": "../../etc/passwd"}).to_string(), 422, Some("model")),
        ("POST", "/api/v1/jobs", json!({"prompt": "x", "unet": "../vae"}).to_string(), 422, Some("unet")),
        ("POST", "/api/v1/jobs", json!({"prompt": "x", "mode": "img2img"}).to_string(), 422, Some("image")),
        ("POST", "/api/v1/jobs", json!({"prompt": "x", "image": "%%%"}).to_string(), 422, Some("image")),
        ("POST", "/api/v1/jobs", json!({"prompt": "x", "image": b64(b"\x89PNG\r\n\x1a\nbroken")}).to_string(), 422, Some("image")),
        ("POST", "/api/v1/jobs", json!({"prompt": "x", "mode": "outpaint", "image": b64(&picture_png())}).to_string(), 422, Some("extend")),
        ("POST", "/api/v1/jobs", json!({"prompt": "x", "image": b64(&picture_png()), "extend": [1, 2]}).to_string(), 422, Some("extend")),
        ("POST", "/api/v1/jobs", json!({"prompt": "x", "image": b64(&picture_png()), "mask": b64(&encode(&image::DynamicImage::new_luma8(64, 64)))}).to_string(), 422, Some("mask")),
        ("POST", "/api/v1/jobs", json!({"prompt": "x", "parent": 999999}).to_string(), 422, Some("parent")),
        ("POST", "/api/v1/jobs", json!({"prompt": "x", "priority": "urgent"}).to_string(), 422, Some("priority")),
        ("GET", "/api/v1/jobs/12345", String::new(), 404, None),
        ("GET", "/api/v1/jobs/..%2F..%2Fetc", String::new(), 404, None),
        ("GET", "/api/v1/gallery/0", String::new(), 404, None),
        ("GET", "/api/v1/gallery/abc/image", String::new(), 404, None),
        ("GET", "/api/v1/gallery?limit=100000", String::new(), 422, Some("limit")),
        ("GET", "/api/v1/gallery?seed=-1", String::new(), 422, Some("seed")),
        ("GET", "/api/v1/gallery?since=yesterday-ish", String::new(), 422, Some("since")),
        ("GET", "/nope", String::new(), 404, None),
        ("GET", "/assets/..%2F..%2FCargo.toml", String::new(), 404, None),
        ("PUT", "/api/v1/models", String::new(), 405, None),
    ];
    for (method, path, body, status, field) in cases {
        let req = s
            .http
            .request(method.parse().unwrap(), s.url(path))
            .header("content-type", "application/json")
            .body(body.clone());
        let res = req.send().await.unwrap();
        assert_eq!(res.status().as_u16(), status, "{method} {path} {body}");
        let e: Value = res
            .json()
            .await
            .unwrap_or_else(|_| panic!("{method} {path}: the error is JSON"));
        assert!(e["error"]["message"].is_string(), "{method} {path}: {e}");
        if let Some(f) = field {
            assert_eq!(e["error"]["field"], f, "{method} {path} {body}: {e}");
        }
    }
    // A body over the limit: 413, as JSON.
    let big = vec![b'a'; 33 << 20];
    // (Its own client: the server answers before reading it all and closes that connection.)
    let res = reqwest::Client::new()
        .post(s.url("/api/v1/jobs"))
        .body(big)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 413);
    assert!(res.json::<Value>().await.unwrap()["error"]["message"].is_string());
    // Still serving.
    let res = s
        .post_json("/api/v1/jobs", &json!({"prompt": PROMPT, "steps": 2}))
        .await;
    assert_eq!(res.status(), 202);
    assert_eq!(s.get("/api/v1/models").await.status(), 200);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_token_every_request_needs_it() {
    let s = start_with(|c| c.token = Some("s3cret".into())).await;
    let res = s.get("/api/v1/models").await;
    assert_eq!(res.status(), 401);
    let auth: Vec<_> = res
        .headers()
        .get_all("www-authenticate")
        .iter()
        .map(|v| v.to_str().unwrap().to_string())
        .collect();
    assert!(
        auth.iter().any(|a| a.starts_with("Bearer")) && auth.iter().any(|a| a.starts_with("Basic")),
        "{auth:?}"
    );
    assert_eq!(
        res.json::<Value>().await.unwrap()["error"]["field"],
        "Authorization"
    );
    assert_eq!(s.get("/").await.status(), 401);
    assert_eq!(
        s.http
            .get(s.url("/api/v1/models"))
            .bearer_auth("wrong")
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    assert_eq!(
        s.http
            .get(s.url("/api/v1/models"))
            .bearer_auth("s3cret")
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    // A1111 clients: HTTP Basic with the token as the password.
    assert_eq!(
        s.http
            .get(s.url("/sdapi/v1/options"))
            .basic_auth("any", Some("s3cret"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    // OpenAI clients: Bearer; errors in OpenAI's shape.
    let res = s.get("/v1/models").await;
    assert_eq!(res.status(), 401);
    assert_eq!(
        res.json::<Value>().await.unwrap()["error"]["code"],
        "invalid_api_key"
    );
    // ?token= only where browsers cannot set headers.
    assert_eq!(s.get("/api/v1/models?token=s3cret").await.status(), 401);
    let ws = tokio_tungstenite::connect_async(format!(
        "ws://{}/api/v1/ws?client=a&token=s3cret",
        s.server.addr()
    ))
    .await;
    assert!(ws.is_ok(), "the WebSocket takes ?token=");
    let ws =
        tokio_tungstenite::connect_async(format!("ws://{}/api/v1/ws?client=a", s.server.addr()))
            .await;
    assert!(ws.is_err(), "the WebSocket needs the token");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_loopback_address_without_a_token_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = brume_server::ServerConfig::new(vec![builtin()], dir.path().join("data"));
    config.listen = "0.0.0.0:0".parse().unwrap();
    let err = match brume_server::serve(config).await {
        Ok(_) => panic!("started without a token on 0.0.0.0"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("without a token") && err.contains("--token"),
        "{err}"
    );
    assert!(
        !dir.path().join("data").exists(),
        "nothing was created before refusing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_queue_limit_requests_get_429_with_retry_after() {
    let s = start_with(|c| c.queue_limit = 1).await;
    let long = json!({"prompt": "a circle", "steps": 150, "seed": 1, "preview_every": 0});
    let first: Value = s
        .post_json("/api/v1/jobs", &long)
        .await
        .json()
        .await
        .unwrap();
    let id = first["id"].as_str().unwrap().to_string();
    until(60, async || {
        s.get(&format!("/api/v1/jobs/{id}"))
            .await
            .json::<Value>()
            .await
            .unwrap()["state"]
            == "running"
    })
    .await;
    let second = s.post_json("/api/v1/jobs", &long).await;
    assert_eq!(second.status(), 202);
    let second: Value = second.json().await.unwrap();
    assert_eq!(second["position"], 0);
    for (path, body) in [
        ("/api/v1/jobs", long.clone()),
        ("/sdapi/v1/txt2img", json!({"prompt": "x"})),
        ("/v1/images/generations", json!({"prompt": "x"})),
    ] {
        let res = s.post_json(path, &body).await;
        assert_eq!(res.status(), 429, "{path}");
        let secs: u64 = res.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(secs >= 1);
    }
    // Cancel both (POST .../cancel and DELETE).
    let c: Value = s
        .post_json(&format!("/api/v1/jobs/{id}/cancel"), &json!({}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(c["id"], id.as_str());
    let sid = second["id"].as_str().unwrap();
    let c: Value = s
        .http
        .delete(s.url(&format!("/api/v1/jobs/{sid}")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(c["state"], "cancelled");
    let events = s
        .get(&format!("/api/v1/jobs/{id}/events"))
        .await
        .text()
        .await
        .unwrap();
    assert!(events.contains("\"reason\":\"user\""), "{events}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_web_pages_and_rebinding_hosts_are_refused_unless_allowed() {
    let s = start().await;
    let res = s
        .http
        .get(s.url("/api/v1/models"))
        .header("origin", "http://evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 403);
    assert_eq!(
        res.json::<Value>().await.unwrap()["error"]["field"],
        "Origin"
    );
    let same = format!("http://{}", s.server.addr());
    assert_eq!(
        s.http
            .get(s.url("/api/v1/models"))
            .header("origin", same)
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let res = s
        .http
        .get(s.url("/api/v1/models"))
        .header("host", "attacker.example:7860")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 403);
    assert!(res.headers().get("access-control-allow-origin").is_none());
    s.stop().await;

    let s = start_with(|c| c.cors_origins = vec!["http://localhost:3000".into()]).await;
    let res = s
        .http
        .get(s.url("/api/v1/models"))
        .header("origin", "http://localhost:3000")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(
        res.headers()["access-control-allow-origin"],
        "http://localhost:3000"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_answers_waiting_requests_and_ends_event_streams() {
    let s = start().await;
    let long = json!({"prompt": "a circle", "steps": 150, "seed": 1});
    let (http, url) = (s.http.clone(), s.url("/sdapi/v1/txt2img"));
    let waiting = tokio::spawn(async move {
        http.post(url)
            .json(&long)
            .send()
            .await
            .map(|r| r.status().as_u16())
    });
    until(60, async || {
        s.server.runtime().running().is_some_and(
            |r| matches!(r.state, brume_runtime::JobState::Running { step, .. } if step >= 1),
        )
    })
    .await;
    let id = s.server.runtime().running().unwrap().id;
    let (http, url) = (s.http.clone(), s.url(&format!("/api/v1/jobs/{id}/events")));
    let events =
        tokio::spawn(async move { http.get(url).send().await.unwrap().text().await.unwrap() });
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let t = std::time::Instant::now();
    s.server.shutdown().await;
    assert!(
        t.elapsed() < std::time::Duration::from_secs(5),
        "shutdown took {:?}",
        t.elapsed()
    );
    assert_eq!(
        waiting.await.unwrap().unwrap(),
        200,
        "the waiting request was answered"
    );
    let text = tokio::time::timeout(std::time::Duration::from_secs(5), events)
        .await
        .unwrap()
        .unwrap();
    assert!(text.contains("\"reason\":\"shutdown\""), "{text}");
}
