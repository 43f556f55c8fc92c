use std::time::Instant;

use anyhow::bail;
use brume::pipelines::recipe::{Mode, Recipe};
use brume::pipelines::{txt2img, RunOptions};
use brume::samplers::noise_source;

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
        if g.model.model.is_none() {
            g.model.model = Some(r.model_path.clone());
        }
    }
    let budget = g.memory.budget()?;
    tracing::info!(%budget, "memory budget");
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
    let recipe = Recipe::new(Mode::Txt2img, &req, kind, &model);
    let opts = RunOptions::default();
    let mut noise = noise_source(req.rng, req.seed);
    let mut progress = progress_reporter(g.preview.clone(), g.preview_every, cancel_flag());
    let start = Instant::now();
    let req = brume::pipelines::GenerationRequest { sampler: Some(kind), ..req };
    let out = finish(txt2img(&model, &req, &opts, noise.as_mut(), None, &mut progress))?;
    save_batch(&out.image, &paths, &recipe)?;
    let mem = brume::runtime::memory::read();
    println!(
        "wrote {} ({}x{}, {} steps, {}, seed {}) in {:.2} s{}",
        paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
        req.width,
        req.height,
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
