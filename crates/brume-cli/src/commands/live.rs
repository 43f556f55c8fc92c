//! `brume live`: real-time img2img of a video or a folder of frames through brume-live's
//! three-stage pipeline (capture -> diffuse -> write), PNG frames out, and the
//! per-frame timing table.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use brume::output::Output;
use brume_live::diffuser::{DecodeStage, DenoiseStage, DiffuserConfig, EncodeStage, FrameDiffuser};
use brume_live::governor::{Governed, Governor};
use brume_live::pipeline::{run_pipeline, Diffuse, Diffused, PipelineOptions};
use brume_live::techniques::Techniques;
use brume_live::WhenFull;
use image::RgbImage;

use super::ModelArgs;

/// The technique set `brume live` and `brume bench live` use unless told otherwise.
pub const DEFAULT_TECHNIQUES: &str = "skip,blend,ema";
/// Weight of the newest frame in display smoothing.
pub const SMOOTHING: f32 = 0.6;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// What the frames should become.
    prompt: String,
    /// A folder of frames (PNG, JPEG, WebP; file-name order), a .y4m file, or any video
    /// ffmpeg reads (needs ffmpeg on PATH).
    #[arg(long)]
    input: PathBuf,
    /// Folder for the result frames (frame_000000.png, ...); created when missing.
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    model: ModelArgs,
    /// How much each frame changes: 0 keeps it, 1 repaints it (default: the model's
    /// img2img strength, else 0.6).
    #[arg(long)]
    strength: Option<f64>,
    /// Denoising steps per frame (an LCM UNet runs them all below timestep ~1000 x strength).
    #[arg(long, default_value_t = 1)]
    steps: usize,
    /// Working width in pixels (frames are scaled to it, aspect kept, multiples of 8;
    /// default: the model's size).
    #[arg(long)]
    size: Option<u32>,
    /// Target frame time: a governor lowers the working size, then the steps, until
    /// measured frames fit, and says what it chose.
    #[arg(long)]
    target_ms: Option<f64>,
    /// Frame-to-frame techniques: none, all, or a comma list of skip (similarity skip),
    /// blend (30 % of the previous latent), ema (display smoothing).
    #[arg(long, default_value = DEFAULT_TECHNIQUES)]
    techniques: String,
    /// Read the input at its own frame rate (or --fps) as a camera delivers it, dropping
    /// frames the pipeline cannot keep up with; without it every frame is diffused.
    #[arg(long)]
    realtime: bool,
    /// Frame rate for --realtime when the input has none (a frame folder); default 30.
    #[arg(long)]
    fps: Option<f64>,
    /// Stop after this many frames.
    #[arg(long)]
    max_frames: Option<u64>,
    /// Seed of the stream's fixed noise.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Guidance (an LCM UNet's w-embedding; default: the model's).
    #[arg(long)]
    guidance: Option<f64>,
    /// How diffusion is laid out: `split` runs VAE encode, UNet and VAE decode side by
    /// side on the capture, diffuse and output threads, one core each (faster on small
    /// frames, whose kernels gain little from two cores); `pool` runs all three on the
    /// diffuse thread over the shared compute pool (needed by --target-ms's governor).
    #[arg(long, default_value = "split", value_parser = ["split", "pool"])]
    layout: String,
    /// Replace result frames already in --out.
    #[arg(long)]
    force: bool,
}

/// Either diffusion stage, so the pipeline has one type.
pub enum Stage {
    Plain(FrameDiffuser),
    Governed(Governed),
}

impl Diffuse for Stage {
    fn diffuse(&mut self, frame: &RgbImage) -> brume_live::Result<Diffused> {
        match self {
            Stage::Plain(d) => d.diffuse(frame),
            Stage::Governed(g) => g.diffuse(frame),
        }
    }

    fn notes(&mut self) -> Vec<String> {
        match self {
            Stage::Plain(d) => vec![format!("prompt encoded once in {:.1} ms", d.prompt_ms)],
            Stage::Governed(g) => {
                let mut v = vec![format!(
                    "prompt encoded once in {:.1} ms",
                    g.inner.prompt_ms
                )];
                v.extend(g.notes());
                v
            }
        }
    }
}

/// The built-in model runs its LCM UNet live unless another is named.
pub fn live_model(m: &ModelArgs) -> ModelArgs {
    let mut m = m.clone();
    if m.path().is_none() && m.unet.is_none() {
        m.unet = Some("unet_lcm".into());
    }
    m
}

/// Widths a governor may pick from: `width` and smaller steps of 8 down to a quarter.
pub fn governor_widths(width: u32) -> Vec<u32> {
    [1.0, 0.75, 0.5, 0.375, 0.25]
        .iter()
        .map(|f| ((width as f64 * f) as u32 / 8 * 8).max(8))
        .collect()
}

