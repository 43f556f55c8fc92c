use std::time::Instant;

use anyhow::bail;
use brume::pipelines::recipe::{Mode, Recipe};
use brume::memory::{ReducedOutput, RunSize};
use brume::pipelines::txt2img;
use brume::samplers::noise_source;

use super::memory::Job;
use super::run::{cancel_flag, finish, progress_reporter, save_batch, GenArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    gen: GenArgs,
    /// Output width in pixels (default: the model's native size).
    #[arg(long)]
    width: Option<usize>,
    /// Output height in pixels (default: the model's native size).
    #[arg(long)]
    height: Option<usize>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let mut g = a.gen;
    let from = g.from_recipe()?;
    if let Some(r) = &from {
        if r.mode != Mode::Txt2img {
            bail!("{} was made by `brume edit` ({:?}); re-create it with `brume edit --from`", g.from.as_ref().map(|p| p.display().to_string()).unwrap_or_default(), r.mode);
        }
        g.model.follow(r);
    }
    let report = super::memory::Report::start(g.memory.memory_report);
    let model = g.model.open()?;
    let req = match &from {
        Some(r) => {
            let hash = brume::pipelines::recipe::model_hash(&model);
            if hash != r.model_hash {
                tracing::warn!("model fingerprint {hash} differs from the recipe's {}", r.model_hash);
            }
            r.request()?
        }
        None => g.request(&model, a.width, a.height)?,
    };
    let paths = g.outputs(req.batch)?;
    let kind = req.sampler_kind(&model)?;
    let mut recipe = Recipe::new(Mode::Txt2img, &req, kind, &model);
    let planned = g.memory.plan(&model, &req, Job::Generate)?;
    let run_model = planned.variant.as_ref().unwrap_or(&model);
    let (run_w, run_h) = planned.run_size(&req);
    let mut noise = noise_source(req.rng, req.seed);
    let mut progress = progress_reporter(g.preview.clone(), g.preview_every, cancel_flag());
    let start = Instant::now();
    let requested = (req.width, req.height);
    let req = brume::pipelines::GenerationRequest { sampler: Some(kind), width: run_w, height: run_h, ..req };
    let out = finish(txt2img(run_model, &req, &planned.opts, noise.as_mut(), None, &mut progress))?;
    let image = match planned.plan.size {
        RunSize::Reduced { output: ReducedOutput::Upscaled, .. } => resize(&out.image, requested)?,
        _ => out.image,
    };
    recipe.memory_plan = Some(planned.recipe_line());
    save_batch(&image, &paths, &recipe)?;
    report.finish();
    let mem = brume::runtime::memory::read();
    println!(
        "wrote {} ({}x{}, {} steps, {}, seed {}) in {:.2} s{}",
        paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
        image.dim(3)?,
        image.dim(2)?,
        req.steps,
        kind.cli_name(),
        req.seed,
        start.elapsed().as_secs_f64(),
        mem.peak_rss
            .map(|b| format!(", peak RSS {}", brume::runtime::memory::mib(b)))
            .unwrap_or_default()
    );
    Ok(())
}

/// Resizes images [B, 3, h, w] in [0, 1] to `(width, height)` (Lanczos), for a
/// run the memory plan made smaller than asked.
fn resize(images: &candle_core::Tensor, (width, height): (usize, usize)) -> anyhow::Result<candle_core::Tensor> {
    let mut out = Vec::new();
    for i in 0..images.dim(0)? {
        let rgb = brume::pipelines::image_io::to_rgb8(&images.get(i)?.unsqueeze(0)?)?;
        let big = image::imageops::resize(&rgb, width as u32, height as u32, image::imageops::FilterType::Lanczos3);
        out.push(((brume::pipelines::image_io::rgb_to_tensor(&big)? + 1.0)? / 2.0)?);
    }
    Ok(candle_core::Tensor::cat(&out, 0)?)
}
