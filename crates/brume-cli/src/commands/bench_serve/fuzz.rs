//! Seeded random and malformed requests against the three APIs (brume's,
//! A1111's, OpenAI's) and the gallery: bad JSON, wrong types, huge numbers,
//! negative sizes, base64 garbage, decompression bombs, wrong mask sizes, path
//! traversal in every name, id and path, huge bodies, wrong methods and
//! content types, unknown routes, bytes that are not HTTP.
//!
//! Case `i` of seed `s` is a pure function of `(s, i)`, so a failure printed
//! with its number replays with the same seed whatever the thread timing.
//! Valid-by-chance requests stay cheap (64 px, 1-3 steps), so the server's
//! worker is never held long.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::http;

/// splitmix64: small, seedable, good enough to pick cases.
struct Rng(u64);

impl Rng {
    fn new(seed: u64, i: u64) -> Self {
        let mut r = Rng(seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        r.next();
        r
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len())]
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// 1..=max random bytes.
    fn some_bytes(&mut self, max: usize) -> Vec<u8> {
        let n = 1 + self.below(max);
        self.bytes(n)
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

/// Pictures the cases send, made once.
pub struct Assets {
    png64: Vec<u8>,
    png32: Vec<u8>,
    rgba64: Vec<u8>,
    /// IHDR claims 100000 x 100000; the data is tiny.
    ihdr_bomb: Vec<u8>,
    /// A real 5000 x 5000 greyscale PNG of zeros (a few tens of KiB, 25 MB of pixels).
    pixel_bomb: Vec<u8>,
    /// A 64 px PNG with a `parameters` zTXt chunk inflating to 64 MiB.
    ztxt_bomb: Vec<u8>,
    /// A valid PNG cut in half.
    truncated: Vec<u8>,
    /// What a leak would show: the canary's contents.
    canary_secret: String,
    canary_name: String,
}

fn crc32(kind: &[u8], data: &[u8]) -> u32 {
    let mut c = flate2::Crc::new();
    c.update(kind);
    c.update(data);
    c.sum()
}

fn chunk(kind: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = (data.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    out.extend_from_slice(&crc32(kind, data).to_be_bytes());
    out
}

fn encode(img: image::DynamicImage) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    let _ = img.write_to(&mut out, image::ImageFormat::Png);
    out.into_inner()
}

impl Assets {
    pub fn new(canary_dir: &Path) -> Self {
        let png64 = encode(image::DynamicImage::ImageRgb8(image::RgbImage::from_fn(
            64,
            64,
            |x, y| image::Rgb([x as u8 * 4, y as u8 * 4, 90]),
        )));
        let png32 = encode(image::DynamicImage::ImageLuma8(
            image::GrayImage::from_pixel(32, 32, image::Luma([255])),
        ));
        let rgba64 = encode(image::DynamicImage::ImageRgba8(image::RgbaImage::from_fn(
            64,
            64,
            |x, _| image::Rgba([200, 10, 10, if x < 32 { 0 } else { 255 }]),
        )));
        // IHDR rewritten to 100000 x 100000 (CRC fixed, so only the size lies).
        let mut ihdr_bomb = png32.clone();
        ihdr_bomb[16..20].copy_from_slice(&100_000u32.to_be_bytes());
        ihdr_bomb[20..24].copy_from_slice(&100_000u32.to_be_bytes());
        let crc = crc32(b"IHDR", &ihdr_bomb[16..29]);
        ihdr_bomb[29..33].copy_from_slice(&crc.to_be_bytes());
        let pixel_bomb = encode(image::DynamicImage::ImageLuma8(image::GrayImage::new(
            5000, 5000,
        )));
        // zTXt "parameters": 64 MiB of 'a' deflated to ~64 KiB.
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
        let block = vec![b'a'; 1 << 20];
        for _ in 0..64 {
            let _ = z.write_all(&block);
        }
        let zdata = z.finish().unwrap_or_default();
        let mut ztxt = b"parameters\0\0".to_vec();
        ztxt.extend_from_slice(&zdata);
        let iend = png64.len() - 12;
        let mut ztxt_bomb = png64[..iend].to_vec();
        ztxt_bomb.extend_from_slice(&chunk(b"zTXt", &ztxt));
        ztxt_bomb.extend_from_slice(&png64[iend..]);
        let truncated = png64[..png64.len() / 2].to_vec();
        // A file beside the data directory that no answer may ever contain.
        let canary_secret = format!("brume-canary-{:x}", std::process::id() as u64 * 0x9E37_79B9);
        let canary_name = "brume-fuzz-canary.txt".to_string();
        let _ = std::fs::write(canary_dir.join(&canary_name), &canary_secret);
        Assets {
            png64,
            png32,
            rgba64,
            ihdr_bomb,
            pixel_bomb,
            ztxt_bomb,
            truncated,
            canary_secret,
            canary_name,
        }
    }
}

/// One case: what it is and the bytes sent.
pub struct Case {
    pub desc: String,
    pub bytes: Vec<u8>,
    /// Not HTTP at all, or broken framing: closing without an answer is allowed.
    pub garbage: bool,
    /// Larger than the body limit: the server may answer 413 and close mid-upload.
    pub huge: bool,
}

const ROUTES: &[(&str, &str)] = &[
    ("POST", "/api/v1/jobs"),
    ("GET", "/api/v1/jobs/1"),
    ("POST", "/api/v1/jobs/1/cancel"),
    ("DELETE", "/api/v1/jobs/1"),
    ("GET", "/api/v1/jobs/1/events"),
    ("GET", "/api/v1/models"),
    ("GET", "/api/v1/samplers"),
    ("GET", "/api/v1/capabilities"),
    ("GET", "/api/v1/gallery"),
    ("GET", "/api/v1/gallery/1"),
    ("PATCH", "/api/v1/gallery/1"),
    ("GET", "/api/v1/gallery/1/image"),
    ("GET", "/api/v1/gallery/1/thumb"),
    ("POST", "/api/v1/gallery/import"),
    ("GET", "/api/v1/openapi.json"),
    ("GET", "/api/v1/ws"),
    ("POST", "/sdapi/v1/txt2img"),
    ("POST", "/sdapi/v1/img2img"),
    ("GET", "/sdapi/v1/progress"),
    ("POST", "/sdapi/v1/interrupt"),
    ("POST", "/sdapi/v1/skip"),
    ("GET", "/sdapi/v1/options"),
    ("POST", "/sdapi/v1/options"),
    ("GET", "/sdapi/v1/sd-models"),
    ("GET", "/sdapi/v1/samplers"),
    ("GET", "/sdapi/v1/schedulers"),
    ("POST", "/sdapi/v1/png-info"),
    ("POST", "/v1/images/generations"),
    ("POST", "/v1/images/edits"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/builtin"),
    ("GET", "/"),
    ("GET", "/assets/app.js"),
];

fn traversals(canary: &str) -> Vec<String> {
    let mut v: Vec<String> = [
        "../../etc/passwd",
        "..%2f..%2f..%2fetc%2fpasswd",
        "%2e%2e%2f%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "..%252f..%252fetc%252fpasswd",
        "/etc/passwd",
        "%2Fetc%2Fpasswd",
        "....//....//....//etc/passwd",
        "..\\..\\..\\etc\\passwd",
        "..%5c..%5c..%5cetc%5cpasswd",
        "a%00b",
        "%00",
        "..",
        "%2e%2e",
        ".",
        "/proc/self/environ",
        "file:///etc/passwd",
        "~/.ssh/id_rsa",
        "%c0%ae%c0%ae/%c0%ae%c0%ae/etc/passwd",
        "1;rm -rf /",
        "1%0d%0aX-Injected:%201",
        "images/../../../etc/passwd",
        "99999999999999999999999",
        "-1",
        "0x10",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push(format!("..%2f{canary}"));
    v.push(format!("../{canary}"));
    v.push(format!("../../{canary}"));
    v.push(format!("%2e%2e%2f{canary}"));
    v
}

/// The same traversals as JSON strings (decoded: real `..`, `/`, NUL).
fn traversal_strings(canary: &str) -> Vec<String> {
    vec![
        "../../etc/passwd".into(),
        "/etc/passwd".into(),
        "..\\..\\windows\\win.ini".into(),
        "a\u{0}b".into(),
        "\u{0}".into(),
        "../".repeat(20) + "etc/passwd",
        format!("../{canary}"),
        format!("../../{canary}"),
        "images/../../etc/shadow".into(),
        "%2e%2e%2f%2e%2e%2fetc%2fpasswd".into(),
        "builtin/../../../etc".into(),
        "C:\\Windows\\system.ini".into(),
        "\\\\server\\share".into(),
        "~root".into(),
    ]
}

fn b64png(p: &[u8]) -> String {
    format!("data:image/png;base64,{}", http::b64(p))
}

/// A valid, cheap request body for an endpoint (what the mutations start from).
fn template(route: &str, a: &Assets) -> Value {
    match route {
        "/api/v1/jobs" => {
            json!({"prompt": "fuzz", "unet": "unet_lcm", "steps": 1, "width": 64, "height": 64, "seed": 1, "preview_every": 0})
        }
        "/sdapi/v1/txt2img" => {
            json!({"prompt": "fuzz", "steps": 1, "width": 64, "height": 64, "sampler_name": "Euler", "seed": 1})
        }
        "/sdapi/v1/img2img" => {
            json!({"prompt": "fuzz", "steps": 1, "init_images": [http::b64(&a.png64)], "denoising_strength": 0.5, "seed": 1})
        }
        "/sdapi/v1/options" => {
            json!({"sd_model_checkpoint": "builtin", "CLIP_stop_at_last_layers": 1})
        }
        "/sdapi/v1/png-info" => json!({"image": b64png(&a.png64)}),
        "/v1/images/generations" => {
            json!({"prompt": "fuzz", "n": 1, "size": "64x64", "response_format": "b64_json", "steps": 1, "seed": 1})
        }
        "/api/v1/gallery/1" => json!({"favourite": true, "tags": ["a", "b"]}),
        _ => json!({}),
    }
}

const FIELDS: &[&str] = &[
    "prompt",
    "negative_prompt",
    "mode",
    "model",
    "unet",
    "sampler",
    "steps",
    "guidance",
    "strength",
    "seed",
    "width",
    "height",
    "batch",
    "eta",
    "clip_skip",
    "image",
    "mask",
    "extend",
    "feather",
    "priority",
    "client",
    "lane",
    "preview_every",
    "parent",
    "sampler_name",
    "sampler_index",
    "scheduler",
    "cfg_scale",
    "batch_size",
    "n_iter",
    "denoising_strength",
    "init_images",
    "inpainting_mask_invert",
    "mask_blur",
    "override_settings",
    "n",
    "size",
    "response_format",
    "output_format",
    "output_compression",
    "sd_model_checkpoint",
    "favourite",
    "tags",
    "CLIP_stop_at_last_layers",
];

fn wrong_value(r: &mut Rng) -> Value {
    match r.below(16) {
        0 => json!(null),
        1 => json!(true),
        2 => json!("a string"),
        3 => json!(""),
        4 => json!([]),
        5 => json!([1, "two", null, {"x": []}]),
        6 => json!({}),
        7 => json!({"nested": {"deeper": [1, 2, 3]}}),
        8 => json!(-1),
        9 => json!(1.5),
        10 => json!(-0.0),
        11 => json!(u64::MAX),
        12 => json!(i64::MIN),
        13 => json!(1e308),
        14 => json!("\u{0}\u{7}\u{1b}[31m\u{202e}"),
        _ => json!("x".repeat(r.below(20000))),
    }
}

fn huge_value(r: &mut Rng) -> Value {
    r.pick(&[
        json!(u64::MAX),
        json!(i64::MAX),
        json!(1e308),
        json!(4_294_967_297u64),
        json!(1_000_000_000u64),
        json!(65_536),
        json!(4097),
        json!(151),
        json!(9),
        json!(1e20),
    ])
    .clone()
}

fn negative_value(r: &mut Rng) -> Value {
    r.pick(&[
        json!(-1),
        json!(-128),
        json!(i64::MIN),
        json!(-1e308),
        json!(-0.5),
        json!(0),
    ])
    .clone()
}

fn json_req(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Vec<u8> {
    http::request_bytes(
        addr,
        method,
        path,
        &[("Content-Type", "application/json")],
        body,
    )
}

fn bad_json(r: &mut Rng, valid: &str) -> Vec<u8> {
    match r.below(12) {
        0 => valid.as_bytes()[..r.below(valid.len().max(1))].to_vec(),
        1 => {
            let mut b = valid.as_bytes().to_vec();
            let at = r.below(b.len().max(1));
            let c = r.next() as u8;
            if at < b.len() {
                b[at] = c;
            }
            b
        }
        2 => r.some_bytes(300),
        3 => format!("{}{}", "[".repeat(5000), "]".repeat(5000)).into_bytes(),
        4 => format!("{}1{}", "{\"a\":".repeat(3000), "}".repeat(3000)).into_bytes(),
        5 => br#"{"prompt": "\ud800 lone surrogate"}"#.to_vec(),
        6 => br#"{"prompt": "a", "prompt": 5, "steps": 1, "steps": "x"}"#.to_vec(),
        7 => format!("{valid} trailing garbage").into_bytes(),
        8 => Vec::new(),
        9 => r
            .pick(&[&b"null"[..], b"[]", b"42", b"\"str\"", b"true", b"{}"])
            .to_vec(),
        10 => br#"{"prompt": "a", "steps": 1e400, "width": 0x40}"#.to_vec(),
        _ => {
            // Invalid UTF-8 inside a string.
            let mut b = br#"{"prompt": ""#.to_vec();
            b.extend_from_slice(&[0xff, 0xfe, 0xc0, 0x80]);
            b.extend_from_slice(br#""}"#);
            b
        }
    }
}

fn multipart_req(addr: SocketAddr, path: &str, fields: &[(&str, Option<&str>, &[u8])]) -> Vec<u8> {
    let (ct, body) = http::multipart(fields);
    http::request_bytes(addr, "POST", path, &[("Content-Type", &ct)], &body)
}

/// Builds case `i`.
pub fn case(addr: SocketAddr, seed: u64, i: usize, a: &Assets) -> Case {
    let mut r = Rng::new(seed, i as u64);
    let c = |desc: String, bytes: Vec<u8>| Case {
        desc,
        bytes,
        garbage: false,
        huge: false,
    };
    let json_routes = [
        "/api/v1/jobs",
        "/sdapi/v1/txt2img",
        "/sdapi/v1/img2img",
        "/sdapi/v1/options",
        "/sdapi/v1/png-info",
        "/v1/images/generations",
    ];
    let family = r.below(1000);
    match family {
        // bad JSON
        0..=99 => {
            let route = *r.pick(&json_routes);
            let valid = template(route, a).to_string();
            let body = bad_json(&mut r, &valid);
            c(
                format!("bad JSON to {route}"),
                json_req(addr, "POST", route, &body),
            )
        }
        // wrong types
        100..=249 => {
            let route = *r.pick(&json_routes);
            let mut v = template(route, a);
            let field = *r.pick(FIELDS);
            let val = wrong_value(&mut r);
            v[field] = val.clone();
            if r.chance(30) {
                v = match r.below(3) {
                    0 => json!([v]),
                    1 => json!(null),
                    _ => json!({"override_settings": v}),
                };
            }
            let desc = format!("wrong type {field}={} to {route}", clip(&val.to_string()));
            c(
                desc,
                json_req(addr, "POST", route, v.to_string().as_bytes()),
            )
        }
        // huge numbers
        250..=329 => {
            let route = *r.pick(&json_routes);
            let mut v = template(route, a);
            let field = *r.pick(&[
                "steps",
                "width",
                "height",
                "seed",
                "batch",
                "n",
                "batch_size",
                "n_iter",
                "guidance",
                "cfg_scale",
                "clip_skip",
                "feather",
                "mask_blur",
                "preview_every",
                "parent",
                "output_compression",
                "denoising_strength",
                "strength",
                "eta",
                "CLIP_stop_at_last_layers",
            ]);
            let val = huge_value(&mut r);
            v[field] = val.clone();
            if field == "n" || route == "/v1/images/generations" && r.chance(30) {
                v["size"] = json!(r
                    .pick(&[
                        "99999x99999",
                        "18446744073709551616x64",
                        "4097x64",
                        "64x0",
                        "0x0",
                        "1x1"
                    ])
                    .to_string());
            }
            c(
                format!("huge {field}={val} to {route}"),
                json_req(addr, "POST", route, v.to_string().as_bytes()),
            )
        }
        // negative sizes
        330..=379 => {
            let route = *r.pick(&[
                "/api/v1/jobs",
                "/sdapi/v1/txt2img",
                "/sdapi/v1/img2img",
                "/v1/images/generations",
            ]);
            let mut v = template(route, a);
            let neg = negative_value(&mut r);
            match r.below(4) {
                0 => v["width"] = neg.clone(),
                1 => v["height"] = neg.clone(),
                2 => {
                    v["size"] = json!(r
                        .pick(&[
                            "-64x-64", "-1x64", "64x-1", "0x64", "64x", "x64", "64*64", "64x64x64"
                        ])
                        .to_string())
                }
                _ => {
                    v["mode"] = json!("outpaint");
                    v["image"] = json!(b64png(&a.png64));
                    v["extend"] = json!([neg.clone(), 0, 0, 0]);
                    v.as_object_mut().map(|o| {
                        o.remove("width");
                        o.remove("height")
                    });
                }
            }
            c(
                format!("negative size {neg} to {route}"),
                json_req(addr, "POST", route, v.to_string().as_bytes()),
            )
        }
        // base64 garbage
        380..=459 => {
            let garbage = match r.below(9) {
                0 => "@@@not base64@@@".to_string(),
                1 => http::b64(&r.some_bytes(4000)),
                2 => format!("data:image/png;base64,{}", http::b64(&a.truncated)),
                3 => format!(
                    "data:text/html;base64,{}",
                    http::b64(b"<script>alert(1)</script>")
                ),
                4 => "data:image/png;base64,".to_string(),
                5 => format!("data:image/png;base64,{}===", http::b64(&a.png64)),
                6 => "A".repeat(1 + r.below(100000)),
                7 => format!("data:image/png,{}", http::b64(&a.png64)),
                _ => String::from_utf8_lossy(&r.bytes(200)).into_owned(),
            };
            let (route, v) = match r.below(5) {
                0 => (
                    "/api/v1/jobs",
                    json!({"mode": "img2img", "prompt": "fuzz", "image": garbage, "steps": 1}),
                ),
                1 => (
                    "/api/v1/jobs",
                    json!({"mode": "inpaint", "prompt": "fuzz", "image": b64png(&a.png64), "mask": garbage, "steps": 1}),
                ),
                2 => (
                    "/sdapi/v1/img2img",
                    json!({"prompt": "fuzz", "init_images": [garbage], "steps": 1}),
                ),
                3 => (
                    "/sdapi/v1/img2img",
                    json!({"prompt": "fuzz", "init_images": [http::b64(&a.png64)], "mask": garbage, "steps": 1}),
                ),
                _ => ("/sdapi/v1/png-info", json!({"image": garbage})),
            };
            c(
                format!("base64 garbage to {route}"),
                json_req(addr, "POST", route, v.to_string().as_bytes()),
            )
        }
        // decompression bombs
        460..=499 => {
            let (name, bomb): (&str, &[u8]) = match r.below(3) {
                0 => ("IHDR 100000x100000", &a.ihdr_bomb),
                1 => ("5000x5000 pixels", &a.pixel_bomb),
                _ => ("zTXt 64 MiB", &a.ztxt_bomb),
            };
            let bytes = match r.below(6) {
                0 => json_req(addr, "POST", "/api/v1/jobs", json!({"mode": "img2img", "prompt": "fuzz", "image": b64png(bomb), "steps": 1, "preview_every": 0}).to_string().as_bytes()),
                1 => json_req(addr, "POST", "/sdapi/v1/img2img", json!({"prompt": "fuzz", "init_images": [http::b64(bomb)], "steps": 1, "width": 64, "height": 64}).to_string().as_bytes()),
                2 => json_req(addr, "POST", "/sdapi/v1/png-info", json!({"image": b64png(bomb)}).to_string().as_bytes()),
                3 => multipart_req(addr, "/v1/images/edits", &[("prompt", None, b"fuzz"), ("size", None, b"64x64"), ("image", Some("bomb.png"), bomb)]),
                4 => multipart_req(addr, "/api/v1/gallery/import", &[("file", Some("bomb.png"), bomb)]),
                _ => multipart_req(addr, "/api/v1/jobs", &[("prompt", None, b"fuzz"), ("mode", None, b"inpaint"), ("steps", None, b"1"), ("image", Some("a.png"), &a.png64), ("mask", Some("m.png"), bomb)]),
            };
            c(format!("decompression bomb ({name})"), bytes)
        }
        // wrong mask sizes
        500..=549 => {
            let bytes = match r.below(4) {
                0 => json_req(addr, "POST", "/api/v1/jobs", json!({"mode": "inpaint", "prompt": "fuzz", "image": b64png(&a.png64), "mask": b64png(&a.png32), "steps": 1}).to_string().as_bytes()),
                1 => json_req(addr, "POST", "/sdapi/v1/img2img", json!({"prompt": "fuzz", "init_images": [http::b64(&a.png64)], "mask": http::b64(&a.png32), "steps": 1}).to_string().as_bytes()),
                2 => multipart_req(addr, "/v1/images/edits", &[("prompt", None, b"fuzz"), ("image", Some("i.png"), &a.png64), ("mask", Some("m.png"), &a.png32)]),
                _ => multipart_req(addr, "/v1/images/edits", &[("prompt", None, b"fuzz"), ("image", Some("i.png"), &a.png32), ("mask", Some("m.png"), &a.rgba64)]),
            };
            c("mask of the wrong size".into(), bytes)
        }
        // path traversal
        550..=699 => {
            let t = traversals(&a.canary_name);
            let s = traversal_strings(&a.canary_name);
            match r.below(5) {
                0 | 1 => {
                    let x = r.pick(&t).clone();
                    let path = r
                        .pick(&[
                            format!("/api/v1/gallery/{x}"),
                            format!("/api/v1/gallery/{x}/image"),
                            format!("/api/v1/gallery/{x}/thumb"),
                            format!("/api/v1/gallery/{x}/image?metadata=false"),
                            format!("/api/v1/jobs/{x}"),
                            format!("/api/v1/jobs/{x}/events"),
                            format!("/assets/{x}"),
                            format!("/assets/../{x}"),
                            format!("/v1/models/{x}"),
                            format!("/{x}"),
                            format!("/api/v1/gallery?q={x}&model={x}&tag={x}&sampler={x}"),
                            format!("/api/v1/gallery?cursor={x}"),
                            format!("/api/v1/gallery?since={x}&until={x}"),
                            format!("/api/v1/ws?client={x}"),
                        ])
                        .clone();
                    let method = *r.pick(&["GET", "GET", "DELETE", "PATCH", "POST"]);
                    let body: &[u8] = if method == "PATCH" {
                        br#"{"tags": ["../../x"]}"#
                    } else {
                        b""
                    };
                    c(
                        format!("traversal {method} {path}"),
                        json_req(addr, method, &path, body),
                    )
                }
                2 => {
                    let x = r.pick(&s).clone();
                    let (route, v) = match r.below(7) {
                        0 => (
                            "/api/v1/jobs",
                            json!({"prompt": "fuzz", "model": x, "steps": 1, "width": 64, "height": 64}),
                        ),
                        1 => (
                            "/api/v1/jobs",
                            json!({"prompt": "fuzz", "unet": x, "steps": 1, "width": 64, "height": 64}),
                        ),
                        2 => (
                            "/api/v1/jobs",
                            json!({"prompt": "fuzz", "sampler": x, "client": x, "steps": 1, "width": 64, "height": 64}),
                        ),
                        3 => ("/sdapi/v1/options", json!({"sd_model_checkpoint": x})),
                        4 => (
                            "/sdapi/v1/txt2img",
                            json!({"prompt": "fuzz", "steps": 1, "width": 64, "height": 64, "override_settings": {"sd_model_checkpoint": x, "sd_vae": x}}),
                        ),
                        5 => (
                            "/v1/images/generations",
                            json!({"prompt": "fuzz", "model": x, "size": "64x64", "steps": 1}),
                        ),
                        _ => ("/api/v1/gallery/1", json!({"tags": [x]})),
                    };
                    let method = if route == "/api/v1/gallery/1" {
                        "PATCH"
                    } else {
                        "POST"
                    };
                    c(
                        format!("traversal name {} to {route}", clip(&x)),
                        json_req(addr, method, route, v.to_string().as_bytes()),
                    )
                }
                3 => {
                    let x = r.pick(&s).clone();
                    let name = format!("../{x}");
                    let bytes = match r.below(3) {
                        0 => multipart_req(
                            addr,
                            "/api/v1/gallery/import",
                            &[("file", Some(&name), &a.png64)],
                        ),
                        1 => multipart_req(
                            addr,
                            "/v1/images/edits",
                            &[
                                ("prompt", None, b"fuzz"),
                                ("size", None, b"64x64"),
                                ("image", Some(&name), &a.png64),
                                (x.as_str(), None, b"1"),
                            ],
                        ),
                        _ => multipart_req(
                            addr,
                            "/api/v1/jobs",
                            &[
                                ("prompt", None, b"fuzz"),
                                ("steps", None, b"1"),
                                ("image", Some(&name), &a.png64),
                                ("model", None, x.as_bytes()),
                            ],
                        ),
                    };
                    c(format!("traversal file name {}", clip(&name)), bytes)
                }
                _ => {
                    // Raw path bytes no URL parser would let through.
                    let x = r.pick(&[
                        "/../../etc/passwd",
                        "/api/v1/gallery/1/../../../etc/passwd",
                        "/assets/..\\..\\etc\\passwd",
                        "/api/v1/gallery/\0/image",
                        "//etc/passwd",
                        "/api/v1/../../etc/passwd",
                    ]);
                    let bytes =
                        format!("GET {x} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
                            .into_bytes();
                    Case {
                        desc: format!("raw traversal path {x:?}"),
                        bytes,
                        garbage: true,
                        huge: false,
                    }
                }
            }
        }
        // huge bodies (rare: each is 33 MiB)
        700..=702 => {
            let route = *r.pick(&[
                "/api/v1/jobs",
                "/sdapi/v1/txt2img",
                "/v1/images/edits",
                "/api/v1/gallery/import",
            ]);
            let mut body = br#"{"prompt": ""#.to_vec();
            body.resize(33 << 20, b'a');
            body.extend_from_slice(br#""}"#);
            Case {
                desc: format!("33 MiB body to {route}"),
                bytes: json_req(addr, "POST", route, &body),
                garbage: false,
                huge: true,
            }
        }
        // wrong methods
        703..=759 => {
            let (_, path) = *r.pick(ROUTES);
            let method = *r.pick(&[
                "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT", "FOO", "get", "HEAD",
                "POST", "GET",
            ]);
            let bytes = json_req(
                addr,
                method,
                path,
                if r.chance(50) {
                    br#"{"prompt":"x"}"#
                } else {
                    b""
                },
            );
            // CONNECT and odd methods may be refused at the framing level.
            Case {
                desc: format!("method {method} {path}"),
                bytes,
                garbage: method == "CONNECT",
                huge: false,
            }
        }
        // wrong content types
        760..=809 => {
            let route = *r.pick(&[
                "/api/v1/jobs",
                "/sdapi/v1/txt2img",
                "/v1/images/generations",
                "/v1/images/edits",
                "/api/v1/gallery/import",
                "/sdapi/v1/options",
            ]);
            let ct = *r.pick(&[
                "text/plain",
                "application/xml",
                "multipart/form-data",
                "multipart/form-data; boundary=",
                "multipart/form-data; boundary=zzz",
                "application/x-www-form-urlencoded",
                "",
                "application/json; charset=utf-16",
                "image/png",
                "\u{1}\u{2}",
                "application/json, text/plain",
            ]);
            let body = if r.chance(50) {
                template(route, a).to_string().into_bytes()
            } else {
                b"prompt=fuzz&steps=1".to_vec()
            };
            c(
                format!("content type {ct:?} to {route}"),
                http::request_bytes(addr, "POST", route, &[("Content-Type", ct)], &body),
            )
        }
        // unknown routes
        810..=849 => {
            let path = match r.below(6) {
                0 => format!(
                    "/{}",
                    (0..1 + r.below(6))
                        .map(|_| format!("{:x}", r.next()))
                        .collect::<Vec<_>>()
                        .join("/")
                ),
                1 => format!("/api/v1/{}", "a".repeat(r.below(20000))),
                2 => "/api/v2/jobs".into(),
                3 => "/sdapi/v1/extra-single-image".into(),
                4 => "/api/v1/jobs/%F0%9F%92%A9/%ff%fe".into(),
                _ => "/v1/chat/completions?x=%zz&&&==".into(),
            };
            c(
                format!("unknown route {}", clip(&path)),
                json_req(addr, *r.pick(&["GET", "POST"]), &path, b"{}"),
            )
        }
        // not HTTP, or broken framing
        850..=879 => {
            let bytes = match r.below(10) {
                0 => r.some_bytes(2000),
                1 => b"GET / HTTP/9.9\r\n\r\n".to_vec(),
                2 => format!("GET / HTTP/1.1\r\nHost: {addr}\r\nBroken header line\r\n\r\n").into_bytes(),
                3 => format!("GET / HTTP/1.1\r\nHost: {addr}\r\nX-Big: {}\r\n\r\n", "b".repeat(200_000)).into_bytes(),
                4 => format!("POST /api/v1/jobs HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello!!").into_bytes(),
                5 => format!("POST /api/v1/jobs HTTP/1.1\r\nHost: {addr}\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\nzz\r\nbad\r\n0\r\n\r\n").into_bytes(),
                6 => format!("POST /api/v1/jobs HTTP/1.1\r\nHost: {addr}\r\nContent-Length: -1\r\n\r\n").into_bytes(),
                7 => format!("GET http://evil.example/api/v1/models HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").into_bytes(),
                8 => b"GET /api/v1/models HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n".to_vec(),
                _ => b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03".to_vec(),
            };
            Case {
                desc: format!("not HTTP / broken framing ({} bytes)", bytes.len()),
                bytes,
                garbage: true,
                huge: false,
            }
        }
        // WebSocket without an upgrade, SSE of unknown jobs, cancels of nothing
        880..=909 => {
            let path = *r.pick(&[
                "/api/v1/ws",
                "/api/v1/ws?client=",
                "/api/v1/jobs/999999/events",
                "/api/v1/jobs/0/cancel",
                "/sdapi/v1/progress?skip_current_image=maybe",
                "/api/v1/gallery?limit=0",
                "/api/v1/gallery?limit=100000",
                "/api/v1/gallery?favourite=perhaps",
                "/api/v1/gallery?seed=-5",
            ]);
            let method = if path.contains("cancel") {
                "POST"
            } else {
                "GET"
            };
            c(
                format!("{method} {path}"),
                json_req(addr, method, path, b""),
            )
        }
        // valid by chance: plausible values, cheap jobs
        _ => {
            let route = *r.pick(&[
                "/api/v1/jobs",
                "/sdapi/v1/txt2img",
                "/v1/images/generations",
                "/sdapi/v1/img2img",
            ]);
            let mut v = template(route, a);
            for _ in 0..1 + r.below(2) {
                let (k, val) = match r.below(12) {
                    0 => (
                        "sampler",
                        json!(r
                            .pick(&[
                                "euler",
                                "ddim",
                                "dpmpp_2m_karras",
                                "lcm",
                                "Euler a",
                                "DPM++ 2M Karras",
                                "nonsense"
                            ])
                            .to_string()),
                    ),
                    1 => ("steps", json!(1 + r.below(3))),
                    2 => ("guidance", json!((r.below(120) as f64 - 20.0) / 2.0)),
                    3 => ("batch", json!(1 + r.below(3))),
                    4 => ("eta", json!(r.below(30) as f64 / 10.0)),
                    5 => ("clip_skip", json!(r.below(20))),
                    6 => ("seed", json!(r.next())),
                    7 => (
                        "negative_prompt",
                        json!(String::from_utf8_lossy(&r.bytes(40))),
                    ),
                    8 => ("prompt", json!("🎨 ".repeat(r.below(3000)))),
                    9 => ("strength", json!(r.below(15) as f64 / 10.0)),
                    10 => ("cfg_scale", json!(r.below(60))),
                    _ => (
                        "priority",
                        json!(r.pick(&["interactive", "batch", "urgent"]).to_string()),
                    ),
                };
                v[k] = val;
            }
            c(
                format!("plausible {route}: {}", clip(&v.to_string())),
                json_req(addr, "POST", route, v.to_string().as_bytes()),
            )
        }
    }
}

fn clip(s: &str) -> String {
    let t: String = s.chars().take(80).collect();
    if t.len() < s.len() {
        format!("{t}…")
    } else {
        t
    }
}

/// What the fuzz run saw.
pub struct Report {
    pub n: usize,
    pub seed: u64,
    pub wall: f64,
    pub by_status: BTreeMap<u16, usize>,
    pub closed_garbage: usize,
    pub refused_upload: usize,
    pub five: Vec<String>,
    pub no_answer: Vec<String>,
    pub leaks: Vec<String>,
    pub liveness_failures: usize,
    pub liveness_checks: usize,
    pub good_after: Result<String, String>,
    pub escaped_files: Vec<PathBuf>,
}

impl Report {
    fn new(n: usize, seed: u64) -> Self {
        Report {
            n,
            seed,
            wall: 0.0,
            by_status: BTreeMap::new(),
            closed_garbage: 0,
            refused_upload: 0,
            five: Vec::new(),
            no_answer: Vec::new(),
            leaks: Vec::new(),
            liveness_failures: 0,
            liveness_checks: 0,
            good_after: Ok(String::new()),
            escaped_files: Vec::new(),
        }
    }

    pub fn print(&self) {
        println!();
        println!(
            "fuzz: {} requests, seed {}, {:.1} s ({:.0} req/s)",
            self.n,
            self.seed,
            self.wall,
            self.n as f64 / self.wall
        );
        println!(
            "status counts: {}",
            self.by_status
                .iter()
                .map(|(s, n)| format!("{s}: {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        println!(
            "closed without an answer (not HTTP / broken framing, allowed): {}",
            self.closed_garbage
        );
        println!(
            "huge bodies refused mid-upload (allowed): {}",
            self.refused_upload
        );
        println!(
            "5xx: {}; no answer: {}; leaks of files outside the data dir: {}",
            self.five.len(),
            self.no_answer.len(),
            self.leaks.len()
        );
        println!(
            "liveness checks during the run: {} of {} failed",
            self.liveness_failures, self.liveness_checks
        );
        println!(
            "files written outside the data dir: {}",
            self.escaped_files.len()
        );
        match &self.good_after {
            Ok(s) => println!("good requests after the fuzz: {s}"),
            Err(e) => println!("good requests after the fuzz FAILED: {e}"),
        }
        for f in self
            .five
            .iter()
            .chain(&self.no_answer)
            .chain(&self.leaks)
            .take(20)
        {
            println!("  {f}");
        }
    }

    pub fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        if !self.five.is_empty() {
            f.push(format!(
                "{} 5xx answers (first: {})",
                self.five.len(),
                self.five[0]
            ));
        }
        if !self.no_answer.is_empty() {
            f.push(format!(
                "{} requests got no answer (first: {})",
                self.no_answer.len(),
                self.no_answer[0]
            ));
        }
        if !self.leaks.is_empty() {
            f.push(format!(
                "{} answers carried a file from outside the data dir (first: {})",
                self.leaks.len(),
                self.leaks[0]
            ));
        }
        if self.liveness_failures > 0 {
            f.push(format!(
                "{} liveness checks failed during the fuzz",
                self.liveness_failures
            ));
        }
        if !self.escaped_files.is_empty() {
            f.push(format!(
                "files written outside the data dir: {:?}",
                self.escaped_files
            ));
        }
        if let Err(e) = &self.good_after {
            f.push(format!(
                "the server did not serve good requests after the fuzz: {e}"
            ));
        }
        f
    }
}

fn listing(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Runs `n` cases from `clients` threads against `addr`, whose data dir is
/// `data_dir` (alone in a folder of this run's own: the canary goes beside it).
pub fn run(addr: SocketAddr, n: usize, seed: u64, clients: usize, data_dir: &Path) -> Report {
    let outside = data_dir
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(std::env::temp_dir);
    let assets = Arc::new(Assets::new(&outside));
    let before = listing(&outside);
    let next = Arc::new(AtomicUsize::new(0));
    let report = Arc::new(Mutex::new(Report::new(n, seed)));
    let t = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            let (assets, next, report) = (assets.clone(), next.clone(), report.clone());
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= n {
                    return;
                }
                let case = case(addr, seed, i, &assets);
                let res = http::raw(addr, &case.bytes, Duration::from_secs(120));
                let Ok(mut rep) = report.lock() else { return };
                match res {
                    Ok(resp) => {
                        *rep.by_status.entry(resp.status).or_default() += 1;
                        if resp.status >= 500 {
                            rep.five.push(format!(
                                "case {i} (seed {seed}): {} -> {} {}",
                                case.desc,
                                resp.status,
                                clip(&resp.text())
                            ));
                        }
                        let body = String::from_utf8_lossy(&resp.body);
                        if body.contains("root:x:0:0") || body.contains(&assets.canary_secret) {
                            rep.leaks.push(format!(
                                "case {i} (seed {seed}): {} -> {}",
                                case.desc,
                                clip(&body)
                            ));
                        }
                    }
                    Err(e) if case.huge => {
                        let _ = e;
                        rep.refused_upload += 1;
                    }
                    Err(e)
                        if case.garbage
                            && e.kind() != std::io::ErrorKind::WouldBlock
                            && e.kind() != std::io::ErrorKind::TimedOut =>
                    {
                        let _ = e;
                        rep.closed_garbage += 1;
                    }
                    Err(e) => rep
                        .no_answer
                        .push(format!("case {i} (seed {seed}): {} -> {e}", case.desc)),
                }
                drop(rep);
                if i % 250 == 249 {
                    let ok = http::get(addr, "/api/v1/capabilities")
                        .map(|r| r.status == 200)
                        .unwrap_or(false);
                    if let Ok(mut rep) = report.lock() {
                        rep.liveness_checks += 1;
                        rep.liveness_failures += (!ok) as usize;
                    }
                }
            })
        })
        .collect();
    for th in threads {
        let _ = th.join();
    }
    let wall = t.elapsed().as_secs_f64();
    let good = good_requests(addr);
    let after = listing(&outside);
    let mut rep = std::mem::replace(
        &mut *report.lock().unwrap_or_else(|e| e.into_inner()),
        Report::new(n, seed),
    );
    rep.wall = wall;
    rep.good_after = good;
    // The data dir's parent is this run's own folder: anything new there but
    // the data dir itself came through the server.
    rep.escaped_files = after
        .into_iter()
        .filter(|p| !before.contains(p) && p.as_path() != data_dir)
        .collect();
    let _ = std::fs::remove_file(outside.join(&assets.canary_name));
    rep
}

/// After the fuzz: a native job runs to done and an A1111 txt2img answers with a picture.
fn good_requests(addr: SocketAddr) -> Result<String, String> {
    let t = Instant::now();
    let r = http::post_json(addr, "/api/v1/jobs", &json!({"prompt": "after the fuzz", "unet": "unet_lcm", "steps": 1, "width": 64, "height": 64, "preview_every": 0}))
        .map_err(|e| e.to_string())?;
    let id = match (r.status, r.json()) {
        (202, Some(v)) => v["id"].as_str().unwrap_or_default().to_string(),
        (s, _) => return Err(format!("native job: {s} {}", r.text())),
    };
    let v = http::wait_job(addr, &id, Duration::from_secs(300)).map_err(|e| e.to_string())?;
    if v["state"] != "done" {
        return Err(format!("native job ended {v}"));
    }
    let r = http::post_json(
        addr,
        "/sdapi/v1/txt2img",
        &json!({"prompt": "after the fuzz", "steps": 1, "width": 64, "height": 64}),
    )
    .map_err(|e| e.to_string())?;
    let ok = r.status == 200
        && r.json()
            .and_then(|v| v["images"][0].as_str().and_then(http::unb64))
            .is_some_and(|p| image::load_from_memory(&p).is_ok());
    if !ok {
        return Err(format!("A1111 txt2img: {} {}", r.status, clip(&r.text())));
    }
    Ok(format!(
        "native job done and A1111 txt2img answered a picture ({:.1} s)",
        t.elapsed().as_secs_f64()
    ))
}
