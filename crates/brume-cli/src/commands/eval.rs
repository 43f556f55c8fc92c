//! `brume eval adherence`: prompt adherence measured by the world's judge on
//! held-out prompts, with a contact sheet a person can look at.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use brume::pipelines::image_io::{save_png, to_rgb8};
use brume::pipelines::{txt2img, Flow, GenerationRequest, RunOptions};
use brume::samplers::{noise_source, RngKind, SamplerKind};

use super::ModelArgs;

#[derive(clap::Subcommand, Debug)]
pub enum Eval {
    /// Per-attribute accuracy of generated images on held-out prompts.
    Adherence(AdherenceArgs),
}

#[derive(clap::Args, Debug)]
pub struct AdherenceArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Number of held-out prompts (fixed list, fixed seeds).
    #[arg(long, default_value_t = 200)]
    count: usize,
    #[arg(long, default_value_t = 25)]
    steps: usize,
    #[arg(long, default_value_t = 5.0)]
    guidance: f64,
    #[arg(long)]
    sampler: Option<String>,
    /// Contact sheet PNG (prompts listed in a .txt beside it).
    #[arg(long, default_value = "adherence.png")]
    sheet: PathBuf,
    /// Images per contact-sheet row.
    #[arg(long, default_value_t = 16)]
    columns: u32,
}

pub fn run(e: Eval) -> anyhow::Result<()> {
    match e {
        Eval::Adherence(a) => adherence(a),
    }
}

fn adherence(a: AdherenceArgs) -> anyhow::Result<()> {
    if a.count == 0 || a.columns == 0 {
        bail!("--count and --columns must be positive");
    }
    let model = a.model.open()?;
    let size = model.default_size();
    let prompts = brume_world::scene::held_out_prompts(a.count);
    let sampler = a.sampler.as_deref().map(SamplerKind::parse).transpose()?;
    let opts = RunOptions::default();
    let mut tally: BTreeMap<&'static str, (usize, usize)> = BTreeMap::new();
    let mut all_correct = 0usize;
    let mut tiles = Vec::with_capacity(prompts.len());
    let start = Instant::now();
    for (i, (caption, seed)) in prompts.iter().enumerate() {
        let spec = brume_world::caption::parse_caption(caption)
            .map_err(|e| anyhow::anyhow!("held-out prompt `{caption}` does not parse: {e}"))?;
        let req = GenerationRequest {
            steps: a.steps,
            guidance_scale: a.guidance,
            seed: *seed,
            rng: RngKind::Brume,
            sampler,
            ..GenerationRequest::new(caption.clone(), size)
        };
        let mut noise = noise_source(req.rng, req.seed);
        let out = txt2img(&model, &req, &opts, noise.as_mut(), None, &mut |_| Flow::Continue)?;
        let img = to_rgb8(&out.image)?;
        let verdict = brume_world::judge::judge(&img, &spec);
        for (name, ok) in verdict.attributes() {
            let e = tally.entry(name).or_default();
            e.0 += ok as usize;
            e.1 += 1;
        }
        all_correct += verdict.all_correct() as usize;
        tiles.push(img);
        eprint!("\r{}/{}", i + 1, prompts.len());
    }
    eprintln!();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "prompt adherence of {} on {} held-out prompts ({} steps, guidance {}, {} px)",
        model.name,
        prompts.len(),
        a.steps,
        a.guidance,
        size
    );
    println!("{:<20} {:>9} {:>8}", "attribute", "accuracy", "n");
    for (name, (ok, n)) in &tally {
        println!("{:<20} {:>8.1}% {:>8}", name, 100.0 * *ok as f64 / *n as f64, n);
    }
    println!("{:<20} {:>8.1}% {:>8}", "all attributes", 100.0 * all_correct as f64 / prompts.len() as f64, prompts.len());
    println!("{:.2} images/s ({:.1} s in all)", prompts.len() as f64 / secs, secs);

    // Contact sheet: tiles in prompt order, prompts in a text file beside it.
    let tile = size as u32;
    let cols = a.columns.min(tiles.len() as u32);
    let rows = (tiles.len() as u32).div_ceil(cols);
    let mut sheet = image::RgbImage::from_pixel(cols * (tile + 2), rows * (tile + 2), image::Rgb([255, 255, 255]));
    for (i, t) in tiles.iter().enumerate() {
        let (x, y) = ((i as u32 % cols) * (tile + 2) + 1, (i as u32 / cols) * (tile + 2) + 1);
        image::imageops::replace(&mut sheet, t, x as i64, y as i64);
    }
    save_png(&sheet, &a.sheet, None).with_context(|| format!("writing {}", a.sheet.display()))?;
    let listing: String = prompts
        .iter()
        .enumerate()
        .map(|(i, (c, s))| format!("{:>4} row {} col {}  seed {s}  {c}\n", i, i as u32 / cols, i as u32 % cols))
        .collect();
    let txt = a.sheet.with_extension("txt");
    std::fs::write(&txt, listing).with_context(|| format!("writing {}", txt.display()))?;
    println!("contact sheet {} (prompts: {})", a.sheet.display(), txt.display());
    Ok(())
}
