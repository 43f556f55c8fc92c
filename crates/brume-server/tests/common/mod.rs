//! A server on 127.0.0.1:0 with the built-in model's folder and a fresh data
//! directory, and a client for it.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use brume_runtime::{ModelEntry, ModelSource};
use brume_server::{Server, ServerConfig};

pub const PROMPT: &str = "a red circle on a blue background";

pub fn builtin() -> ModelEntry {
    let path = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/builtin"));
    ModelEntry {
        name: "builtin".into(),
        source: ModelSource::Path {
            path,
            config_dir: None,
            variant: None,
        },
    }
}

pub struct TestServer {
    pub server: Server,
    pub base: String,
    pub http: reqwest::Client,
    pub dir: tempfile::TempDir,
}

impl TestServer {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.http.get(self.url(path)).send().await.expect("request")
    }

    pub async fn post_json(&self, path: &str, body: &serde_json::Value) -> reqwest::Response {
        self.http
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .expect("request")
    }

    pub async fn stop(self) {
        self.server.shutdown().await;
    }
}

pub async fn start_with(f: impl FnOnce(&mut ServerConfig)) -> TestServer {
    let dir = tempfile::tempdir().unwrap();
    let mut config = ServerConfig::new(vec![builtin()], dir.path().join("data"));
    config.listen = "127.0.0.1:0".parse().unwrap();
    f(&mut config);
    let server = brume_server::serve(config)
        .await
        .expect("the server starts");
    let base = format!("http://{}", server.addr());
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    TestServer {
        server,
        base,
        http,
        dir,
    }
}

pub async fn start() -> TestServer {
    start_with(|_| {}).await
}

/// A PNG's text chunks.
pub fn png_text(png: &[u8]) -> Vec<(String, String)> {
    let chunks = brume_gallery::pngmeta::chunks(png, "test").expect("a PNG");
    brume_gallery::pngmeta::text_chunks(&chunks, "test").expect("text chunks")
}

/// Decodes a PNG and checks it carries brume's recipe for `prompt`.
pub fn check_png(png: &[u8], prompt: &str) -> image::DynamicImage {
    let img = image::load_from_memory_with_format(png, image::ImageFormat::Png)
        .expect("a PNG that decodes");
    let text = png_text(png);
    let params = text
        .iter()
        .find(|(k, _)| k == "parameters")
        .map(|(_, v)| v.clone())
        .expect("a parameters chunk");
    assert!(params.starts_with(prompt), "parameters text: {params}");
    let recipe = text
        .iter()
        .find(|(k, _)| k == "brume-recipe")
        .map(|(_, v)| v.clone())
        .expect("a brume-recipe chunk");
    let r: serde_json::Value = serde_json::from_str(&recipe).unwrap();
    assert_eq!(r["prompt"], prompt);
    img
}

pub fn b64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

pub fn unb64(s: &str) -> Vec<u8> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .expect("base64")
}

/// A 128 x 128 picture: a red disc on blue, as PNG.
pub fn picture_png() -> Vec<u8> {
    let img = image::RgbImage::from_fn(128, 128, |x, y| {
        if (x as i32 - 64).pow(2) + (y as i32 - 64).pow(2) < 900 {
            image::Rgb([220, 30, 30])
        } else {
            image::Rgb([20, 40, 200])
        }
    });
    encode(&image::DynamicImage::ImageRgb8(img))
}

pub fn encode(img: &image::DynamicImage) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// A white square (repaint) in the middle of black, 128 x 128.
pub fn mask_png() -> Vec<u8> {
    let m = image::GrayImage::from_fn(128, 128, |x, y| {
        image::Luma([if (32..96).contains(&x) && (32..96).contains(&y) {
            255
        } else {
            0
        }])
    });
    encode(&image::DynamicImage::ImageLuma8(m))
}

/// Polls until `f` is true (at most `secs`).
pub async fn until(secs: u64, mut f: impl AsyncFnMut() -> bool) {
    let end = std::time::Instant::now() + Duration::from_secs(secs);
    while std::time::Instant::now() < end {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("condition not met within {secs} s");
}
