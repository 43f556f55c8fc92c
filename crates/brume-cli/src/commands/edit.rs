use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use brume::pipelines::image_io::{load_image, load_mask};
use brume::pipelines::recipe::{InputFile, Mode, Recipe};
use brume::pipelines::{img2img, inpaint, outpaint_canvas, PasteBack};
use brume::samplers::noise_source;

use super::memory::Job;
use super::run::{cancel_flag, finish, progress_reporter, save_batch, GenArgs};

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
    if let Some(e) = &extend {
        if e.len() != 4 {
            bail!("--extend takes four numbers LEFT,TOP,RIGHT,BOTTOM, got {}", e.len());
        }
    }
    let Some(image_path) = image_path else {
        bail!("--image is required");
    };
    if mask_path.is_some() && extend.is_some() {
        bail!("give either --mask (inpaint) or --extend (outpaint), not both");
    }
    let report = super::memory::Report::start(g.memory.memory_report);
    let model = g.model.open()?;
    let factor = model.vae_config.scale_factor() as u32;
    let image = load_image(&image_path, factor)?;
    if image.size != image.original {
        eprintln!(
            "note: {}x{} is not a multiple of {factor}; working at {}x{}",
            image.original.0, image.original.1, image.size.0, image.size.1
        );
    }
    let mode = match (&mask_path, &extend) {
        (Some(_), _) => Mode::Inpaint,
        (None, Some(_)) => Mode::Outpaint,
        _ => Mode::Img2img,
    };
    let (work_image, mask) = match (mode, &mask_path, &extend) {
        (Mode::Inpaint, Some(m), _) => (image.tensor.clone(), Some(load_mask(m, &image)?)),
        (Mode::Outpaint, _, Some(e)) => {
            let e = [e[0], e[1], e[2], e[3]];
            let (canvas, m) = outpaint_canvas(&image.tensor, e, 8, factor as usize)?;
            (canvas, Some(m))
        }
        _ => (image.tensor.clone(), None),
    };
    let (_, _, h, w) = work_image.dims4()?;
    let req = match &from {
        Some(r) => r.request()?,
        None => g.request(&model, Some(w), Some(h))?,
    };
    let kind = req.sampler_kind(&model)?;
    let req = brume::pipelines::GenerationRequest {
        sampler: Some(kind),
        width: w,
        height: h,
        ..req
    };
    let strength = match mode {
        Mode::Img2img => model.sampling.img2img_strength(strength),
        _ => strength.unwrap_or(1.0),
    };
    let paths = g.outputs(req.batch)?;
    let mut recipe = Recipe::new(mode, &req, kind, &model);
    recipe.strength = Some(strength);
    recipe.image = Some(InputFile::of(&image_path)?);
    recipe.mask = mask_path.as_deref().map(InputFile::of).transpose()?;
    recipe.extend = extend.as_ref().map(|e| [e[0], e[1], e[2], e[3]]);
    recipe.feather = (mode != Mode::Img2img).then_some(feather);

    let planned = g.memory.plan(&model, &req, Job::Edit)?;
    let opts = planned.opts.clone();
    let model = planned.variant.as_ref().unwrap_or(&model);
    let mut noise = noise_source(req.rng, req.seed);
    let mut progress = progress_reporter(g.preview.clone(), g.preview_every, cancel_flag());
    let start = Instant::now();
    let out = match &mask {
        None => finish(img2img(model, &req, &work_image, strength, &opts, noise.as_mut(), None, &mut progress))?,
        Some(m) => finish(inpaint(
            model,
            &req,
            &work_image,
            m,
            strength,
            Some(PasteBack { feather }),
            &opts,
            noise.as_mut(),
            None,
            &mut progress,
        ))?,
    };
    recipe.memory_plan = Some(planned.recipe_line());
    save_batch(&out.image, &paths, &recipe).context("saving")?;
    report.finish();
    println!(
        "wrote {} ({mode:?}, {}x{}, strength {strength}, {} steps, {}, seed {}) in {:.2} s",
        paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
        w,
        h,
        req.steps,
        kind.cli_name(),
        req.seed,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
