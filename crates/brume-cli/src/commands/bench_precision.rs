//! `brume bench precision`: what each precision tier costs and gives.
//!
//! Each tier is converted once (kept in `--work`, reused when its record matches
//! the source and the policy), then generated in a child process of its own, so
//! that peak RSS and private-dirty memory are that tier's alone. Quality is the
//! PSNR of the final image against the fp32 tier from the same seed, and, for the
//! built-in model, prompt adherence on held-out prompts judged by the world.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};
use brume::loading::Segment;
use brume::pipelines::image_io::{save_png, to_rgb8};
use brume::pipelines::{txt2img, Flow, GenerationRequest, OpenOptions, Progress, RunOptions, SdModel};
use brume::quantization::convert::{convert, read_record, ConfigSource};
use brume::runtime::memory;
use brume::samplers::{noise_source, RngKind};

use super::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct PrecisionArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Tiers to compare (presets or policy files); the first is the quality reference.
    #[arg(long, value_delimiter = ',', default_value = "fp32,fp16,int8,int4,int4-attn-fp16,ternary-attn-fp16")]
    tiers: Vec<String>,
    /// Folder for the converted models (kept between runs).
    #[arg(long, default_value = "brume-precision")]
    work: PathBuf,
    /// Image size in pixels (square; default: the model's native size).
    #[arg(long)]
    size: Option<usize>,
    #[arg(long, default_value_t = 4)]
    steps: usize,
    #[arg(long, default_value_t = 7.5)]
    guidance: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, default_value = "a large red circle on the left on a blue background")]
    prompt: String,
    /// Held-out prompts judged per tier for prompt adherence (built-in model only; 0: skip).
    #[arg(long, default_value_t = 100)]
    adherence: usize,
    /// Steps of each adherence image (default: as `brume eval adherence`, the model's own).
    #[arg(long)]
    adherence_steps: Option<usize>,
    /// Guidance of each adherence image (default: as `brume eval adherence`, the model's
    /// own: 3.5 for the built-in model; tables before 2026-12-07 were read at 5).
    #[arg(long)]
    adherence_guidance: Option<f64>,
}

/// One tier's generation, run in a child process (`brume bench precision-run`).
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    size: usize,
    #[arg(long)]
    steps: usize,
    #[arg(long)]
    guidance: f64,
    #[arg(long)]
    seed: u64,
    #[arg(long)]
    prompt: String,
    /// Where to write the final image.
    #[arg(long)]
    image: PathBuf,
}

/// What a child reports, one JSON line on stdout.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct RunReport {
    step_seconds: Vec<f64>,
    peak_rss: Option<u64>,
    peak_private_dirty: Option<u64>,
}

