//! `brume eval edits`: how well img2img and inpainting follow an edit prompt, graded by the
//! world's judge like `eval adherence` grades text-to-image.
//!
//! Each case is a held-out prompt and two renders of its scene with the first object changed
//! (`brume_world::edits`): img2img is asked to turn the *recoloured* render into the prompt
//! (the object keeps its shape and place, only its colour is wrong), inpainting to repaint the
//! *replaced* render's first object (another shape in another colour) inside a mask over it.
//! The verdict against the prompt then says both whether the edit happened (the first object's
//! colour and shape) and whether the rest survived it (background, the other object, places).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use brume::pipelines::image_io::{gray_to_mask, rgb_to_tensor, to_rgb8};
use brume::pipelines::{img2img, inpaint, ConditioningCache, Flow, PasteBack};
use brume::samplers::noise_source;
use brume_world::{edit_cases, object_mask, render};

use super::eval::{sheet, sheet_outputs, HeldOutArgs, Tally};
use super::memory::Job;

#[derive(clap::Args, Debug)]
pub struct EditsArgs {
    #[command(flatten)]
    held: HeldOutArgs,
    /// img2img strength (default: the model's own, as `brume edit` takes it: 0.6 for the
    /// built-in DDIM UNet, 0.75 for its four-step LCM UNet).
    #[arg(long)]
    strength: Option<f64>,
    /// Inpainting strength (`brume edit`'s default: 1.0, a full repaint inside the mask).
    #[arg(long, default_value_t = 1.0)]
    inpaint_strength: f64,
    /// The inpainting mask: the first object's box grown by this fraction of the side on
    /// every edge, then out to whole latent cells.
    #[arg(long, default_value_t = 0.04)]
    mask_margin: f64,
    /// Contact sheet PNG: per case, the recoloured source, its img2img edit, the replaced
    /// source and its inpainted edit (the legend goes to a .txt beside it).
    #[arg(long, default_value = "edits.png")]
    sheet: PathBuf,
    /// Cases per contact-sheet row (four pictures each).
    #[arg(long, default_value_t = 4)]
    columns: u32,
    /// Replace the sheet and its legend if they exist (regular files only).
    #[arg(long)]
    force: bool,
}

/// The edits' own rows: whether the first object became what the prompt asks for. The other
/// rows of the table (background, the second object, position, relation) are what the edit
/// had to keep.
const EDITED_COLOUR: &str = "edited colour";
const EDITED_SHAPE: &str = "edited shape";

