//! `brume edit`: img2img, inpainting and outpainting of a picture, one job
//! through the runtime.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::bail;
use brume::pipelines::recipe::{InputFile, Mode};
use brume_runtime::{Edit, InputImage, JobSpec};

use super::run::{run_job, size_of, spec_from_recipe, write_outputs, GenArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    gen: GenArgs,
    /// The picture to edit (PNG, JPEG or WebP; sides are rounded down to a multiple of 8).
    #[arg(long)]
    image: Option<PathBuf>,
    /// Inpainting: white where the picture should change (same size as the image).
    #[arg(long)]
    mask: Option<PathBuf>,
    /// Outpainting: pixels to add as LEFT,TOP,RIGHT,BOTTOM (e.g. 0,0,128,0).
    #[arg(long, value_delimiter = ',')]
    extend: Option<Vec<usize>>,
    /// How much to change: 0 keeps the image, 1 repaints fully (img2img default: the
    /// model's own in its sampling_defaults.json, else 0.6; inpainting and outpainting 1.0).
    #[arg(long)]
    strength: Option<f64>,
    /// Inpainting: feather the pasted edge over this many pixels inside the mask.
    #[arg(long, default_value_t = 4)]
    feather: usize,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let mut g = a.gen;
    let from = g.from_recipe()?;
    let (image_path, mask_path, extend, strength, feather) = match &from {
        Some(r) => {
            if r.mode == Mode::Txt2img {
                bail!("this recipe is a txt2img one; re-create it with `brume generate --from`");
            }
            let check = |f: &Option<InputFile>| -> anyhow::Result<Option<PathBuf>> {
                let Some(f) = f else { return Ok(None) };
                let now = InputFile::of(&f.path)?;
                if now.sha256 != f.sha256 {
                    bail!("{} has changed since the image was made (sha256 differs)", f.path.display());
                }
                Ok(Some(f.path.clone()))
            };
            g.model.follow(r);
            (check(&r.image)?, check(&r.mask)?, r.extend.map(|e| e.to_vec()), r.strength, r.feather.unwrap_or(a.feather))
        }
        None => (a.image.clone(), a.mask.clone(), a.extend.clone(), a.strength, a.feather),
    };
    let extend = match extend.as_deref() {
        None => None,
        Some([l, t, r, b]) => Some([*l, *t, *r, *b]),
        Some(e) => bail!("--extend takes four numbers LEFT,TOP,RIGHT,BOTTOM, got {}", e.len()),
    };
    let Some(image_path) = image_path else {
        bail!("--image is required");
    };
    if mask_path.is_some() && extend.is_some() {
        bail!("give either --mask (inpaint) or --extend (outpaint), not both");
    }
    let image = InputImage::from_path(&image_path)?;
    let (w, h) = image.size();
    if w % 8 != 0 || h % 8 != 0 {
        eprintln!("note: {w}x{h} is not a multiple of 8; working at {}x{}", w - w % 8, h - h % 8);
    }
    let edit = match (&mask_path, extend) {
        (Some(m), _) => Edit::Inpaint { image, mask: InputImage::from_path(m)?, strength, feather },
        (None, Some(extend)) => Edit::Outpaint { image, extend, feather },
        (None, None) => Edit::Img2img { image, strength },
    };
    let mode = edit.mode();
    let spec = match &from {
        Some(r) => spec_from_recipe(r, edit)?,
        None => g.spec(edit)?,
    };
    let spec = JobSpec { previews: g.previews(), unet: g.model.unet.clone(), ..spec };
    // Arguments and outputs are checked before the model opens or memory is planned.
    let outputs = g.outputs(spec.batch)?;
    g.warn_about_request(&spec.prompt);
    for o in &outputs {
        for input in [Some(&image_path), mask_path.as_ref()].into_iter().flatten() {
            if brume::output::same_file(&o.path, input) {
                bail!("{} is an input of this edit; write the result to another file", o.path.display());
            }
        }
    }
    let report = super::memory::Report::start(g.memory.memory_report);
    let rt = g.runtime()?;
    let start = Instant::now();
    let out = run_job(&rt, spec, g.preview_output())?;
    let paths = write_outputs(&out, &outputs)?;
    report.finish();
    let (w, h) = size_of(&out);
    let first = &out.images[0].recipe;
    println!(
        "wrote {} ({mode:?}, {w}x{h}, strength {}, {} steps, {}, seed {}) in {:.2} s",
        paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
        first.strength.unwrap_or(1.0),
        first.steps,
        first.sampler,
        out.seed,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
