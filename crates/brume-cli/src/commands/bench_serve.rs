//! `brume bench serve`: the service's bars, measured against a real `brume
//! serve` child process (this executable, the built-in model, a temporary
//! data directory).
//!
//! - Load: N concurrent clients send mixed requests (native txt2img and
//!   img2img, A1111 txt2img, OpenAI generations, a job cancelled half-way,
//!   malformed requests). Every request must be answered (success, 4xx, or 429
//!   with Retry-After, after which the client waits and retries), no 5xx, no
//!   panic in the child's stderr, every success in the gallery exactly once and
//!   nothing else, and the child's RSS at the end within 10 % of after warm-up.
//! - Latency: built-in-model txt2img over HTTP vs the same job through the
//!   library (`brume_runtime` in this process), alternated, medians; a repeated
//!   prompt must skip the text encoder (the job's timings say so).
//! - Fuzz (`--fuzz N`): seeded random and malformed requests against the three
//!   APIs; no 5xx, no panic, nothing read from outside the data directory, and
//!   the server still answers a good request after.
//!
//! Exits non-zero when a check fails, so tests run it at small sizes.

pub mod fuzz;
pub mod http;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};

use http::ServeChild;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Requests in the load run (0: no load run).
    #[arg(long, default_value_t = 500)]
    requests: usize,
    /// Concurrent clients in the load run.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Warm-up requests before the RSS baseline (default: twice the clients, at least 20).
    /// The runtime keeps the last 512 finished jobs' states and 64 results, so a
    /// warm-up past 512 measures growth beyond those bounded windows.
    #[arg(long)]
    warmup: Option<usize>,
    /// Steps of the generating requests in the load run (cancelled jobs run 12x as many).
    #[arg(long, default_value_t = 2)]
    steps: usize,
    /// Picture side in pixels.
    #[arg(long, default_value_t = 128)]
    size: usize,
    /// The server's --queue-limit (small values exercise 429 + Retry-After).
    #[arg(long, default_value_t = 8)]
    queue_limit: usize,
    /// Jobs per side in the latency comparison, HTTP vs library (0: none).
    #[arg(long, default_value_t = 20)]
    latency_runs: usize,
    /// Steps of the latency job (default: the model's own default).
    #[arg(long)]
    latency_steps: Option<usize>,
    /// Report the latency bar without failing on it (CI machines are shared).
    #[arg(long)]
    latency_report_only: bool,
    /// Run N seeded fuzz requests instead of the load and latency runs.
    #[arg(long, value_name = "N")]
    fuzz: Option<usize>,
    /// Fuzz seed (a failure names its case; the same seed replays it).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Fuzz clients in parallel.
    #[arg(long, default_value_t = 4)]
    fuzz_clients: usize,
    /// Keep the temporary data directory (its path is printed).
    #[arg(long)]
    keep: bool,
}

/// A temporary folder of this run's own, removed on drop (unless kept); the
/// server's data directory is `data` inside it (the server creates it, 0700),
/// so anything else appearing in the folder came through the server.
struct TempDir {
    root: PathBuf,
    path: PathBuf,
    keep: bool,
}