pub fn edits(a: EditsArgs) -> anyhow::Result<()> {
    if a.columns == 0 {
        bail!("--columns must be positive");
    }
    for (name, s) in [("--strength", a.strength), ("--inpaint-strength", Some(a.inpaint_strength))] {
        if let Some(s) = s.filter(|&s| !brume::pipelines::img2img::strength_in_range(s)) {
            bail!("{name} must be in (0, 1], got {s}");
        }
    }
    if !(0.0..=0.5).contains(&a.mask_margin) {
        bail!("--mask-margin is a fraction of the picture's side in [0, 0.5], got {}", a.mask_margin);
    }
    let outs = sheet_outputs(&a.sheet, a.force)?;
    let (model, run) = a.held.open(0.0)?;
    let size = model.default_size();
    let cell = model.vae_config.scale_factor() as u32;
    let strength = model.sampling.img2img_strength(a.strength);
    let opts = a.held.memory.plan(&model, &run.request("", 0, size), Job::Edit)?.opts;

    // A 9-channel inpainting UNet has no img2img (it needs a mask): its inpainting is still graded.
    let inpainting_unet = model.unet_config.in_channels != model.vae_config.latent_channels();
    let start = Instant::now();
    let cases = edit_cases(run.from, run.count);
    let (mut recolour, mut replace) = (Tally::default(), Tally::default());
    // Both edits of a case ask for the same prompt: its text encoding is computed once.
    let mut cache = ConditioningCache::new(1);
    let mut tiles = Vec::with_capacity(4 * cases.len());
    for (i, case) in cases.iter().enumerate() {
        let spec = brume_world::parse_caption(&case.caption)
            .map_err(|e| anyhow::anyhow!("held-out prompt `{}` does not parse: {e}", case.caption))?;
        let req = run.request(&case.caption, case.seed, size);
        let judged = |tally: &mut Tally, img: &image::RgbImage, edited_shape: bool| {
            let verdict = brume_world::judge(img, &spec);
            tally.add(&spec, &verdict);
            tally.count(EDITED_COLOUR, verdict.objects[0].colour);
            if edited_shape {
                tally.count(EDITED_SHAPE, verdict.objects[0].shape);
            }
        };

        let source = render(&case.recoloured, size as u32);
        if inpainting_unet {
            // A grey tile keeps the sheet's four columns a case.
            tiles.extend([source, image::RgbImage::from_pixel(size as u32, size as u32, image::Rgb([128, 128, 128]))]);
        } else {
            let mut noise = noise_source(req.rng, req.seed);
            let out = img2img(&model, &req, &rgb_to_tensor(&source)?, strength, &opts, noise.as_mut(), Some(&mut cache), &mut |_| Flow::Continue)
                .with_context(|| format!("img2img towards `{}`", case.caption))?;
            let edited = to_rgb8(&out.image)?;
            judged(&mut recolour, &edited, false);
            tiles.extend([source, edited]);
        }

        let source = render(&case.replaced, size as u32);
        let mask = gray_to_mask(&object_mask(&case.replaced, 0, size as u32, a.mask_margin, cell))?;
        let mut noise = noise_source(req.rng, req.seed);
        let out = inpaint(
            &model,
            &req,
            &rgb_to_tensor(&source)?,
            &mask,
            a.inpaint_strength,
            Some(PasteBack { feather: 4 }),
            &opts,
            noise.as_mut(),
            Some(&mut cache),
            &mut |_| Flow::Continue,
        )
        .with_context(|| format!("inpainting towards `{}`", case.caption))?;
        let edited = to_rgb8(&out.image)?;
        judged(&mut replace, &edited, true);
        tiles.extend([source, edited]);
        eprint!("\r{}/{}", i + 1, cases.len());
    }
    eprintln!();
    let secs = start.elapsed().as_secs_f64();
    let title = |what: &str| {
        println!(
            "{what} of {} ({}) towards {} held-out prompts{} ({}, {} px)",
            model.name,
            model.unet_folder,
            cases.len(),
            if run.from > 0 { format!(" from #{}", run.from) } else { String::new() },
            run.describe(),
            size
        )
    };
    if inpainting_unet {
        println!("img2img: skipped, {} ({}) is a {}-channel inpainting UNet, which needs a mask", model.name, model.unet_folder, model.unet_config.in_channels);
    } else {
        title(&format!("img2img at strength {strength}: the first object recoloured"));
        recolour.print();
    }
    println!();
    title(&format!("inpainting at strength {}: the first object replaced (another shape and colour) inside a mask over it", a.inpaint_strength));
    replace.print();
    println!("{:.2} cases/s, an img2img and an inpainting each ({:.1} s in all)", cases.len() as f64 / secs, secs);

    let cols = 4 * (a.columns as usize).min(cases.len());
    let rows: Vec<Vec<image::RgbImage>> = tiles.chunks(cols).map(<[_]>::to_vec).collect();
    let sheet_img = sheet(&rows, size as u32);
    let per_row = cols / 4;
    let listing: String = std::iter::once(
        "each case: recoloured source | img2img edit | replaced source | inpainted edit (mask: the first object's box)\n".to_string(),
    )
    .chain(cases.iter().enumerate().map(|(i, c)| {
        format!("{:>4} row {} cols {}-{}  seed {}  {}\n", run.from + i, i / per_row, 4 * (i % per_row), 4 * (i % per_row) + 3, c.seed, c.caption)
    }))
    .collect();
    let (png, txt) = outs.write(&sheet_img, &listing)?;
    println!("contact sheet {} (prompts: {})", png.display(), txt.display());
    Ok(())
}
