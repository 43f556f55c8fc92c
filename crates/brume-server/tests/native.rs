//! brume's own API end to end on the built-in model: a job over JSON and
//! over multipart, its events (SSE and WebSocket), the gallery endpoints, the
//! OpenAPI document.

mod common;

use common::*;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_txt2img_job_runs_streams_its_events_and_lands_in_the_gallery_once() {
    let s = start().await;
    let models: Value = s.get("/api/v1/models").await.json().await.unwrap();
    assert_eq!(models["models"][0]["name"], "builtin");
    assert_eq!(models["models"][0]["default_size"], 128);
    assert!(models["models"][0]["unets"]
        .as_array()
        .unwrap()
        .iter()
        .any(|u| u["name"] == "unet_lcm"));
    let samplers: Value = s.get("/api/v1/samplers").await.json().await.unwrap();
    assert!(samplers["samplers"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["name"] == "dpmpp_2m_karras" && x["label"] == "DPM++ 2M Karras"));
    let caps: Value = s.get("/api/v1/capabilities").await.json().await.unwrap();
    assert_eq!(caps["max_side"], 4096);

    let res = s
        .post_json(
            "/api/v1/jobs",
            &json!({"prompt": PROMPT, "steps": 3, "seed": 5, "batch": 2, "client": "t1"}),
        )
        .await;
    assert_eq!(res.status(), 202);
    let acc: Value = res.json().await.unwrap();
    let id = acc["id"].as_str().unwrap().to_string();
    assert_eq!(acc["state"], "queued");

    // SSE: the stream ends after the last event.
    let sse = s.get(&format!("/api/v1/jobs/{id}/events")).await;
    assert_eq!(sse.headers()["content-type"], "text/event-stream");
    let text = sse.text().await.unwrap();
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let last = events.last().expect("events");
    assert_eq!(last["type"], "done", "events: {text}");
    let result = &last["result"];
    assert_eq!(result["images"].as_array().unwrap().len(), 2);
    assert!(result["timings"]["total_ms"].as_f64().unwrap() > 0.0);

    let job: Value = s
        .get(&format!("/api/v1/jobs/{id}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(job["state"], "done");
    let mut ids = Vec::new();
    for img in job["result"]["images"].as_array().unwrap() {
        assert_eq!(img["seed"], 5);
        let url = img["url"].as_str().unwrap();
        let png = s.get(url).await.bytes().await.unwrap();
        let decoded = check_png(&png, PROMPT);
        assert_eq!((decoded.width(), decoded.height()), (128, 128));
        ids.push(img["gallery_id"].as_i64().unwrap());
        let thumb = s.get(img["thumb_url"].as_str().unwrap()).await;
        assert_eq!(thumb.status(), 200);
    }
    // Exactly once: two pictures, two rows.
    let page: Value = s.get("/api/v1/gallery").await.json().await.unwrap();
    assert_eq!(page["items"].as_array().unwrap().len(), 2);
    assert_eq!(s.server.gallery().count(true).unwrap(), 2);

    // The same prompt again skips the text encoder.
    let res = s
        .post_json(
            "/api/v1/jobs",
            &json!({"prompt": PROMPT, "steps": 2, "batch": 2, "preview_every": 0}),
        )
        .await;
    let id2 = res.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let events = s
        .get(&format!("/api/v1/jobs/{id2}/events"))
        .await
        .text()
        .await
        .unwrap();
    let done: Value = serde_json::from_str(
        events
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .next_back()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(done["result"]["timings"]["text_encoder_cached"], true);

    // Gallery: detail, stripped export, favourite and tags, search, soft delete.
    let g = ids[0];
    let detail: Value = s
        .get(&format!("/api/v1/gallery/{g}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(detail["prompt"], PROMPT);
    assert_eq!(detail["recipe"]["seed"], 5);
    assert_eq!(detail["lineage"], json!([g]));
    assert!(detail["parameters"].as_str().unwrap().contains("Steps: 3"));
    let stripped = s
        .get(&format!("/api/v1/gallery/{g}/image?metadata=false"))
        .await
        .bytes()
        .await
        .unwrap();
    assert!(
        png_text(&stripped).is_empty(),
        "the stripped export keeps no text"
    );
    let patched: Value = s
        .http
        .patch(s.url(&format!("/api/v1/gallery/{g}")))
        .json(&json!({"favourite": true, "tags": ["circles", "test"]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(patched["favourite"], true);
    assert_eq!(patched["tags"], json!(["circles", "test"]));
    let favs: Value = s
        .get("/api/v1/gallery?favourite=true")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(favs["items"].as_array().unwrap().len(), 1);
    let found: Value = s
        .get("/api/v1/gallery?q=circle&tag=circles")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(found["items"][0]["id"], g);
    let none: Value = s.get("/api/v1/gallery?q=zebra").await.json().await.unwrap();
    assert!(none["items"].as_array().unwrap().is_empty());
    assert_eq!(
        s.http
            .delete(s.url(&format!("/api/v1/gallery/{g}")))
            .send()
            .await
            .unwrap()
            .status(),
        204
    );
    let page: Value = s.get("/api/v1/gallery").await.json().await.unwrap();
    assert!(page["items"]
        .as_array()
        .unwrap()
        .iter()
        .all(|i| i["id"] != g));
    let purge: Value = s
        .post_json("/api/v1/gallery/purge", &json!({}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(purge["rows"], 1);
    assert_eq!(s.get(&format!("/api/v1/gallery/{g}")).await.status(), 404);

    // Import the remaining picture's PNG again: the same PNG, the same row.
    let png = s
        .get(&format!("/api/v1/gallery/{}/image", ids[1]))
        .await
        .bytes()
        .await
        .unwrap();
    let form = reqwest::multipart::Form::new().part(
        "file",
        reqwest::multipart::Part::bytes(png.to_vec()).file_name("a.png"),
    );
    let res = s
        .http
        .post(s.url("/api/v1/gallery/import"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.json::<Value>().await.unwrap()["id"], ids[1]);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multipart_edits_record_their_parent_and_the_websocket_carries_a_clients_events() {
    let s = start().await;
    let done = |v: &Value| v["type"] == "done";
    // A txt2img picture to edit.
    let res = s
        .post_json(
            "/api/v1/jobs",
            &json!({"prompt": PROMPT, "steps": 2, "seed": 1}),
        )
        .await;
    let id = res.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let ev = s
        .get(&format!("/api/v1/jobs/{id}/events"))
        .await
        .text()
        .await
        .unwrap();
    let last: Value = serde_json::from_str(
        ev.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .next_back()
            .unwrap(),
    )
    .unwrap();
    assert!(done(&last));
    let parent = last["result"]["images"][0]["gallery_id"].as_i64().unwrap();

    // Inpaint over multipart with files.
    let form = reqwest::multipart::Form::new()
        .text("prompt", "a yellow square on a blue background")
        .text("steps", "2")
        .text("seed", "3")
        .text("parent", parent.to_string())
        .part(
            "image",
            reqwest::multipart::Part::bytes(picture_png()).file_name("image.png"),
        )
        .part(
            "mask",
            reqwest::multipart::Part::bytes(mask_png()).file_name("mask.png"),
        );
    let res = s
        .http
        .post(s.url("/api/v1/jobs"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 202, "{}", res.text().await.unwrap());
    let id = res.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let ev = s
        .get(&format!("/api/v1/jobs/{id}/events"))
        .await
        .text()
        .await
        .unwrap();
    let last: Value = serde_json::from_str(
        ev.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .next_back()
            .unwrap(),
    )
    .unwrap();
    assert!(done(&last), "{ev}");
    let child = last["result"]["images"][0]["gallery_id"].as_i64().unwrap();
    let detail: Value = s
        .get(&format!("/api/v1/gallery/{child}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(detail["mode"], "inpaint");
    assert_eq!(detail["parent"], parent);
    assert_eq!(detail["lineage"], json!([parent, child]));

    // img2img over JSON with a data: URL.
    let body = json!({"prompt": "a green circle", "steps": 2, "image": format!("data:image/png;base64,{}", b64(&picture_png())), "strength": 0.5});
    let res = s.post_json("/api/v1/jobs", &body).await;
    assert_eq!(res.status(), 202);

    // WebSocket: submit, then every event of this client's job until done.
    let (mut ws, _) = tokio_tungstenite::connect_async(format!(
        "ws://{}/api/v1/ws?client=tab-1",
        s.server.addr()
    ))
    .await
    .unwrap();
    let submit = json!({"type": "submit", "job": {"prompt": PROMPT, "steps": 2, "priority": "interactive", "lane": "latest"}});
    ws.send(tokio_tungstenite::tungstenite::Message::Text(
        submit.to_string().into(),
    ))
    .await
    .unwrap();
    let mut kinds = Vec::new();
    while let Some(Ok(msg)) = ws.next().await {
        let Ok(text) = msg.into_text() else { continue };
        let v: Value = serde_json::from_str(&text).unwrap();
        kinds.push(v["type"].as_str().unwrap().to_string());
        if done(&v) {
            break;
        }
    }
    assert_eq!(kinds[0], "accepted");
    assert!(kinds.contains(&"step".to_string()), "{kinds:?}");
    assert_eq!(kinds.last().unwrap(), "done");
    // A bad message is answered, and the socket keeps working.
    ws.send(tokio_tungstenite::tungstenite::Message::Text(
        "{\"type\":\"submit\",\"job\":{\"prompt\":1}}".into(),
    ))
    .await
    .unwrap();
    let reply: Value =
        serde_json::from_str(&ws.next().await.unwrap().unwrap().into_text().unwrap()).unwrap();
    assert_eq!(reply["type"], "rejected");
    assert_eq!(reply["error"]["field"], "prompt");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_is_generated_and_the_editor_is_served() {
    let s = start().await;
    let doc: Value = s.get("/api/v1/openapi.json").await.json().await.unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    for p in [
        "/api/v1/jobs",
        "/api/v1/jobs/{id}",
        "/api/v1/jobs/{id}/events",
        "/api/v1/gallery",
        "/api/v1/models",
    ] {
        assert!(
            doc["paths"][p].is_object(),
            "{p} missing from the OpenAPI document"
        );
    }
    assert!(doc["components"]["schemas"]["JobRequest"]["properties"]["prompt"].is_object());
    let page = s.get("/").await;
    assert_eq!(page.status(), 200);
    assert!(page.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    assert!(page.headers().contains_key("content-security-policy"));
    assert_eq!(s.get("/assets/main.js").await.status(), 200);
    assert_eq!(s.get("/assets/../Cargo.toml").await.status(), 404);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_cut_at_the_text_encoders_length_is_told_to_the_client() {
    let s = start().await;
    let long = ["a red circle on a blue background"; 20].join(" and ");
    let res = s
        .post_json(
            "/api/v1/jobs",
            &json!({"prompt": long, "steps": 2, "preview_every": 0}),
        )
        .await;
    let id = res.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let text = s
        .get(&format!("/api/v1/jobs/{id}/events"))
        .await
        .text()
        .await
        .unwrap();
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(
        events
            .iter()
            .any(|e| e["type"] == "notice" && e["message"].is_string()),
        "{text}"
    );
    let done = events.last().unwrap();
    assert_eq!(done["type"], "done");
    assert!(!done["result"]["notices"].as_array().unwrap().is_empty());
    s.stop().await;
}
