//! `brume bench live`: the live pipeline on a synthetic moving scene (brume-world's
//! renderer, a slow pan with camera-like noise, through Y4M decode and PNG encode as
//! a real stream would be): sustained FPS and end-to-end latency, the pipeline against
//! the same work in one thread, each technique on and off (FPS, latency, flicker on a
//! still input and on a slow pan), and the governor at a target, with the bars.

use super::bench_serve::http::cpu_model;
use std::io::Cursor;

use anyhow::Context;
use brume_live::diffuser::{DecodeStage, DenoiseStage, DiffuserConfig, EncodeStage, FrameDiffuser};
use brume_live::governor::{Governed, Governor};
use brume_live::pipeline::{run_pipeline, run_sequential, PipelineOptions, Report};
use brume_live::source::Y4mSource;
use brume_live::techniques::{flicker, Techniques};
use brume_live::WhenFull;
use image::RgbImage;

use super::live::{governor_widths, live_model, Stage, DEFAULT_TECHNIQUES, SMOOTHING};
use super::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct LiveArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Frame size in pixels.
    #[arg(long, default_value_t = 128)]
    size: u32,
    /// Denoising steps per frame.
    #[arg(long, default_value_t = 1)]
    steps: usize,
    #[arg(long, default_value_t = 0.5)]
    strength: f64,
    /// Frames per measured run.
    #[arg(long, default_value_t = 60)]
    frames: u64,
    /// The camera's rate in the real-time run.
    #[arg(long, default_value_t = 30.0)]
    camera_fps: f64,
    /// The governor's target frame time.
    #[arg(long, default_value_t = 40.0)]
    target_ms: f64,
    /// Leave out the per-technique runs.
    #[arg(long)]
    no_techniques: bool,
}

const PROMPT: &str = "a large red circle on a blue background";

/// Camera-like noise: a deterministic hash per pixel and frame, +-`amp` levels.
fn noisy(img: &RgbImage, frame: u64, amp: f32) -> RgbImage {
    let mut out = img.clone();
    for (i, p) in out.iter_mut().enumerate() {
        let mut h = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ frame.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        h ^= h >> 29;
        h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h ^= h >> 32;
        let u = (h & 0xFFFF) as f32 / 65535.0 * 2.0 - 1.0;
        *p = (*p as f32 + u * amp).round().clamp(0.0, 255.0) as u8;
    }
    out
}

/// The scene: a red circle and a yellow square on a blue gradient; `pan` moves them
/// `speed` of the frame's width per frame (a slow pan), back and forth.
fn scene_frames(size: u32, count: u64, speed: f64) -> anyhow::Result<Vec<RgbImage>> {
    use brume_world::caption::parse_caption;
    use brume_world::scene::scene_from_spec;
    let spec = parse_caption(
        "a large red circle on the left of a small yellow square on a blue background",
    )
    .or_else(|_| parse_caption("a large red circle on a blue background"))
    .map_err(|e| anyhow::anyhow!("the bench's caption is not in the world's grammar: {e}"))?;
    let base = scene_from_spec(&spec, 3);
    Ok((0..count)
        .map(|i| {
            let mut s = base.clone();
            // Triangle wave so objects stay in frame.
            let period = (0.3 / speed.max(1e-9)).max(1.0);
            let phase = (i as f64 % (2.0 * period)) / period;
            let off = if phase < 1.0 { phase } else { 2.0 - phase } * 0.3 - 0.15;
            for o in &mut s.objects {
                o.cx = (o.cx + if speed > 0.0 { off } else { 0.0 }).clamp(o.r, 1.0 - o.r);
            }
            noisy(&brume_world::render::render(&s, size.max(32)), i, 3.0)
        })
        .map(|img| {
            if img.width() != size {
                image::imageops::resize(&img, size, size, image::imageops::FilterType::Triangle)
            } else {
                img
            }
        })
        .collect())
}

fn y4m_of(frames: &[RgbImage], fps: u32) -> anyhow::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    brume_live::y4m::write(&mut bytes, frames, fps).context("writing the bench's Y4M stream")?;
    Ok(bytes)
}