/// Generates one image, timing UNet steps and sampling memory throughout.
pub fn run_child(a: RunArgs) -> anyhow::Result<()> {
    let model = SdModel::open(&a.model, &OpenOptions::default())?;
    let req = GenerationRequest {
        steps: a.steps,
        guidance_scale: a.guidance,
        seed: a.seed,
        rng: RngKind::Brume,
        ..GenerationRequest::new(a.prompt.clone(), a.size)
    };
    let mut report = RunReport::default();
    let mut last: Option<Instant> = None;
    // The VAE decoder's peak falls between progress reports: sample on a thread.
    let watch = memory::PeakWatch::start(std::time::Duration::from_millis(20));
    let mut noise = noise_source(req.rng, req.seed);
    let out = txt2img(&model, &req, &RunOptions::default(), noise.as_mut(), None, &mut |p| {
        match p {
            Progress::Loaded(Segment::Unet) => last = Some(Instant::now()),
            Progress::Step { .. } => {
                if let Some(t) = last {
                    report.step_seconds.push(t.elapsed().as_secs_f64());
                }
                last = Some(Instant::now());
            }
            Progress::Loaded(_) => {}
        }
        Flow::Continue
    })?;
    let (_, peak_dirty) = watch.finish();
    save_png(&to_rgb8(&out.image)?, &a.image, None).with_context(|| format!("writing {}", a.image.display()))?;
    report.peak_rss = memory::read().peak_rss;
    report.peak_private_dirty = peak_dirty;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// PSNR in dB between two 8-bit images of one size.
fn psnr(a: &image::RgbImage, b: &image::RgbImage) -> Option<f64> {
    if a.dimensions() != b.dimensions() {
        return None;
    }
    let n = a.as_raw().len() as f64;
    let mse = a.as_raw().iter().zip(b.as_raw()).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum::<f64>() / n;
    Some(if mse == 0.0 { f64::INFINITY } else { 10.0 * (255.0f64 * 255.0 / mse).log10() })
}

/// The tier's converted folder: reused when its record names the same source and policy.
fn tier_model(a: &PrecisionArgs, source: &SdModel, tier: &str) -> anyhow::Result<PathBuf> {
    let policy = super::convert::policy(tier)?;
    let dir_name: String = tier.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
    let out = a.work.join(dir_name);
    let hash = brume::pipelines::recipe::model_hash(source);
    if let Some(r) = read_record(&out) {
        if r["source_hash"] == hash.as_str() && r["policy_text"] == policy.to_text().as_str() {
            return Ok(out);
        }
    }
    let input = a.model.path();
    let cfg_dir = match &input {
        Some(p) if p.is_dir() => Some(p.clone()),
        Some(_) => a.model.config.clone(),
        None => None,
    };
    let configs = match &cfg_dir {
        Some(d) => ConfigSource::Folder(d),
        None if input.is_some() => bail!("single-file models need --config DIR to be converted"),
        None => ConfigSource::Embedded(crate::builtin::FILES),
    };
    let t = Instant::now();
    eprintln!("converting to {tier} ...");
    convert(source, configs, input.as_deref(), &policy, &out, true)?;
    eprintln!("converted to {tier} in {:.1} s", t.elapsed().as_secs_f64());
    Ok(out)
}

fn mib_opt(v: Option<u64>) -> String {
    v.map(|b| format!("{:.1}", b as f64 / (1024.0 * 1024.0))).unwrap_or_else(|| "-".into())
}

pub fn precision(a: PrecisionArgs) -> anyhow::Result<()> {
    if a.tiers.is_empty() || a.steps == 0 {
        bail!("need at least one tier and one step");
    }
    let source = a.model.open()?;
    let size = a.size.unwrap_or_else(|| source.default_size());
    std::fs::create_dir_all(&a.work).with_context(|| format!("creating {}", a.work.display()))?;
    let exe = std::env::current_exe().context("locating the brume executable")?;
    let builtin = a.model.path().is_none();
    struct Row {
        tier: String,
        bytes: BTreeMap<Segment, usize>,
        report: RunReport,
        image: image::RgbImage,
        adherence: Option<super::eval::Adherence>,
    }
    let mut rows: Vec<Row> = Vec::new();
    for tier in &a.tiers {
        let dir = tier_model(&a, &source, tier)?;
        let model = SdModel::open(&dir, &OpenOptions::default())?;
        let bytes = Segment::ALL.iter().map(|&s| (s, model.segment_bytes(s))).collect();
        let image_path = a.work.join(format!("{}.png", dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()));
        eprintln!("generating with {tier} ({size} px, {} steps) ...", a.steps);
        let out = Command::new(&exe)
            .args(["bench", "precision-run", "--model"])
            .arg(&dir)
            .args(["--size", &size.to_string(), "--steps", &a.steps.to_string()])
            .args(["--guidance", &a.guidance.to_string(), "--seed", &a.seed.to_string()])
            .args(["--prompt", &a.prompt, "--image"])
            .arg(&image_path)
            .output()
            .context("running the tier's generation")?;
        if !out.status.success() {
            bail!("{tier}: generation failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let report: RunReport = serde_json::from_str(text.lines().last().unwrap_or("")).with_context(|| format!("{tier}: reading the child's report `{text}`"))?;
        let image = image::open(&image_path).with_context(|| format!("reading {}", image_path.display()))?.to_rgb8();
        let adherence = if builtin && a.adherence > 0 {
            eprintln!("judging {} held-out prompts with {tier} ...", a.adherence);
            let kind = model.sampler_kind(None)?;
            let settings = model.sampling_settings(kind, a.adherence_steps, a.adherence_guidance)?;
            let (scores, _) = super::eval::judge_held_out(&model, &super::eval::HeldOutRun::bars(a.adherence, settings, kind), &brume::pipelines::RunOptions::default())?;
            eprintln!();
            Some(scores)
        } else {
            None
        };
        rows.push(Row { tier: tier.clone(), bytes, report, image, adherence });
        drop(model);
    }
    let reference = &rows[0];
    // Wide enough for the longest tier name (a policy file's path can be long).
    let w = rows.iter().map(|r| r.tier.chars().count()).max().unwrap_or(0).max(20);
    println!(
        "precision tiers of {} at {size}x{size}, {} steps, guidance {}, seed {}; quality against `{}`",
        source.name, a.steps, a.guidance, a.seed, reference.tier
    );
    println!(
        "{:<w$} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>11} {:>9} {:>9}",
        "tier", "text MiB", "vae-e MiB", "unet MiB", "vae-d MiB", "total MiB", "peak RSS", "priv. dirty", "s/step", "PSNR dB"
    );
    for r in &rows {
        let b = |s: Segment| format!("{:.2}", r.bytes[&s] as f64 / (1024.0 * 1024.0));
        let total: usize = r.bytes.values().sum();
        let p = psnr(&r.image, &reference.image).map(|p| if p.is_finite() { format!("{p:.1}") } else { "exact".into() }).unwrap_or_else(|| "-".into());
        println!(
            "{:<w$} {:>9} {:>9} {:>9} {:>9} {:>10.2} {:>10} {:>11} {:>9} {:>9}",
            r.tier,
            b(Segment::TextEncoder),
            b(Segment::VaeEncoder),
            b(Segment::Unet),
            b(Segment::VaeDecoder),
            total as f64 / (1024.0 * 1024.0),
            mib_opt(r.report.peak_rss),
            mib_opt(r.report.peak_private_dirty),
            super::bench::median(&r.report.step_seconds).map(|s| format!("{s:.3}")).unwrap_or_else(|| "-".into()),
            p
        );
    }
    println!("(memory in MiB: peak RSS of the generating process, its largest private-dirty reading over the run; s/step: median UNet step)");
    if rows.iter().any(|r| r.adherence.is_some()) {
        let attrs: Vec<&'static str> = rows.iter().filter_map(|r| r.adherence.as_ref()).flat_map(|s| s.tally.attributes.keys().copied()).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        println!();
        // Every tier converts the same folder, so they share its sampling settings.
        let settings = rows.iter().find_map(|r| r.adherence.as_ref()).map(|s| s.run.describe()).unwrap_or_default();
        println!("prompt adherence (% correct) on {} held-out prompts, {settings}", a.adherence);
        print!("{:<w$}", "tier");
        for at in &attrs {
            print!(" {:>17}", at);
        }
        println!(" {:>8}", "all");
        for r in &rows {
            let Some(s) = &r.adherence else { continue };
            print!("{:<w$}", r.tier);
            for at in &attrs {
                let (ok, n) = s.tally.attributes.get(at).copied().unwrap_or((0, 0));
                print!(" {:>17}", if n == 0 { "-".to_string() } else { format!("{:.1}", 100.0 * ok as f64 / n as f64) });
            }
            println!(" {:>8.1}", 100.0 * s.tally.all_correct as f64 / s.prompts.len().max(1) as f64);
        }
    }
    Ok(())
}