impl TempDir {
    fn new(tag: &str, keep: bool) -> anyhow::Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let root =
            std::env::temp_dir().join(format!("brume-bench-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir(&root).with_context(|| format!("creating {}", root.display()))?;
        Ok(Self {
            path: root.join("data"),
            root,
            keep,
        })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if self.keep {
            eprintln!("kept the data directory {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    if a.clients == 0 || a.size == 0 || a.steps == 0 || a.fuzz_clients == 0 {
        bail!("--clients, --size, --steps and --fuzz-clients must be at least 1");
    }
    let exe = std::env::current_exe().context("finding this executable")?;
    let dir = TempDir::new("serve", a.keep)?;
    let cpu = http::cpu_model();
    let queue_limit = a.queue_limit.max(1).to_string();
    let mut server_args = vec!["--queue-limit", queue_limit.as_str()];
    if a.fuzz.is_some() {
        // A fuzzed request that happens to be valid never holds the worker long.
        server_args.extend(["--max-job-seconds", "30"]);
    }
    let t = Instant::now();
    let mut child =
        ServeChild::start(&exe, &dir.path, &server_args, &[]).context("starting brume serve")?;
    println!(
        "brume serve pid {} on http://{} (started in {:.1} s), data dir {}",
        child.pid(),
        child.addr,
        t.elapsed().as_secs_f64(),
        dir.path.display()
    );
    println!(
        "CPU: {cpu} ({} threads)",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    let mut failures: Vec<String> = Vec::new();

    if let Some(n) = a.fuzz {
        let report = fuzz::run(child.addr, n, a.seed, a.fuzz_clients, &dir.path);
        report.print();
        failures.extend(report.failures());
    } else {
        if a.requests > 0 {
            failures.extend(load(&a, &child)?);
        }
        if a.latency_runs > 0 {
            failures.extend(latency(&a, &child)?);
        }
    }

    let panics = child
        .stderr()
        .lines()
        .filter(|l| l.contains("panicked"))
        .map(str::to_string)
        .collect::<Vec<_>>();
    println!("panics in the server's stderr: {}", panics.len());
    if !panics.is_empty() {
        failures.push(format!(
            "the server panicked {} time(s): {}",
            panics.len(),
            panics[0]
        ));
    }
    let clean = child.stop();
    if !clean {
        failures.push("the server did not stop cleanly on SIGTERM within 20 s".into());
    }
    if failures.is_empty() {
        println!("RESULT: PASS");
        Ok(())
    } else {
        println!("RESULT: FAIL");
        for f in &failures {
            println!("  - {f}");
        }
        let tail: String = child
            .stderr()
            .lines()
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        eprintln!("last lines of the server's stderr:\n{tail}");
        bail!("{} check(s) failed", failures.len())
    }
}

// ---------------------------------------------------------------- load

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Kind {
    Native,
    A1111,
    OpenAi,
    Img2img,
    Cancel,
    Malformed,
}

impl Kind {
    const ALL: [Kind; 6] = [
        Kind::Native,
        Kind::A1111,
        Kind::OpenAi,
        Kind::Img2img,
        Kind::Cancel,
        Kind::Malformed,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::Native => "native txt2img",
            Kind::A1111 => "A1111 txt2img",
            Kind::OpenAi => "OpenAI generations",
            Kind::Img2img => "native img2img",
            Kind::Cancel => "cancel half-way",
            Kind::Malformed => "malformed",
        }
    }

    /// The mix: a fixed rotation of 20 slots.
    fn of(i: usize) -> Kind {
        match i % 20 {
            0 | 5 | 10 | 15 | 18 => Kind::Native,
            1 | 11 | 16 => Kind::A1111,
            6 | 13 => Kind::OpenAi,
            2 | 7 | 12 | 17 => Kind::Img2img,
            3 | 14 => Kind::Cancel,
            _ => Kind::Malformed,
        }
    }
}

/// What one request came to.
#[derive(Debug, Clone)]
struct Outcome {
    kind: Kind,
    prompt: String,
    /// The first request's final status (after 429 retries).
    status: u16,
    /// 429 answers retried.
    retries: u32,
    latency: f64,
    /// Finished with pictures (they must be in the gallery).
    success: bool,
    images: usize,
    gallery_ids: Vec<i64>,
    /// The native job's end state (done, failed, cancelled).
    state: Option<String>,
    /// Statuses of every HTTP exchange this request made (polls, cancels).
    all_statuses: Vec<u16>,
    problem: Option<String>,
}

struct Ctx {
    addr: SocketAddr,
    size: usize,
    steps: usize,
    image_b64: String,
    small_mask_b64: String,
}

const TIMEOUT: Duration = Duration::from_secs(300);

/// Sends until the answer is not 429; each 429 must carry Retry-After, which is
/// waited (at most 10 s).
fn with_retry(
    o: &mut Outcome,
    mut send: impl FnMut() -> std::io::Result<http::Response>,
) -> Option<http::Response> {
    loop {
        match send() {
            Ok(r) if r.status == 429 => {
                o.all_statuses.push(429);
                o.retries += 1;
                let secs = match r
                    .header("retry-after")
                    .and_then(|v| v.trim().parse::<u64>().ok())
                {
                    Some(s) => s,
                    None => {
                        o.problem = Some(format!(
                            "429 without a usable Retry-After: {:?}",
                            r.header("retry-after")
                        ));
                        return Some(r);
                    }
                };
                if o.retries > 200 {
                    o.problem = Some("still 429 after 200 retries".into());
                    return Some(r);
                }
                std::thread::sleep(Duration::from_secs(secs.min(10)));
            }
            Ok(r) => {
                o.all_statuses.push(r.status);
                return Some(r);
            }
            Err(e) => {
                o.problem = Some(format!("no answer: {e}"));
                return None;
            }
        }
    }
}

fn png_b64_ok(b64: &str) -> Result<(), String> {
    let b = b64.split_once(',').map(|(_, d)| d).unwrap_or(b64);
    let png = http::unb64(b).ok_or("image is not base64")?;
    let img = image::load_from_memory(&png).map_err(|e| format!("image does not decode: {e}"))?;
    if img.width() == 0 {
        return Err("empty image".into());
    }
    let texts = http::png_texts(&png).ok_or("not a PNG")?;
    if !texts
        .iter()
        .any(|(k, v)| (k == "parameters" || k == "brume-recipe") && !v.is_empty())
    {
        return Err(format!(
            "PNG has no recipe (text chunks: {:?})",
            texts.iter().map(|(k, _)| k).collect::<Vec<_>>()
        ));
    }
    Ok(())
}

/// Follows a native job to its end over Server-Sent Events (with a poll as the
/// fallback), calling `on_step` on each step event.
fn follow_job(
    ctx: &Ctx,
    o: &mut Outcome,
    id: &str,
    mut on_step: impl FnMut(u64, u64),
) -> Option<Value> {
    let mut last: Option<Value> = None;
    let res = http::sse(
        ctx.addr,
        &format!("/api/v1/jobs/{id}/events"),
        TIMEOUT,
        |ev| {
            match ev["type"].as_str() {
                Some("step") => on_step(
                    ev["step"].as_u64().unwrap_or(0),
                    ev["total"].as_u64().unwrap_or(0),
                ),
                Some("done" | "failed" | "cancelled") => {
                    last = Some(ev.clone());
                    return false;
                }
                _ => {}
            }
            true
        },
    );
    match res {
        Ok(r) => o.all_statuses.push(r.status),
        Err(e) => o.problem = Some(format!("event stream of job {id}: {e}")),
    }
    // The job's own view is the record (and checks the stream's ending).
    match http::wait_job(ctx.addr, id, TIMEOUT) {
        Ok(v) => {
            o.all_statuses.push(200);
            Some(v)
        }
        Err(e) => {
            o.problem = Some(format!("job {id}: {e} (last event {last:?})"));
            None
        }
    }
}

fn native_job(ctx: &Ctx, o: &mut Outcome, body: Value, cancel_half_way: bool) {
    let Some(r) = with_retry(o, || http::post_json(ctx.addr, "/api/v1/jobs", &body)) else {
        return;
    };
    o.status = r.status;
    if r.status != 202 {
        if r.status < 500 && r.status != 429 {
            o.problem = o.problem.take().or(Some(format!(
                "expected 202, got {}: {}",
                r.status,
                r.text()
            )));
        }
        return;
    }
    let Some(id) = r.json().and_then(|v| v["id"].as_str().map(str::to_string)) else {
        o.problem = Some(format!("202 without an id: {}", r.text()));
        return;
    };
    let addr = ctx.addr;
    let mut cancel_status: Option<u16> = None;
    let view = follow_job(ctx, o, &id, |step, total| {
        if cancel_half_way && cancel_status.is_none() && total > 0 && step * 2 >= total {
            cancel_status = Some(
                http::request(
                    addr,
                    "POST",
                    &format!("/api/v1/jobs/{id}/cancel"),
                    &[],
                    &[],
                    TIMEOUT,
                )
                .map(|r| r.status)
                .unwrap_or(0),
            );
        }
    });
    if let Some(s) = cancel_status {
        o.all_statuses.push(s);
        if s != 200 {
            o.problem = Some(format!("cancel answered {s}"));
        }
    }
    let Some(v) = view else { return };
    let state = v["state"].as_str().unwrap_or("?").to_string();
    match state.as_str() {
        "done" => {
            let images = v["result"]["images"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            o.images = images.len();
            o.gallery_ids = images
                .iter()
                .filter_map(|i| i["gallery_id"].as_i64())
                .collect();
            if o.gallery_ids.len() != images.len() {
                o.problem = Some(format!("a picture without a gallery id: {v}"));
            }
            // One picture fetched back per job: it decodes and carries its recipe.
            if let Some(g) = o.gallery_ids.first() {
                match http::get(ctx.addr, &format!("/api/v1/gallery/{g}/image")) {
                    Ok(r) if r.status == 200 => {
                        o.all_statuses.push(200);
                        if let Err(e) = png_b64_ok(&http::b64(&r.body)) {
                            o.problem = Some(format!("gallery image {g}: {e}"));
                        }
                    }
                    Ok(r) => {
                        o.all_statuses.push(r.status);
                        o.problem = Some(format!("gallery image {g}: {}", r.status));
                    }
                    Err(e) => o.problem = Some(format!("gallery image {g}: {e}")),
                }
            }
            o.success = true;
        }
        "cancelled" if cancel_half_way => {}
        _ => o.problem = Some(format!("job ended {state}: {v}")),
    }
    o.state = Some(state);
}

fn sync_job(
    ctx: &Ctx,
    o: &mut Outcome,
    path: &str,
    body: Value,
    images_at: &dyn Fn(&Value) -> Vec<String>,
) {
    let Some(r) = with_retry(o, || http::post_json(ctx.addr, path, &body)) else {
        return;
    };
    o.status = r.status;
    if r.status != 200 {
        if o.problem.is_none() {
            o.problem = Some(format!("expected 200, got {}: {}", r.status, r.text()));
        }
        return;
    }
    let Some(v) = r.json() else {
        o.problem = Some("200 without JSON".into());
        return;
    };
    let imgs = images_at(&v);
    if imgs.is_empty() {
        o.problem = Some(format!(
            "no pictures: {}",
            r.text().chars().take(300).collect::<String>()
        ));
        return;
    }
    for b in &imgs {
        if let Err(e) = png_b64_ok(b) {
            o.problem = Some(e);
            return;
        }
    }
    o.images = imgs.len();
    o.success = true;
}

/// The malformed requests of the mix (each must get a 4xx).
fn malformed(ctx: &Ctx, o: &mut Outcome, i: usize) {
    let p = o.prompt.clone();
    let a = ctx.addr;
    let json_h = [("Content-Type", "application/json")];
    let (what, res) = match (i / 20) % 12 {
        0 => (
            "bad JSON",
            http::request(
                a,
                "POST",
                "/api/v1/jobs",
                &json_h,
                format!("{{\"prompt\": \"{p}\", \"steps\": ").as_bytes(),
                TIMEOUT,
            ),
        ),
        1 => (
            "wrong type",
            http::post_json(a, "/api/v1/jobs", &json!({"prompt": p, "steps": "ten"})),
        ),
        2 => (
            "negative size",
            http::post_json(
                a,
                "/api/v1/jobs",
                &json!({"prompt": p, "width": -128, "height": 128}),
            ),
        ),
        3 => (
            "huge steps",
            http::post_json(
                a,
                "/api/v1/jobs",
                &json!({"prompt": p, "steps": 1_000_000_000u64}),
            ),
        ),
        4 => (
            "base64 garbage",
            http::post_json(
                a,
                "/api/v1/jobs",
                &json!({"mode": "img2img", "prompt": p, "image": "data:image/png;base64,@@not*base64@@"}),
            ),
        ),
        5 => (
            "A1111 wrong type",
            http::post_json(
                a,
                "/sdapi/v1/txt2img",
                &json!({"prompt": p, "steps": "many", "width": ctx.size}),
            ),
        ),
        6 => (
            "OpenAI bad size",
            http::post_json(
                a,
                "/v1/images/generations",
                &json!({"prompt": p, "size": "hugexhuge"}),
            ),
        ),
        7 => (
            "unknown route",
            http::request(a, "GET", "/api/v1/no-such-thing", &[], &[], TIMEOUT),
        ),
        8 => (
            "wrong method",
            http::request(
                a,
                "PUT",
                "/api/v1/jobs",
                &json_h,
                br#"{"prompt":"x"}"#,
                TIMEOUT,
            ),
        ),
        9 => (
            "wrong content type",
            http::request(
                a,
                "POST",
                "/api/v1/jobs",
                &[("Content-Type", "text/plain")],
                format!("prompt={p}").as_bytes(),
                TIMEOUT,
            ),
        ),
        10 => (
            "A1111 img2img without a picture",
            http::post_json(a, "/sdapi/v1/img2img", &json!({"prompt": p, "steps": 2})),
        ),
        _ => (
            "mask of the wrong size",
            http::post_json(
                a,
                "/api/v1/jobs",
                &json!({"mode": "inpaint", "prompt": p, "image": ctx.image_b64, "mask": ctx.small_mask_b64, "steps": 2}),
            ),
        ),
    };
    match res {
        Ok(r) => {
            o.all_statuses.push(r.status);
            o.status = r.status;
            if r.status == 202 {
                // Accepted, then refused by the worker: it must fail, never run.
                let id = r
                    .json()
                    .and_then(|v| v["id"].as_str().map(str::to_string))
                    .unwrap_or_default();
                match http::wait_job(a, &id, TIMEOUT) {
                    Ok(v) if v["state"] == "failed" => o.state = Some("failed".into()),
                    Ok(v) => o.problem = Some(format!("{what}: accepted and ended {}", v["state"])),
                    Err(e) => o.problem = Some(format!("{what}: {e}")),
                }
            } else if !(400..500).contains(&r.status) {
                o.problem = Some(format!(
                    "{what}: expected a 4xx, got {}: {}",
                    r.status,
                    r.text()
                ));
            } else if r.json().is_none() && r.status != 405 {
                o.problem = Some(format!(
                    "{what}: {} without a JSON error body: {}",
                    r.status,
                    r.text()
                ));
            }
        }
        Err(e) => o.problem = Some(format!("{what}: no answer: {e}")),
    }
}

fn one(ctx: &Ctx, i: usize, kind: Kind, tag: &str) -> Outcome {
    let prompt = format!(
        "{tag} {i} {} a red circle on a blue background",
        kind.name().replace(' ', "-")
    );
    let mut o = Outcome {
        kind,
        prompt: prompt.clone(),
        status: 0,
        retries: 0,
        latency: 0.0,
        success: false,
        images: 0,
        gallery_ids: Vec::new(),
        state: None,
        all_statuses: Vec::new(),
        problem: None,
    };
    let (s, steps, seed) = (ctx.size, ctx.steps, i as u64);
    let t = Instant::now();
    match kind {
        Kind::Native => native_job(
            ctx,
            &mut o,
            json!({"prompt": prompt, "unet": "unet_lcm", "steps": steps, "width": s, "height": s, "seed": seed, "preview_every": 0}),
            false,
        ),
        Kind::Img2img => native_job(
            ctx,
            &mut o,
            json!({"mode": "img2img", "prompt": prompt, "image": ctx.image_b64, "strength": 0.5, "steps": steps * 2, "seed": seed, "preview_every": 0}),
            false,
        ),
        Kind::Cancel => native_job(
            ctx,
            &mut o,
            json!({"prompt": prompt, "steps": steps * 12, "width": s, "height": s, "seed": seed, "preview_every": 0}),
            true,
        ),
        Kind::A1111 => sync_job(
            ctx,
            &mut o,
            "/sdapi/v1/txt2img",
            json!({"prompt": prompt, "negative_prompt": "", "steps": steps, "width": s, "height": s, "seed": seed, "cfg_scale": 3.5,
                   "sampler_name": "Euler a", "batch_size": 1, "n_iter": 1, "restore_faces": false, "send_images": true, "save_images": false}),
            &|v| {
                v["images"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|x| x.as_str().map(str::to_string))
                            .collect()
                    })
                    .unwrap_or_default()
            },
        ),
        Kind::OpenAi => sync_job(
            ctx,
            &mut o,
            "/v1/images/generations",
            json!({"prompt": prompt, "n": 1 + (i / 20) % 2, "size": format!("{s}x{s}"), "response_format": "b64_json", "steps": steps, "seed": seed}),
            &|v| {
                v["data"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|x| x["b64_json"].as_str().map(str::to_string))
                            .collect()
                    })
                    .unwrap_or_default()
            },
        ),
        Kind::Malformed => malformed(ctx, &mut o, i),
    }
    o.latency = t.elapsed().as_secs_f64();
    o
}