struct Run {
    report: Report,
    outputs: Vec<RgbImage>,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Pipeline,
    Split,
    Sequential,
    /// The sequential loop on a one-thread pool: what one core does alone.
    SequentialOneCore,
}

struct Bench<'a> {
    model: &'a ModelArgs,
    a: &'a LiveArgs,
}

impl Bench<'_> {
    fn cfg(&self, t: Techniques) -> DiffuserConfig {
        DiffuserConfig {
            steps: self.a.steps,
            strength: self.a.strength,
            techniques: t,
            ..DiffuserConfig::new(PROMPT)
        }
    }

    fn run(
        &self,
        mode: Mode,
        y4m: &[u8],
        t: Techniques,
        pace: Option<f64>,
        target: Option<f64>,
    ) -> anyhow::Result<Run> {
        let mut source = Y4mSource::from_reader(Cursor::new(y4m.to_vec()), "synthetic".into())?;
        let opts = PipelineOptions {
            width: self.a.size,
            queue: 1,
            when_full: if pace.is_some() {
                WhenFull::DropOldest
            } else {
                WhenFull::Block
            },
            pace_fps: pace,
            smoothing: t.smoothing.then_some(SMOOTHING),
        };
        let mut outputs = Vec::new();
        // Encoded as `brume live` writes frames (PNG), kept in memory: the disk is not measured.
        let mut sink = |_: u64, img: &RgbImage| -> brume_live::Result<()> {
            let png = brume::pipelines::recipe::encode_png(img, None)?;
            std::hint::black_box(png);
            outputs.push(img.clone());
            Ok(())
        };
        let cfg = self.cfg(t);
        let (width, steps, model) = (self.a.size, self.a.steps, self.model);
        let make = move || -> brume_live::Result<Stage> {
            let m = model
                .open()
                .map_err(|e| brume_live::LiveError::Invalid(format!("{e:#}")))?;
            let d = FrameDiffuser::new(m, cfg)?;
            Ok(match target {
                Some(t) => Stage::Governed(Governed::new(
                    d,
                    Governor::new(t, governor_widths(width), steps),
                )),
                None => Stage::Plain(d),
            })
        };
        let report = match mode {
            Mode::Split => {
                let cfg = self.cfg(t);
                let (c1, c2) = (cfg.clone(), cfg.clone());
                let open = move || {
                    model
                        .open()
                        .map_err(|e| brume_live::LiveError::Invalid(format!("{e:#}")))
                };
                brume_live::split::run_split(
                    &mut source,
                    || EncodeStage::new(&open()?, &c1),
                    || DenoiseStage::new(open()?, &c2),
                    || DecodeStage::new(&open()?),
                    &mut sink,
                    &opts,
                    1,
                )?
            }
            Mode::Pipeline => run_pipeline(&mut source, make, &mut sink, &opts)?,
            Mode::Sequential => run_sequential(&mut source, make, &mut sink, &opts)?,
            Mode::SequentialOneCore => {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .build()
                    .context("starting a one-thread pool")?;
                let mut r = pool.install(|| run_sequential(&mut source, make, &mut sink, &opts))?;
                r.mode = "sequential on ONE core (1-thread pool)".into();
                r
            }
        };
        Ok(Run { report, outputs })
    }
}


fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "FAIL"
    }
}

