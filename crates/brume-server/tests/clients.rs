//! The A1111 and OpenAI endpoints as their clients call them (the requests
//! Open WebUI and SillyTavern send; OpenAI's SDK shapes), end to end.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a1111_clients_read_models_switch_generate_poll_and_interrupt() {
    // Two names for the built-in model, to see the switch take effect.
    let s = start_with(|c| {
        c.models.push(brume_runtime::ModelEntry {
            name: "second".into(),
            ..builtin()
        })
    })
    .await;
    // What SillyTavern / Open WebUI read first.
    let opts: Value = s.get("/sdapi/v1/options").await.json().await.unwrap();
    let title = opts["sd_model_checkpoint"].as_str().unwrap().to_string();
    assert!(title.starts_with("builtin ["), "{title}");
    let models: Value = s.get("/sdapi/v1/sd-models").await.json().await.unwrap();
    assert_eq!(models[0]["title"], title);
    assert_eq!(models.as_array().unwrap().len(), 2);
    let second = models[1]["title"].as_str().unwrap().to_string();
    assert_eq!(models[0]["model_name"], "builtin");
    assert_eq!(models[0]["hash"].as_str().unwrap().len(), 10);
    let samplers: Value = s.get("/sdapi/v1/samplers").await.json().await.unwrap();
    let names: Vec<&str> = samplers
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["name"].as_str().unwrap())
        .collect();
    for n in ["Euler a", "DPM++ 2M Karras", "DDIM", "LCM"] {
        assert!(names.contains(&n), "{n} missing from {names:?}");
    }
    let scheds: Value = s.get("/sdapi/v1/schedulers").await.json().await.unwrap();
    assert!(scheds
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["name"] == "karras"));
    assert_eq!(
        s.get("/sdapi/v1/upscalers")
            .await
            .json::<Value>()
            .await
            .unwrap(),
        json!([])
    );

    // Switch (by title, as SillyTavern sends it); an unknown model is named.
    assert_eq!(
        s.post_json(
            "/sdapi/v1/options",
            &json!({"sd_model_checkpoint": title, "CLIP_stop_at_last_layers": 1})
        )
        .await
        .status(),
        200
    );
    let bad = s
        .post_json(
            "/sdapi/v1/options",
            &json!({"sd_model_checkpoint": "sdxl.safetensors"}),
        )
        .await;
    assert_eq!(bad.status(), 422);
    assert_eq!(
        bad.json::<Value>().await.unwrap()["error"]["field"],
        "sd_model_checkpoint"
    );

    // The switch takes effect for later requests, and options report it.
    assert_eq!(
        s.post_json("/sdapi/v1/options", &json!({"sd_model_checkpoint": second}))
            .await
            .status(),
        200
    );
    let opts: Value = s.get("/sdapi/v1/options").await.json().await.unwrap();
    assert_eq!(opts["sd_model_checkpoint"], second.as_str());
    let body: Value = s
        .post_json("/sdapi/v1/txt2img", &json!({"prompt": PROMPT, "steps": 2}))
        .await
        .json()
        .await
        .unwrap();
    let info: Value = serde_json::from_str(body["info"].as_str().unwrap()).unwrap();
    assert_eq!(info["sd_model_name"], "second");
    assert_eq!(
        s.post_json(
            "/sdapi/v1/options",
            &json!({"sd_model_checkpoint": "builtin"})
        )
        .await
        .status(),
        200
    );

    // txt2img as SillyTavern sends it (many fields brume ignores).
    let req = json!({
        "prompt": PROMPT, "negative_prompt": "blurry", "sampler_name": "DPM++ 2M", "scheduler": "Karras",
        "steps": 3, "cfg_scale": 5, "width": 128, "height": 128, "restore_faces": false, "enable_hr": false,
        "hr_upscaler": "Latent", "hr_scale": 2, "denoising_strength": 0.7, "seed": -1, "batch_size": 2,
        "override_settings": {"CLIP_stop_at_last_layers": 1}, "override_settings_restore_afterwards": true,
        "save_images": false, "send_images": true, "do_not_save_grid": true, "do_not_save_samples": true,
        "url": "http://127.0.0.1:7860", "auth": ""
    });
    let res = s.post_json("/sdapi/v1/txt2img", &req).await;
    assert_eq!(res.status(), 200);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["parameters"]["prompt"], PROMPT);
    let info: Value = serde_json::from_str(body["info"].as_str().unwrap()).unwrap();
    assert_eq!(info["sampler_name"], "DPM++ 2M Karras");
    assert_eq!(info["sd_model_name"], "builtin");
    assert_eq!(info["all_seeds"].as_array().unwrap().len(), 2);
    assert_eq!(info["infotexts"].as_array().unwrap().len(), 2);
    let images = body["images"].as_array().unwrap();
    assert_eq!(images.len(), 2);
    let png = unb64(images[0].as_str().unwrap());
    check_png(&png, PROMPT);

    // png-info reads the recipe back.
    let pi: Value = s
        .post_json(
            "/sdapi/v1/png-info",
            &json!({"image": format!("data:image/png;base64,{}", images[0].as_str().unwrap())}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert!(pi["info"].as_str().unwrap().starts_with(PROMPT));
    assert_eq!(pi["items"]["parameters"], pi["info"]);
    assert_eq!(pi["parameters"]["Steps"], "3");

    // img2img with a mask (Open WebUI's edit shape).
    let req = json!({"prompt": "a yellow square", "init_images": [b64(&picture_png())], "mask": b64(&mask_png()),
        "denoising_strength": 0.6, "inpainting_mask_invert": 0, "mask_blur": 4, "inpainting_fill": 1, "steps": 2, "seed": 9});
    let body: Value = s
        .post_json("/sdapi/v1/img2img", &req)
        .await
        .json()
        .await
        .unwrap();
    let png = unb64(body["images"][0].as_str().unwrap());
    check_png(&png, "a yellow square");
    assert!(s.server.gallery().count(false).unwrap() >= 3);

    // A long job: poll progress while it runs, then interrupt it.
    let long = json!({"prompt": "a blue circle", "steps": 150, "sampler_name": "DDIM", "seed": 2});
    let http = s.http.clone();
    let url = s.url("/sdapi/v1/txt2img");
    let pending = tokio::spawn(async move {
        http.post(url)
            .json(&long)
            .send()
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap()
    });
    let mut seen = Value::Null;
    until(60, async || {
        seen = s.get("/sdapi/v1/progress").await.json().await.unwrap();
        seen["state"]["sampling_step"].as_u64().unwrap_or(0) >= 2
    })
    .await;
    assert_eq!(seen["state"]["job_count"], 1);
    assert_eq!(seen["state"]["sampling_steps"], 150);
    assert!(seen["progress"].as_f64().unwrap() > 0.0 && seen["progress"].as_f64().unwrap() < 1.0);
    assert!(seen["textinfo"].as_str().unwrap().contains("/150"));
    let skipped: Value = s
        .get("/sdapi/v1/progress?skip_current_image=true")
        .await
        .json()
        .await
        .unwrap();
    assert!(skipped["current_image"].is_null());
    assert_eq!(
        s.http
            .post(s.url("/sdapi/v1/interrupt"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let body = tokio::time::timeout(Duration::from_secs(30), pending)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(body["images"], json!([]));
    let after: Value = s.get("/sdapi/v1/progress").await.json().await.unwrap();
    assert_eq!(after["state"]["interrupted"], true);
    assert_eq!(after["state"]["job_count"], 0);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a1111_bad_fields_are_named_with_a1111_names() {
    let s = start().await;
    let cases = [
        (json!({"prompt": "x", "steps": 0}), "steps"),
        (json!({"prompt": "x", "cfg_scale": 1000}), "cfg_scale"),
        (json!({"prompt": "x", "width": 100}), "width"),
        (json!({"prompt": "x", "batch_size": 50}), "batch_size"),
        (
            json!({"prompt": "x", "sampler_name": "Euler z"}),
            "sampler_name",
        ),
        (
            json!({"prompt": "x", "sampler_name": "Euler", "scheduler": "Karras"}),
            "scheduler",
        ),
        (json!({"prompt": "x", "steps": "ten"}), "steps"),
        (json!({"prompt": "x", "seed": 1.5}), "seed"),
        (
            json!({"prompt": "x", "override_settings": {"sd_model_checkpoint": "nope"}}),
            "override_settings.sd_model_checkpoint",
        ),
    ];
    for (body, field) in cases {
        let res = s.post_json("/sdapi/v1/txt2img", &body).await;
        assert_eq!(res.status(), 422, "{body}");
        let e: Value = res.json().await.unwrap();
        assert_eq!(e["error"]["field"], field, "{body}: {e}");
        assert!(e["detail"].as_str().unwrap().starts_with(field));
    }
    let res = s
        .post_json(
            "/sdapi/v1/img2img",
            &json!({"prompt": "x", "init_images": ["not base64!"]}),
        )
        .await;
    assert_eq!(
        res.json::<Value>().await.unwrap()["error"]["field"],
        "init_images[0]"
    );
    let res = s
        .post_json(
            "/sdapi/v1/img2img",
            &json!({"prompt": "x", "init_images": [b64(b"GIF89a garbage")]}),
        )
        .await;
    assert_eq!(res.status(), 422);
    let res = s.post_json("/sdapi/v1/img2img", &json!({"prompt": "x", "init_images": [b64(&picture_png())], "mask": b64(&encode(&image::DynamicImage::new_luma8(64, 64)))})).await;
    assert_eq!(res.json::<Value>().await.unwrap()["error"]["field"], "mask");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_generations_and_edits_with_a_mask() {
    let s = start().await;
    let models: Value = s.get("/v1/models").await.json().await.unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "builtin");

    let res = s.post_json("/v1/images/generations", &json!({"model": "dall-e-2", "prompt": PROMPT, "n": 2, "size": "128x128", "response_format": "b64_json"})).await;
    assert_eq!(res.status(), 200);
    let body: Value = res.json().await.unwrap();
    assert!(body["created"].as_u64().unwrap() > 0);
    assert_eq!(body["data"].as_array().unwrap().len(), 2);
    for d in body["data"].as_array().unwrap() {
        check_png(&unb64(d["b64_json"].as_str().unwrap()), PROMPT);
    }
    // JPEG and WebP copies decode (the recipe travels only in PNGs and the gallery).
    for (fmt, want) in [
        ("jpeg", image::ImageFormat::Jpeg),
        ("webp", image::ImageFormat::WebP),
    ] {
        let body: Value = s
            .post_json(
                "/v1/images/generations",
                &json!({"prompt": PROMPT, "size": "auto", "output_format": fmt, "steps": 2}),
            )
            .await
            .json()
            .await
            .unwrap();
        let bytes = unb64(body["data"][0]["b64_json"].as_str().unwrap());
        assert_eq!(image::guess_format(&bytes).unwrap(), want);
        image::load_from_memory(&bytes).unwrap();
    }
    // response_format=url: a gallery URL on this server.
    let body: Value = s
        .post_json(
            "/v1/images/generations",
            &json!({"prompt": PROMPT, "response_format": "url", "steps": 2}),
        )
        .await
        .json()
        .await
        .unwrap();
    let url = body["data"][0]["url"].as_str().unwrap();
    check_png(
        &s.http.get(url).send().await.unwrap().bytes().await.unwrap(),
        PROMPT,
    );

    // Errors in OpenAI's shape.
    for (req, param) in [
        (json!({"prompt": PROMPT, "size": "huge"}), "size"),
        (json!({"prompt": PROMPT, "size": "100x100"}), "size"),
        (json!({"prompt": PROMPT, "n": 0}), "n"),
        (json!({"prompt": PROMPT, "n": 99}), "n"),
        (
            json!({"prompt": PROMPT, "response_format": "gif"}),
            "response_format",
        ),
        (
            json!({"prompt": PROMPT, "model": "stable-diffusion-9"}),
            "model",
        ),
        (json!({"n": 1}), "prompt"),
    ] {
        let res = s.post_json("/v1/images/generations", &req).await;
        assert_eq!(res.status(), 400, "{req}");
        let e: Value = res.json().await.unwrap();
        assert_eq!(e["error"]["param"], param, "{req}: {e}");
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert!(e["error"]["message"].is_string());
    }

    // Edits: the mask's transparent pixels are repainted, the rest kept.
    let mut mask = image::RgbaImage::from_pixel(128, 128, image::Rgba([0, 0, 0, 255]));
    for y in 32..96 {
        for x in 32..96 {
            mask.put_pixel(x, y, image::Rgba([0, 0, 0, 0]));
        }
    }
    let form = reqwest::multipart::Form::new()
        .text("prompt", "a yellow square on a blue background")
        .text("n", "1")
        .text("size", "128x128")
        .text("seed", "4")
        .part(
            "image",
            reqwest::multipart::Part::bytes(picture_png())
                .file_name("image.png")
                .mime_str("image/png")
                .unwrap(),
        )
        .part(
            "mask",
            reqwest::multipart::Part::bytes(encode(&image::DynamicImage::ImageRgba8(mask)))
                .file_name("mask.png")
                .mime_str("image/png")
                .unwrap(),
        );
    let res = s
        .http
        .post(s.url("/v1/images/edits"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let body: Value = res.json().await.unwrap();
    let png = unb64(body["data"][0]["b64_json"].as_str().unwrap());
    let got = check_png(&png, "a yellow square on a blue background").to_rgb8();
    let src = image::load_from_memory(&picture_png()).unwrap().to_rgb8();
    for (x, y, p) in got.enumerate_pixels() {
        if !(24..104).contains(&x) || !(24..104).contains(&y) {
            assert_eq!(
                p,
                src.get_pixel(x, y),
                "pixel ({x}, {y}) outside the mask changed"
            );
        }
    }
    // A mask without alpha, or of another size, is refused naming it.
    let form = reqwest::multipart::Form::new()
        .text("prompt", "x")
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
        .post(s.url("/v1/images/edits"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 400);
    assert_eq!(res.json::<Value>().await.unwrap()["error"]["param"], "mask");
    s.stop().await;
}