fn run_clients(ctx: &Arc<Ctx>, n: usize, clients: usize, tag: &str) -> Vec<Outcome> {
    let next = Arc::new(AtomicUsize::new(0));
    let out = Arc::new(Mutex::new(Vec::with_capacity(n)));
    let threads: Vec<_> = (0..clients.min(n.max(1)))
        .map(|_| {
            let (ctx, next, out, tag) = (ctx.clone(), next.clone(), out.clone(), tag.to_string());
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= n {
                    return;
                }
                let o = one(&ctx, i, Kind::of(i), &tag);
                if let Ok(mut v) = out.lock() {
                    v.push(o);
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    Arc::try_unwrap(out)
        .map(|m| m.into_inner().unwrap_or_default())
        .unwrap_or_default()
}

fn rss_of(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let idx = ((p / 100.0) * (v.len() as f64 - 1.0)).round() as usize;
    v[idx.min(v.len() - 1)]
}

fn test_png(size: u32, seed: u8) -> anyhow::Result<Vec<u8>> {
    let img = image::RgbImage::from_fn(size, size, |x, y| {
        image::Rgb([(x * 255 / size) as u8, (y * 255 / size) as u8, seed])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    image::DynamicImage::ImageRgb8(img)
        .write_to(&mut out, image::ImageFormat::Png)
        .context("encoding a test picture")?;
    Ok(out.into_inner())
}

fn load(a: &ServeArgs, child: &ServeChild) -> anyhow::Result<Vec<String>> {
    let image = test_png(a.size as u32, 40)?;
    let mask = test_png((a.size / 2).max(8) as u32, 255)?;
    let ctx = Arc::new(Ctx {
        addr: child.addr,
        size: a.size,
        steps: a.steps,
        image_b64: format!("data:image/png;base64,{}", http::b64(&image)),
        small_mask_b64: format!("data:image/png;base64,{}", http::b64(&mask)),
    });
    let mut failures = Vec::new();

    // Warm-up: every kind, at the same concurrency, so pools and caches settle.
    let warm_n = a
        .warmup
        .unwrap_or((a.clients * 2).max(20).min(a.requests.max(20)));
    let t = Instant::now();
    let warm = run_clients(&ctx, warm_n, a.clients, "bench-warmup");
    std::thread::sleep(Duration::from_millis(500));
    let rss_warm = child.rss_kib().unwrap_or(0);
    println!(
        "warm-up: {warm_n} requests in {:.1} s; server RSS {:.1} MiB",
        t.elapsed().as_secs_f64(),
        rss_warm as f64 / 1024.0
    );

    // RSS over the run (a bounded cache levels off; a leak keeps climbing).
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (sampling, pid) = (sampling.clone(), child.pid());
        std::thread::spawn(move || {
            let mut v = Vec::new();
            while sampling.load(Ordering::SeqCst) {
                if let Some(kib) = rss_of(pid) {
                    v.push(kib);
                }
                std::thread::sleep(Duration::from_millis(250));
            }
            v
        })
    };
    let t = Instant::now();
    let outcomes = run_clients(&ctx, a.requests, a.clients, "bench-load");
    let wall = t.elapsed().as_secs_f64();
    sampling.store(false, Ordering::SeqCst);
    let samples = sampler.join().unwrap_or_default();
    std::thread::sleep(Duration::from_millis(500));
    let rss_end = child.rss_kib().unwrap_or(0);

    // ---- the table
    let images: usize = outcomes.iter().map(|o| o.images).sum();
    println!();
    println!(
        "load: {} requests, {} clients, {} px, {} steps (cancelled jobs {}), queue limit {}",
        a.requests,
        a.clients,
        a.size,
        a.steps,
        a.steps * 12,
        a.queue_limit
    );
    println!(
        "wall {wall:.1} s; throughput {:.2} req/s, {:.2} images/s",
        a.requests as f64 / wall,
        images as f64 / wall
    );
    println!(
        "{:<20} {:>6} {:>8} {:>9} {:>9} {:>9} {:>7}",
        "kind", "count", "success", "p50 ms", "p95 ms", "p99 ms", "429s"
    );
    for k in Kind::ALL {
        let of: Vec<&Outcome> = outcomes.iter().filter(|o| o.kind == k).collect();
        let lat: Vec<f64> = of.iter().map(|o| o.latency * 1000.0).collect();
        println!(
            "{:<20} {:>6} {:>8} {:>9.0} {:>9.0} {:>9.0} {:>7}",
            k.name(),
            of.len(),
            of.iter().filter(|o| o.success).count(),
            percentile(&lat, 50.0),
            percentile(&lat, 95.0),
            percentile(&lat, 99.0),
            of.iter().map(|o| o.retries).sum::<u32>()
        );
    }
    let all_lat: Vec<f64> = outcomes.iter().map(|o| o.latency * 1000.0).collect();
    println!(
        "{:<20} {:>6} {:>8} {:>9.0} {:>9.0} {:>9.0} {:>7}",
        "all",
        outcomes.len(),
        outcomes.iter().filter(|o| o.success).count(),
        percentile(&all_lat, 50.0),
        percentile(&all_lat, 95.0),
        percentile(&all_lat, 99.0),
        outcomes.iter().map(|o| o.retries).sum::<u32>()
    );
    let mut by_status: HashMap<u16, usize> = HashMap::new();
    for o in &outcomes {
        *by_status.entry(o.status).or_default() += 1;
    }
    let mut st: Vec<_> = by_status.into_iter().collect();
    st.sort();
    println!(
        "final status of each request: {}",
        st.iter()
            .map(|(s, n)| format!("{s}: {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let every: Vec<u16> = outcomes
        .iter()
        .chain(warm.iter())
        .flat_map(|o| o.all_statuses.iter().copied())
        .collect();
    let five = every.iter().filter(|&&s| s >= 500).count();
    let n429 = every.iter().filter(|&&s| s == 429).count();
    println!("HTTP exchanges: {} (429 answered {n429} times, each retried after Retry-After), 5xx: {five}", every.len());
    let states: HashMap<String, usize> =
        outcomes
            .iter()
            .filter(|o| o.kind == Kind::Cancel)
            .fold(HashMap::new(), |mut m, o| {
                *m.entry(o.state.clone().unwrap_or_else(|| "-".into()))
                    .or_default() += 1;
                m
            });
    println!("cancel half-way ended: {states:?}");
    let growth = if rss_warm > 0 {
        (rss_end as f64 - rss_warm as f64) / rss_warm as f64 * 100.0
    } else {
        f64::NAN
    };
    println!(
        "server RSS: after warm-up {:.1} MiB, at the end {:.1} MiB ({growth:+.1} %)",
        rss_warm as f64 / 1024.0,
        rss_end as f64 / 1024.0
    );
    if !samples.is_empty() {
        let at = |f: f64| samples[((samples.len() - 1) as f64 * f) as usize] as f64 / 1024.0;
        println!(
            "server RSS during the load (MiB) at 0/25/50/75/100 % of its time: {:.1} / {:.1} / {:.1} / {:.1} / {:.1}",
            at(0.0),
            at(0.25),
            at(0.5),
            at(0.75),
            at(1.0)
        );
    }

    // ---- checks
    for o in outcomes.iter().chain(warm.iter()) {
        if let Some(p) = &o.problem {
            failures.push(format!("{} `{}`: {p}", o.kind.name(), o.prompt));
        }
    }
    if five > 0 {
        failures.push(format!("{five} 5xx answers"));
    }
    if !(growth <= 10.0) {
        failures.push(format!(
            "RSS grew {growth:.1} % from after warm-up to the end (bar: 10 %)"
        ));
    }
    failures.extend(check_gallery(
        child.addr,
        outcomes.iter().chain(warm.iter()),
    )?);
    let unanswered = outcomes.iter().filter(|o| o.status == 0).count();
    println!("unanswered requests: {unanswered}");
    Ok(failures)
}

/// Every success in the gallery exactly once (its pictures, by its unique
/// prompt), nothing from a failed, refused or cancelled request, and no
/// gallery id handed out twice.
fn check_gallery<'a>(
    addr: SocketAddr,
    outcomes: impl Iterator<Item = &'a Outcome>,
) -> anyhow::Result<Vec<String>> {
    let items = http::gallery_all(addr, "").context("listing the gallery")?;
    let mut rows: HashMap<String, Vec<i64>> = HashMap::new();
    for it in &items {
        rows.entry(it["prompt"].as_str().unwrap_or("").to_string())
            .or_default()
            .push(it["id"].as_i64().unwrap_or(-1));
    }
    let mut failures = Vec::new();
    let mut expected_total = 0;
    let mut ids_seen: HashMap<i64, &str> = HashMap::new();
    let outcomes: Vec<&Outcome> = outcomes.collect();
    for o in &outcomes {
        let have = rows.get(&o.prompt).map(Vec::len).unwrap_or(0);
        let want = if o.success { o.images } else { 0 };
        expected_total += want;
        if have != want {
            failures.push(format!(
                "gallery: `{}` ({}, state {:?}, status {}) has {have} row(s), expected {want}",
                o.prompt,
                o.kind.name(),
                o.state,
                o.status
            ));
        }
        for g in &o.gallery_ids {
            if let Some(prev) = ids_seen.insert(*g, &o.prompt) {
                failures.push(format!(
                    "gallery id {g} reported for both `{prev}` and `{}`",
                    o.prompt
                ));
            }
            if !rows.get(&o.prompt).is_some_and(|r| r.contains(g)) {
                failures.push(format!(
                    "gallery id {g} of `{}` is not listed under its prompt",
                    o.prompt
                ));
            }
        }
    }
    let ours = items
        .iter()
        .filter(|i| {
            i["prompt"]
                .as_str()
                .is_some_and(|p| p.starts_with("bench-"))
        })
        .count();
    println!("gallery: {} rows listed, {ours} from this run, {expected_total} expected (one per picture of each success)", items.len());
    if ours != expected_total {
        failures.push(format!(
            "gallery holds {ours} rows of this run, expected {expected_total}"
        ));
    }
    failures.truncate(20);
    Ok(failures)
}

// ---------------------------------------------------------------- latency

/// Waits for a library job from a compute-pool thread (bench commands run on
/// one) while working on the pool's tasks: a plain blocking wait would take
/// one of the pool's threads away from the job it waits for (half of a
/// 2-core machine), making the library side look slower than it is.
fn wait_helping(
    rt: &brume_runtime::Runtime,
    id: brume_runtime::JobId,
) -> Option<brume_runtime::JobStatus> {
    loop {
        let s = rt.status(id)?;
        if s.state.is_finished() {
            return Some(s);
        }
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => {}
            _ => std::thread::sleep(Duration::from_micros(100)),
        }
    }
}

fn latency(a: &ServeArgs, child: &ServeChild) -> anyhow::Result<Vec<String>> {
    use brume_runtime::{JobSpec, PreviewPolicy, Runtime, RuntimeConfig};
    let prompt = "a red circle on a blue background";
    let size = a.size;
    let steps = a.latency_steps;
    let entry = super::ModelArgs {
        model: None,
        config: None,
        variant: None,
        unet: None,
    }
    .entry();
    let rt =
        Runtime::start(RuntimeConfig::new(vec![entry])).context("starting the library runtime")?;
    let lib_job = |seed: u64| -> anyhow::Result<(f64, bool, f64)> {
        let spec = JobSpec {
            steps,
            seed: Some(seed),
            width: Some(size),
            height: Some(size),
            previews: PreviewPolicy::OFF,
            ..JobSpec::txt2img(prompt)
        };
        let t = Instant::now();
        let id = rt.submit(spec).context("library submit")?;
        let s = wait_helping(&rt, id).context("library job forgotten")?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        let out = s.output.context("library job gave no result")?;
        Ok((ms, out.timings.text_encoder_cached, out.timings.total_ms))
    };
    let addr = child.addr;
    let http_job = |seed: u64| -> anyhow::Result<(f64, bool, f64, f64)> {
        let mut body = json!({"prompt": prompt, "width": size, "height": size, "seed": seed, "preview_every": 0});
        if let Some(s) = steps {
            body["steps"] = json!(s);
        }
        let t = Instant::now();
        let r = http::post_json(addr, "/api/v1/jobs", &body)?;
        if r.status != 202 {
            bail!("latency job: {} {}", r.status, r.text());
        }
        let id = r
            .json()
            .and_then(|v| v["id"].as_str().map(str::to_string))
            .context("no job id")?;
        let mut done: Option<Value> = None;
        http::sse(addr, &format!("/api/v1/jobs/{id}/events"), TIMEOUT, |ev| {
            if matches!(ev["type"].as_str(), Some("done" | "failed" | "cancelled")) {
                done = Some(ev.clone());
                return false;
            }
            true
        })?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        let ev = done.context("the event stream ended without the job's end")?;
        if ev["type"] != "done" {
            bail!("latency job ended {ev}");
        }
        let timings = &ev["result"]["timings"];
        Ok((
            ms,
            timings["text_encoder_cached"].as_bool().unwrap_or(false),
            timings["text_encoder_ms"].as_f64().unwrap_or(f64::NAN),
            timings["total_ms"].as_f64().unwrap_or(f64::NAN),
        ))
    };
    // First of each: the prompt's first encoding (and the library's model load).
    let (first_http, first_cached, first_te, _) = http_job(1000)?;
    let (first_lib, _, _) = lib_job(1000)?;
    let (mut h, mut l) = (Vec::new(), Vec::new());
    // The job's own time (timings.total_ms) on each side, and what the wall adds to it.
    let (mut h_in, mut l_in, mut h_over, mut l_over) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut cached = 0;
    let mut te_ms = Vec::new();
    for i in 0..a.latency_runs {
        let seed = 1001 + i as u64;
        let (ms, c, te, total) = http_job(seed)?;
        h.push(ms);
        h_in.push(total);
        h_over.push(ms - total);
        te_ms.push(te);
        cached += c as usize;
        let (ms, _, total) = lib_job(seed)?;
        l.push(ms);
        l_in.push(total);
        l_over.push(ms - total);
    }
    rt.shutdown();
    let (hm, lm) = (
        super::bench::median(&h).unwrap_or(f64::NAN),
        super::bench::median(&l).unwrap_or(f64::NAN),
    );
    let within = hm <= lm * 1.10 || hm - lm <= 20.0;
    println!();
    println!(
        "latency: built-in model txt2img {size} px, {} steps, prompt repeated, {} runs each side alternated (first run of each excluded)",
        steps.map(|s| s.to_string()).unwrap_or_else(|| "default".into()),
        a.latency_runs
    );
    println!(
        "{:<34} {:>10} {:>10} {:>10}",
        "", "median ms", "min ms", "max ms"
    );
    let row = |name: &str, v: &[f64]| {
        let (m, lo, hi) = super::bench::spread(v).unwrap_or((f64::NAN, f64::NAN, f64::NAN));
        println!("{name:<34} {m:>10.1} {lo:>10.1} {hi:>10.1}");
    };
    row("HTTP (POST /api/v1/jobs + SSE)", &h);
    row("library (brume_runtime)", &l);
    row("  HTTP: the job's own total_ms", &h_in);
    row("  library: the job's own total_ms", &l_in);
    row("  HTTP: wall - total_ms", &h_over);
    row("  library: wall - total_ms", &l_over);
    println!(
        "ratio HTTP/library {:.3}, difference {:+.1} ms: {} (bar: within 10 % or 20 ms)",
        hm / lm,
        hm - lm,
        if within { "PASS" } else { "FAIL" }
    );
    println!("first runs: HTTP {first_http:.1} ms (text encoder cached: {first_cached}, {first_te:.1} ms), library {first_lib:.1} ms");
    println!(
        "text encoder skipped on repeats: {cached}/{} (text_encoder_cached=true in the job's timings; median text_encoder_ms {:.2})",
        a.latency_runs,
        super::bench::median(&te_ms).unwrap_or(f64::NAN)
    );
    let mut failures = Vec::new();
    if !within && !a.latency_report_only {
        failures.push(format!(
            "HTTP median {hm:.1} ms vs library {lm:.1} ms: over 10 % and 20 ms"
        ));
    }
    if cached != a.latency_runs {
        failures.push(format!(
            "a repeated prompt ran the text encoder: cached {cached}/{}",
            a.latency_runs
        ));
    }
    Ok(failures)
}