fn frame_path(dir: &Path, i: u64) -> PathBuf {
    dir.join(format!("frame_{i:06}.png"))
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let techniques =
        Techniques::parse(&a.techniques).map_err(|e| anyhow::anyhow!("--techniques: {e}"))?;
    if let Some(t) = a.target_ms {
        if !(t.is_finite() && t > 0.0) {
            bail!("--target-ms must be a positive number of milliseconds, got {t}");
        }
    }
    if let Some(f) = a.fps {
        if !(f.is_finite() && f > 0.0 && f <= 1000.0) {
            bail!("--fps must be in (0, 1000], got {f}");
        }
    }
    let model_args = live_model(&a.model);
    let model = model_args.open()?;
    if model_args.path().is_none() {
        if let Some(w) = crate::builtin::vocabulary_warning(&a.prompt) {
            eprintln!("warning: {w}");
        }
    }
    let width = a.size.unwrap_or(model.default_size() as u32);
    if width < 8 || width > 2048 || width % 8 != 0 {
        bail!("--size must be a multiple of 8 in 8..=2048, got {width}");
    }
    let strength = model.sampling.img2img_strength(a.strength);
    let cfg = DiffuserConfig {
        steps: a.steps,
        strength,
        seed: a.seed,
        guidance: a.guidance,
        techniques,
        ..DiffuserConfig::new(a.prompt.clone())
    };
    cfg.check()?;
    drop(model);

    // Outputs: a folder we may create, never a file or a link; first frame checked now.
    match std::fs::symlink_metadata(&a.out) {
        Ok(m) if m.is_dir() => {}
        Ok(m) => bail!(
            "--out {} is {}, not a folder",
            a.out.display(),
            brume::output::kind_of(&m)
        ),
        Err(_) => std::fs::create_dir_all(&a.out)
            .with_context(|| format!("creating --out {}", a.out.display()))?,
    }
    Output::new(frame_path(&a.out, 0), a.force).check()?;

    let mut source = brume_live::source::open_input(&a.input, width)?;
    let pace = if a.realtime {
        Some(a.fps.or(source.fps()).unwrap_or(30.0))
    } else {
        None
    };
    let opts = PipelineOptions {
        width,
        queue: 1,
        when_full: if a.realtime {
            WhenFull::DropOldest
        } else {
            WhenFull::Block
        },
        pace_fps: pace,
        smoothing: techniques.smoothing.then_some(SMOOTHING),
    };
    eprintln!(
        "live: {} -> {} at {width} px, {} step(s), strength {strength}, techniques {}{}",
        source.describe(),
        a.out.display(),
        a.steps,
        techniques.label(),
        match pace {
            Some(f) =>
                format!(", real time at {f:.1} FPS (frames the pipeline cannot take are dropped)"),
            None => ", every frame".into(),
        }
    );
    let max = a.max_frames.unwrap_or(u64::MAX);
    let mut limited = Limit {
        inner: source.as_mut(),
        left: max,
    };
    let (out, force) = (a.out.clone(), a.force);
    let mut written = 0u64;
    let mut sink = |i: u64, img: &RgbImage| -> brume_live::Result<()> {
        let w = brume::pipelines::image_io::save_png_to(
            img,
            &Output::new(frame_path(&out, i), force),
            None,
        )?;
        if let Some(n) = w.notice() {
            eprintln!("warning: {n}");
        }
        written += 1;
        Ok(())
    };
    let make = || -> brume_live::Result<Stage> {
        let model = model_args
            .open()
            .map_err(|e| brume_live::LiveError::Invalid(format!("{e:#}")))?;
        let d = FrameDiffuser::new(model, cfg.clone())?;
        Ok(match a.target_ms {
            Some(t) => Stage::Governed(Governed::new(
                d,
                Governor::new(t, governor_widths(width), a.steps),
            )),
            None => Stage::Plain(d),
        })
    };
    let report = if a.layout == "split" && a.target_ms.is_none() {
        let open = || {
            model_args
                .open()
                .map_err(|e| brume_live::LiveError::Invalid(format!("{e:#}")))
        };
        let (c1, c2) = (cfg.clone(), cfg.clone());
        brume_live::split::run_split(
            &mut limited,
            || EncodeStage::new(&open()?, &c1),
            || {
                let d = DenoiseStage::new(open()?, &c2)?;
                eprintln!("prompt encoded once in {:.1} ms", d.prompt_ms);
                Ok(d)
            },
            || DecodeStage::new(&open()?),
            &mut sink,
            &opts,
            1,
        )?
    } else {
        if a.layout == "split" {
            eprintln!(
                "note: --target-ms runs the governor on the shared-pool layout (--layout pool)"
            );
        }
        run_pipeline(&mut limited, make, &mut sink, &opts)?
    };
    print!("{}", report.table());
    println!("wrote {written} frames to {}", a.out.display());
    Ok(())
}

/// A source cut after `left` frames.
struct Limit<'a> {
    inner: &'a mut dyn brume_live::source::FrameSource,
    left: u64,
}

impl brume_live::source::FrameSource for Limit<'_> {
    fn next_frame(&mut self) -> brume_live::Result<Option<RgbImage>> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        self.inner.next_frame()
    }

    fn fps(&self) -> Option<f64> {
        self.inner.fps()
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}