pub fn run(a: LiveArgs) -> anyhow::Result<()> {
    if a.size < 32 || a.size % 8 != 0 {
        anyhow::bail!(
            "--size must be a multiple of 8, at least 32, got {}",
            a.size
        );
    }
    if a.frames < 10 {
        anyhow::bail!("--frames must be at least 10, got {}", a.frames);
    }
    if !(a.camera_fps > 0.0 && a.camera_fps <= 1000.0) {
        anyhow::bail!("--camera-fps must be in (0, 1000], got {}", a.camera_fps);
    }
    let model = live_model(&a.model);
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    println!(
        "brume bench live: {} ({} cores, {} compute threads), load average {} at start",
        cpu_model(),
        cores,
        rayon::current_num_threads(),
        load_average()
    );
    let b = Bench {
        model: &model,
        a: &a,
    };
    let default_t = Techniques::parse(DEFAULT_TECHNIQUES).map_err(anyhow::Error::msg)?;
    let pan = scene_frames(a.size, a.frames, 0.004)?;
    let still = scene_frames(a.size, a.frames, 0.0)?;
    let (pan_y4m, still_y4m) = (
        y4m_of(&pan, a.camera_fps as u32)?,
        y4m_of(&still, a.camera_fps as u32)?,
    );
    println!(
        "scene: brume-world render at {0} px, slow pan (0.4 % of the width per frame) with +-3-level camera noise, decoded from Y4M; \
         results PNG-encoded; prompt \"{PROMPT}\", {1} step(s), strength {2}, {3} frames per run",
        a.size, a.steps, a.strength, a.frames
    );
    // Warm-up: page in the weights, fill the allocator.
    b.run(
        Mode::Sequential,
        &y4m_of(&pan[..5], 30)?,
        Techniques::NONE,
        None,
        None,
    )?;

    // 1. Throughput, alternated: pipeline vs the same work in one thread, every frame.
    let (mut pipe, mut seq, mut split) = (Vec::new(), Vec::new(), Vec::new());
    let mut last = None;
    for _ in 0..3 {
        let s = b.run(Mode::Sequential, &pan_y4m, Techniques::NONE, None, None)?;
        let p = b.run(Mode::Pipeline, &pan_y4m, Techniques::NONE, None, None)?;
        let x = b.run(Mode::Split, &pan_y4m, Techniques::NONE, None, None)?;
        seq.push(s.report.fps());
        pipe.push(p.report.fps());
        split.push(x.report.fps());
        last = Some((s.report, p.report, x.report));
    }
    let one = b.run(
        Mode::SequentialOneCore,
        &pan_y4m,
        Techniques::NONE,
        None,
        None,
    )?;
    let med = |v: &[f64]| super::bench::median(v).unwrap_or(0.0);
    let (seq_fps, pipe_fps, split_fps) = (med(&seq), med(&pipe), med(&split));
    let ratio = if seq_fps > 0.0 {
        split_fps / seq_fps
    } else {
        0.0
    };
    println!("\n== throughput, every frame, no techniques (3 runs per mode, alternated; the last run's table) ==");
    if let Some((s, p, x)) = &last {
        print!(
            "{}{}{}{}",
            s.table(),
            one.report.table(),
            p.table(),
            x.table()
        );
    }
    println!(
        "two cores vs one on the same loop: {:.1} vs {:.1} FPS ({:.2}x): what the kernels already spread over both cores",
        seq_fps,
        one.report.fps(),
        if one.report.fps() > 0.0 { seq_fps / one.report.fps() } else { 0.0 }
    );
    println!(
        "FPS (median of 3): sequential {seq_fps:.1} {seq:.1?}; 3-thread pipeline, diffusion on the shared pool {pipe_fps:.1} {pipe:.1?} ({:.2}x); \
         split pipeline {split_fps:.1} {split:.1?} ({ratio:.2}x)",
        if seq_fps > 0.0 { pipe_fps / seq_fps } else { 0.0 }
    );

    // 2. Real time: a camera at --camera-fps, queues of one that drop the oldest frame.
    println!(
        "\n== real time: camera at {} FPS, drop-oldest queues of 1, techniques {} ==",
        a.camera_fps,
        default_t.label()
    );
    let rt = b.run(Mode::Split, &pan_y4m, default_t, Some(a.camera_fps), None)?;
    print!("{}", rt.report.table());
    let rt_none = b.run(
        Mode::Split,
        &pan_y4m,
        Techniques::NONE,
        Some(a.camera_fps),
        None,
    )?;
    print!(
        "{}",
        rt_none
            .report
            .table()
            .replacen("pipeline", "pipeline, no techniques", 1)
    );
    let rt_pool = b.run(
        Mode::Pipeline,
        &pan_y4m,
        default_t,
        Some(a.camera_fps),
        None,
    )?;
    print!("{}", rt_pool.report.table());
    let rt_seq = b.run(
        Mode::Sequential,
        &pan_y4m,
        Techniques::NONE,
        Some(a.camera_fps),
        None,
    )?;
    print!("{}", rt_seq.report.table());

    // 3. Techniques on and off: still input and slow pan, every frame.
    let mut rows = Vec::new();
    if !a.no_techniques {
        let sets = ["none", "skip", "blend", "ema", DEFAULT_TECHNIQUES, "all"];
        for name in sets {
            let t = Techniques::parse(name).map_err(anyhow::Error::msg)?;
            let st = b.run(Mode::Split, &still_y4m, t, None, None)?;
            let pn = b.run(Mode::Split, &pan_y4m, t, None, None)?;
            let live = b.run(Mode::Split, &pan_y4m, t, Some(a.camera_fps), None)?;
            rows.push((
                t.label(),
                pn.report.fps(),
                live.report.fps(),
                live.report.latency(50.0),
                live.report.latency(95.0),
                flicker(&st.outputs),
                flicker(&pn.outputs),
                pn.report.skipped(),
                st.report.skipped(),
            ));
        }
        println!("\n== techniques (flicker: mean |difference| of consecutive results, 0-255; FPS every frame and at the {} FPS camera) ==", a.camera_fps);
        println!(
            "{:<16} {:>9} {:>9} {:>8} {:>8} {:>13} {:>11} {:>13}",
            "techniques",
            "FPS all",
            "FPS cam",
            "p50 ms",
            "p95 ms",
            "flicker still",
            "flicker pan",
            "skips st/pan"
        );
        for r in &rows {
            println!(
                "{:<16} {:>9.1} {:>9.1} {:>8.1} {:>8.1} {:>13.2} {:>11.2} {:>7}/{:<5}",
                r.0, r.1, r.2, r.3, r.4, r.5, r.6, r.8, r.7
            );
        }
        let (input_still, input_pan) = (flicker(&still), flicker(&pan));
        println!("(the inputs themselves: flicker still {input_still:.2}, pan {input_pan:.2})");
    }

    // 4. The governor at a target.
    println!(
        "\n== governor at a {:.0} ms target (widths {:?}, up to {} step(s)) ==",
        a.target_ms,
        governor_widths(a.size),
        a.steps
    );
    let gov = b.run(Mode::Pipeline, &pan_y4m, default_t, None, Some(a.target_ms))?;
    print!("{}", gov.report.table());

    // Bars.
    println!(
        "\n== bars (built-in model, {} px, {} step(s), load average {} now) ==",
        a.size,
        a.steps,
        load_average()
    );
    let fps = rt.report.fps();
    let p95 = rt.report.latency(95.0);
    println!(
        "{:<62} {:>10} {}",
        ">= 25 FPS sustained through the pipeline (camera run)",
        format!("{fps:.1}"),
        verdict(fps >= 25.0)
    );
    println!(
        "{:<62} {:>10} {}",
        "end-to-end latency p95 <= 120 ms (camera run)",
        format!("{p95:.1}"),
        verdict(p95 <= 120.0)
    );
    println!(
        "{:<62} {:>10} {}",
        "split pipeline >= 1.8x the FPS of one thread (every frame)",
        format!("{ratio:.2}x"),
        verdict(ratio >= 1.8)
    );
    if let (Some(none), Some(def)) = (
        rows.iter().find(|r| r.0 == "none"),
        rows.iter().find(|r| r.0 == default_t.label()),
    ) {
        let cut = if none.6 > 0.0 {
            1.0 - def.6 / none.6
        } else {
            0.0
        };
        let cost = if none.1 > 0.0 {
            1.0 - def.1 / none.1
        } else {
            0.0
        };
        println!(
            "{:<62} {:>10} {}",
            format!(
                "default set ({}) cuts pan flicker >= 30 % at <= 10 % FPS cost",
                def.0
            ),
            format!("{:.0}%/{:.0}%", cut * 100.0, cost * 100.0),
            verdict(cut >= 0.3 && cost <= 0.1)
        );
    }
    Ok(())
}
