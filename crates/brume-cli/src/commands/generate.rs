//! `brume generate`: text to image, one job through the runtime.

use std::time::Instant;

use anyhow::bail;
use brume::pipelines::recipe::Mode;
use brume_runtime::Edit;

use super::run::{run_job, size_of, spec_from_recipe, write_outputs, GenArgs};

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
    let spec = match &from {
        Some(r) => spec_from_recipe(r, Edit::None)?,
        None => brume_runtime::JobSpec { width: a.width, height: a.height, ..g.spec(Edit::None)? },
    };
    let spec = brume_runtime::JobSpec { previews: g.previews(), unet: g.model.unet.clone(), ..spec };
    // Arguments and outputs are checked before the model opens or memory is planned.
    let outputs = g.outputs(spec.batch)?;
    g.warn_about_request(&spec.prompt);
    let report = super::memory::Report::start(g.memory.memory_report);
    let rt = g.runtime()?;
    if let Some(r) = &from {
        let hash = &rt.models()[0].hash;
        if *hash != r.model_hash {
            tracing::warn!("model fingerprint {hash} differs from the recipe's {}", r.model_hash);
        }
    }
    let start = Instant::now();
    let out = run_job(&rt, spec, g.preview_output())?;
    let paths = write_outputs(&out, &outputs)?;
    report.finish();
    let mem = brume::runtime::memory::read();
    let (w, h) = size_of(&out);
    let first = &out.images[0].recipe;
    println!(
        "wrote {} ({w}x{h}, {} steps, {}, seed {}) in {:.2} s{}",
        paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
        first.steps,
        first.sampler,
        out.seed,
        start.elapsed().as_secs_f64(),
        mem.peak_rss
            .map(|b| format!(", peak RSS {}", brume::runtime::memory::mib(b)))
            .unwrap_or_default()
    );
    Ok(())
}
