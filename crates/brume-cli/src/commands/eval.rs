//! `brume eval adherence`: prompt adherence measured by the world's judge on
//! held-out prompts, with a contact sheet a person can look at.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::bail;
use brume::output::Output;
use brume::pipelines::image_io::{save_png_to, to_rgb8};
use brume::pipelines::{txt2img, Flow, GenerationRequest};
use brume::samplers::{noise_source, RngKind, SamplerKind};

use super::memory::Job;
use super::{MemoryArgs, ModelArgs};

#[derive(clap::Subcommand, Debug)]
pub enum Eval {
    /// Per-attribute accuracy of generated images on held-out prompts.
    Adherence(AdherenceArgs),
    /// A contact sheet of every sampler (txt2img) and every editing pipeline on one prompt.
    Showcase(ShowcaseArgs),
    /// Per-attribute accuracy of img2img and inpainting edits towards held-out prompts.
    Edits(super::eval_edits::EditsArgs),
}

#[derive(clap::Args, Debug)]
pub struct ShowcaseArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    memory: MemoryArgs,
    #[arg(long, default_value = "a large red circle on the left on a blue background")]
    prompt: String,
    /// Prompt for the edits (img2img, inpaint, outpaint) of the txt2img picture.
    #[arg(long, default_value = "a large yellow star on the left on a blue background")]
    edit_prompt: String,
    /// Steps of every sampler but the few-step ones, which run 4 (one count for all, so
    /// the samplers compare).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Guidance (default: each UNet's own recommendation, as `brume generate` takes it).
    #[arg(long)]
    guidance: Option<f64>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, default_value = "showcase.png")]
    out: PathBuf,
    /// Replace the sheet and its legend if they exist (regular files only).
    #[arg(long)]
    force: bool,
}

/// What the held-out evals share: the model, which prompts, and how they are sampled.
#[derive(clap::Args, Debug)]
pub struct HeldOutArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub memory: MemoryArgs,
    /// Number of held-out prompts (fixed list, fixed seeds).
    #[arg(long, default_value_t = 200)]
    pub count: usize,
    /// Skip the first N held-out prompts. The quality bars are read on prompts 0..200; a
    /// setting (sampler, steps, guidance, gamma, strength) chosen by looking at those would
    /// be tuned to the benchmark, so choose it on a later stretch (e.g. `--from 200 --count
    /// 400`) and then read the bars once.
    #[arg(long, default_value_t = 0)]
    pub from: usize,
    /// Denoising steps (default: the model's recommendation for its own scheduler, as
    /// `brume generate` and `brume edit` take it: 25 for the built-in model's DDIM; else 4
    /// for lcm and tcd and 20 for the rest). img2img runs the last `strength` share of them.
    #[arg(long)]
    pub steps: Option<usize>,
    /// Guidance scale (default: the model's recommendation, as `brume generate` takes it).
    #[arg(long)]
    pub guidance: Option<f64>,
    #[arg(long)]
    pub sampler: Option<String>,
}

impl HeldOutArgs {
    /// Opens the model and resolves the run's settings; checks the prompt range first, so a
    /// mistyped number fails before any model is loaded.
    pub fn open(&self, eta: f64) -> anyhow::Result<(brume::pipelines::SdModel, HeldOutRun)> {
        if self.count == 0 {
            bail!("--count must be positive");
        }
        held_out_end(self.from, self.count)?;
        let model = self.model.open()?;
        let sampler = self.sampler.as_deref().map(SamplerKind::parse).transpose()?;
        let kind = model.sampler_kind(sampler)?;
        let settings = model.sampling_settings(kind, self.steps, self.guidance)?;
        let run = HeldOutRun { from: self.from, count: self.count, steps: settings.steps, guidance: settings.guidance_scale, eta, kind };
        Ok((model, run))
    }
}

/// The end of held-out prompts `from..from + count`, refused past [`MAX_HELD_OUT`].
pub(super) fn held_out_end(from: usize, count: usize) -> anyhow::Result<usize> {
    from.checked_add(count)
        .filter(|&e| e <= MAX_HELD_OUT)
        .ok_or_else(|| anyhow::anyhow!("--from {from} + --count {count} is past the {MAX_HELD_OUT} held-out prompts the eval draws from"))
}

#[derive(clap::Args, Debug)]
pub struct AdherenceArgs {
    #[command(flatten)]
    held: HeldOutArgs,
    /// DDIM eta / TCD gamma (0 = deterministic).
    #[arg(long, default_value_t = 0.0)]
    eta: f64,
    /// Contact sheet PNG (prompts listed in a .txt beside it).
    #[arg(long, default_value = "adherence.png")]
    sheet: PathBuf,
    /// Images per contact-sheet row.
    #[arg(long, default_value_t = 16)]
    columns: u32,
    /// Replace the sheet and its legend if they exist (regular files only).
    #[arg(long)]
    force: bool,
}

pub fn run(e: Eval) -> anyhow::Result<()> {
    match e {
        Eval::Adherence(a) => adherence(a),
        Eval::Showcase(a) => showcase(a),
        Eval::Edits(a) => super::eval_edits::edits(a),
    }
}

/// Lays out tiles in rows with a 2-px grey grid (grey, so a white tile such as a mask keeps its edges).
/// Each tile is scaled to `tile` pixels high and keeps its aspect ratio, so a wider picture (an
/// outpainted canvas) shows its whole width and a seam would be visible.
pub(super) fn sheet(rows: &[Vec<image::RgbImage>], tile: u32) -> image::RgbImage {
    let width_of = |t: &image::RgbImage| (u64::from(t.width()) * u64::from(tile) / u64::from(t.height().max(1))).max(1) as u32;
    let row_width = |r: &Vec<image::RgbImage>| r.iter().map(|t| width_of(t) + 2).sum::<u32>();
    let width = rows.iter().map(row_width).max().unwrap_or(0).max(tile + 2);
    let mut out = image::RgbImage::from_pixel(width, rows.len() as u32 * (tile + 2), image::Rgb([128, 128, 128]));
    for (r, row) in rows.iter().enumerate() {
        let mut x = 1u32;
        for t in row {
            let w = width_of(t);
            let y = i64::from(r as u32 * (tile + 2) + 1);
            // A tile already tile-high is copied as it is, so the sheet shows the generated pixels.
            let scaled;
            let t = if t.height() == tile {
                t
            } else {
                scaled = image::imageops::resize(t, w, tile, image::imageops::FilterType::Triangle);
                &scaled
            };
            image::imageops::replace(&mut out, t, i64::from(x), y);
            x += w + 2;
        }
    }
    out
}

/// A contact sheet and its legend (a `.txt` beside it), both written by the
/// output rule ([`brume::output`]): checked before any image is generated
/// (a sheet named `.txt` would be overwritten by its own legend; an existing
/// file needs --force, and never a symlink or anything not a regular file).
pub(super) struct SheetOutputs {
    sheet: Output,
    listing: Output,
}

pub(super) fn sheet_outputs(sheet: &std::path::Path, force: bool) -> anyhow::Result<SheetOutputs> {
    let txt = sheet.with_extension("txt");
    if txt == sheet {
        bail!("{}: the contact sheet is a PNG and its legend goes to a .txt beside it; give the sheet a .png name", sheet.display());
    }
    let outs = SheetOutputs { sheet: Output::new(sheet, force), listing: Output::new(txt, force) };
    outs.sheet.check()?;
    outs.listing.check()?;
    if let Some(w) = brume::output::png_extension_warning(sheet) {
        eprintln!("warning: {w}");
    }
    Ok(outs)
}

impl SheetOutputs {
    /// Writes both; returns where they went (a name taken during the run is
    /// kept and the file goes next to it, with a warning).
    pub(super) fn write(&self, img: &image::RgbImage, listing: &str) -> anyhow::Result<(PathBuf, PathBuf)> {
        let s = save_png_to(img, &self.sheet, None)?;
        let l = self.listing.write_bytes(listing.as_bytes())?;
        for w in [&s, &l] {
            if let Some(note) = w.notice() {
                eprintln!("warning: {note}");
            }
        }
        Ok((s.path, l.path))
    }
}

fn showcase(a: ShowcaseArgs) -> anyhow::Result<()> {
    let outs = sheet_outputs(&a.out, a.force)?;
    let model = a.model.open()?;
    let size = model.default_size();
    let own = model.sampler_kind(None)?;
    let base = GenerationRequest {
        steps: a.steps,
        guidance_scale: model.sampling_settings(own, None, a.guidance)?.guidance_scale,
        seed: a.seed,
        ..GenerationRequest::new(a.prompt.clone(), size)
    };
    // The few-step samplers run the model's distilled UNet (unet_lcm/) when it ships one.
    let distilled = if a.model.unet.is_none() {
        let mut m = a.model.clone();
        m.unet = Some("unet_lcm".into());
        m.open().ok()
    } else {
        None
    };
    // Every picture of the sheet has the native size; the edits need the VAE encoder too.
    let opts = a.memory.plan(&model, &base, Job::Edit)?.opts;
    let mut listing = String::new();
    let mut samplers_row = Vec::new();
    for &kind in SamplerKind::ALL {
        // Few-step samplers are shown at the step counts they are made for.
        let steps = if kind.is_few_step() { 4 } else { a.steps };
        let m = match &distilled {
            Some(d) if kind.is_few_step() => d,
            _ => &model,
        };
        let guidance_scale = m.sampling_settings(kind, None, a.guidance)?.guidance_scale;
        let req = GenerationRequest { sampler: Some(kind), steps, guidance_scale, ..base.clone() };
        let mut noise = noise_source(req.rng, req.seed);
        let out = txt2img(m, &req, &opts, noise.as_mut(), None, &mut |_| Flow::Continue)?;
        samplers_row.push(to_rgb8(&out.image)?);
        listing.push_str(&format!(
            "row 0 col {}: txt2img, {}, {steps} steps, guidance {guidance_scale}, {}\n",
            samplers_row.len() - 1,
            kind.cli_name(),
            m.unet_folder
        ));
    }
    // Edits of the DDIM picture.
    let source = &samplers_row[0];
    let image = brume::pipelines::image_io::rgb_to_tensor(source)?;
    let edit = GenerationRequest { prompt: a.edit_prompt.clone(), ..base.clone() };
    let mut edits = vec![source.clone()];
    let mut noise = noise_source(edit.rng, edit.seed);
    let strength = model.sampling.img2img_strength(None);
    let out = brume::pipelines::img2img(&model, &edit, &image, strength, &opts, noise.as_mut(), None, &mut |_| Flow::Continue)?;
    edits.push(to_rgb8(&out.image)?);
    let s = size as u32;
    let mask_img = image::GrayImage::from_fn(s, s, |x, _| image::Luma([if x < s / 2 { 255 } else { 0 }]));
    let mask = brume::pipelines::image_io::gray_to_mask(&mask_img)?;
    let mut noise = noise_source(edit.rng, edit.seed);
    let out = brume::pipelines::inpaint(
        &model,
        &edit,
        &image,
        &mask,
        1.0,
        Some(brume::pipelines::PasteBack { feather: 4 }),
        &opts,
        noise.as_mut(),
        None,
        &mut |_| Flow::Continue,
    )?;
    edits.push(image::DynamicImage::ImageLuma8(mask_img).to_rgb8());
    edits.push(to_rgb8(&out.image)?);
    let f = model.vae_config.scale_factor();
    let (canvas, omask) = brume::pipelines::outpaint_canvas(&image, [0, 0, size / 2, 0], f, f)?;
    let mut noise = noise_source(edit.rng, edit.seed);
    let out = brume::pipelines::inpaint(
        &model,
        &base,
        &canvas,
        &omask,
        1.0,
        Some(brume::pipelines::PasteBack { feather: 4 }),
        &opts,
        noise.as_mut(),
        None,
        &mut |_| Flow::Continue,
    )?;
    edits.push(to_rgb8(&out.image)?);
    listing.push_str(&format!("row 1: source (ddim) | img2img {strength} (edit prompt) | inpaint mask | inpainted left half (edit prompt) | outpainted by half a tile to the right (prompt), at its full width\n"));
    let img = sheet(&[samplers_row, edits], size as u32);
    let (png, txt) = outs.write(&img, &format!("prompt: {}\nedit prompt: {}\n{listing}", a.prompt, a.edit_prompt))?;
    println!("wrote {} (legend: {})", png.display(), txt.display());
    Ok(())
}

/// Per-attribute (correct, judged) counts, how many images had every attribute right, and
/// what the judge saw where an object's colour or shape was asked for.
#[derive(Default)]
pub struct Tally {
    pub attributes: BTreeMap<&'static str, (usize, usize)>,
    pub all_correct: usize,
    pub images: usize,
    /// Objects' colours and shapes by what the caption asked for: what the judge saw.
    pub asked: BTreeMap<(&'static str, String), Asked>,
}

impl Tally {
    pub fn count(&mut self, name: &'static str, ok: bool) {
        let e = self.attributes.entry(name).or_default();
        e.0 += ok as usize;
        e.1 += 1;
    }

    /// Adds one judged image.
    pub fn add(&mut self, spec: &brume_world::Spec, verdict: &brume_world::Verdict) {
        for (name, ok) in verdict.attributes() {
            self.count(name, ok);
        }
        // The shape once more by the size the caption asks for: small objects span three
        // or four latent cells of a 128 px image, and that is where shapes are lost.
        for (o, v) in spec.objects.iter().zip(&verdict.objects) {
            let seen = v.detected.as_ref();
            self.asked.entry(("colour", o.colour.to_string())).or_default().add(v.colour, seen.map(|d| d.colour.to_string()));
            self.asked.entry(("shape", o.shape.to_string())).or_default().add(v.shape, seen.map(|d| d.shape.to_string()));
            match o.size {
                Some(brume_world::scene::Size::Small) => self.count("shape_small", v.shape),
                Some(brume_world::scene::Size::Large) => self.count("shape_large", v.shape),
                None => {}
            }
        }
        self.all_correct += verdict.all_correct() as usize;
        self.images += 1;
    }

    /// The accuracy table with 95 % intervals, then the colours and shapes most often
    /// missed and what came out instead.
    pub fn print(&self) {
        println!("{:<20} {:>9} {:>8} {:>15}", "attribute", "accuracy", "n", "95% interval");
        let row = |name: &str, ok: usize, n: usize| {
            let (lo, hi) = wilson_interval(ok, n);
            println!("{:<20} {:>8.1}% {:>8} {:>6.1} - {:>5.1}", name, 100.0 * ok as f64 / n.max(1) as f64, n, 100.0 * lo, 100.0 * hi);
        };
        for (name, &(ok, n)) in &self.attributes {
            row(name, ok, n);
        }
        row("all attributes", self.all_correct, self.images);
        // Which colours and shapes a model misses, and what it draws instead: where the next
        // training run should look.
        for what in ["colour", "shape"] {
            println!("{:<20} {:>9} {:>8}   seen instead (top 3)", format!("by {what} asked for"), "accuracy", "n");
            for ((_, name), a) in self.asked.iter().filter(|((w, _), _)| *w == what) {
                let mut instead: Vec<(&String, &usize)> = a.instead.iter().collect();
                instead.sort_by(|x, y| y.1.cmp(x.1).then(x.0.cmp(y.0)));
                let instead: Vec<String> = instead.iter().take(3).map(|(k, v)| format!("{k} {v}")).collect();
                println!("  {:<18} {:>8.1}% {:>8}   {}", name, 100.0 * a.ok as f64 / a.n.max(1) as f64, a.n, instead.join(", "));
            }
        }
    }
}

/// The scores of one run over held-out prompts.
pub struct Adherence {
    pub tally: Tally,
    pub prompts: Vec<(String, u64)>,
    pub run: HeldOutRun,
}

/// How often one asked-for value (a colour, a shape) came out right, and what came out instead.
#[derive(Default)]
pub struct Asked {
    pub ok: usize,
    pub n: usize,
    /// What the judge saw instead ("nothing" where it found no object for it), with counts.
    pub instead: BTreeMap<String, usize>,
}

impl Asked {
    fn add(&mut self, ok: bool, seen: Option<String>) {
        self.n += 1;
        if ok {
            self.ok += 1;
        } else {
            *self.instead.entry(seen.unwrap_or_else(|| "nothing".into())).or_default() += 1;
        }
    }
}

/// The most held-out prompts an eval draws: listing them is a search through the scene
/// generator (one spec in 20 is held out), and at about a second an image this is a day of
/// rendering, so anything past it is a mistyped number rather than an evaluation.
pub(super) const MAX_HELD_OUT: usize = 100_000;

/// Which held-out prompts to render and how.
#[derive(Clone, Copy, Debug)]
pub struct HeldOutRun {
    /// Held-out prompts `from..from + count` (the bars are read on `0..200`).
    pub from: usize,
    pub count: usize,
    pub steps: usize,
    pub guidance: f64,
    pub eta: f64,
    pub kind: SamplerKind,
}

impl HeldOutRun {
    /// The benchmark's own prompts at the given settings (the model's defaults, for the bars).
    pub fn bars(count: usize, settings: brume::pipelines::sampling_defaults::Resolved, kind: SamplerKind) -> Self {
        Self { from: 0, count, steps: settings.steps, guidance: settings.guidance_scale, eta: 0.0, kind }
    }

    /// The request for one held-out prompt: its own seed, brume's RNG, the run's settings.
    pub fn request(&self, prompt: &str, seed: u64, size: usize) -> GenerationRequest {
        GenerationRequest {
            steps: self.steps,
            guidance_scale: self.guidance,
            seed,
            rng: RngKind::Brume,
            eta: self.eta,
            sampler: Some(self.kind),
            ..GenerationRequest::new(prompt, size)
        }
    }

    /// The settings as a title line prints them.
    pub fn describe(&self) -> String {
        format!(
            "{}, {} steps, guidance {}{}",
            self.kind.cli_name(),
            self.steps,
            self.guidance,
            if self.eta != 0.0 { format!(", eta {}", self.eta) } else { String::new() }
        )
    }
}

/// Generates held-out prompts (fixed seeds, brume RNG) at the model's native
/// size and judges each image against its caption.
pub fn judge_held_out(
    model: &brume::pipelines::SdModel,
    run: &HeldOutRun,
    opts: &brume::pipelines::RunOptions,
) -> anyhow::Result<(Adherence, Vec<image::RgbImage>)> {
    let size = model.default_size();
    let end = held_out_end(run.from, run.count)?;
    let prompts = brume_world::scene::held_out_prompts(end).split_off(run.from);
    let mut tally = Tally::default();
    let mut tiles = Vec::with_capacity(prompts.len());
    for (i, (caption, seed)) in prompts.iter().enumerate() {
        let spec = brume_world::caption::parse_caption(caption)
            .map_err(|e| anyhow::anyhow!("held-out prompt `{caption}` does not parse: {e}"))?;
        let req = run.request(caption, *seed, size);
        let mut noise = noise_source(req.rng, req.seed);
        let out = txt2img(model, &req, opts, noise.as_mut(), None, &mut |_| Flow::Continue)?;
        let img = to_rgb8(&out.image)?;
        tally.add(&spec, &brume_world::judge::judge(&img, &spec));
        tiles.push(img);
        eprint!("\r{}/{}", i + 1, prompts.len());
    }
    Ok((Adherence { tally, prompts, run: *run }, tiles))
}

/// The Wilson score interval (95 %) of `ok` successes in `n` trials.
///
/// Printed beside each accuracy because the held-out set is small for some attributes
/// (about 100 two-object relations in 200 prompts): there a 5-point difference between two
/// samplers or two runs is inside the noise, and a reader comparing them needs to see that.
fn wilson_interval(ok: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    const Z: f64 = 1.959_963_984_540_054;
    let (n, p) = (n as f64, ok as f64 / n as f64);
    let z2 = Z * Z;
    let centre = (p + z2 / (2.0 * n)) / (1.0 + z2 / n);
    let half = Z * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt() / (1.0 + z2 / n);
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

fn adherence(a: AdherenceArgs) -> anyhow::Result<()> {
    if a.columns == 0 {
        bail!("--columns must be positive");
    }
    let outs = sheet_outputs(&a.sheet, a.force)?;
    let (model, run) = a.held.open(a.eta)?;
    let size = model.default_size();
    let start = Instant::now();
    let opts = a.held.memory.plan(&model, &run.request("", 0, size), Job::GenerateAtSize)?.opts;
    let (scores, tiles) = judge_held_out(&model, &run, &opts)?;
    let prompts = &scores.prompts;
    eprintln!();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "prompt adherence of {} ({}) on {} held-out prompts{} ({}, {} px)",
        model.name,
        model.unet_folder,
        prompts.len(),
        if run.from > 0 { format!(" from #{}", run.from) } else { String::new() },
        run.describe(),
        size
    );
    scores.tally.print();
    println!("{:.2} images/s ({:.1} s in all)", prompts.len() as f64 / secs, secs);

    // Contact sheet: tiles in prompt order, prompts in a text file beside it.
    let cols = (a.columns as usize).min(tiles.len());
    let rows: Vec<Vec<image::RgbImage>> = tiles.chunks(cols).map(<[_]>::to_vec).collect();
    let sheet_img = sheet(&rows, size as u32);
    let listing: String = prompts
        .iter()
        .enumerate()
        .map(|(i, (c, s))| format!("{:>4} row {} col {}  seed {s}  {c}\n", run.from + i, i / cols, i % cols))
        .collect();
    let (png, txt) = outs.write(&sheet_img, &listing)?;
    println!("contact sheet {} (prompts: {})", png.display(), txt.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::wilson_interval;

    #[test]
    fn wilson_interval_matches_the_textbook_values() {
        // 61 of 103 (the shipped LCM UNet's relations): statsmodels' proportion_confint(61, 103,
        // method="wilson") gives (0.49568, 0.68216).
        let (lo, hi) = wilson_interval(61, 103);
        assert!((lo - 0.495_676).abs() < 1e-5 && (hi - 0.682_157).abs() < 1e-5, "{lo} {hi}");
        // The interval stays inside [0, 1] at the ends and is not empty there.
        let (lo, hi) = wilson_interval(0, 10);
        assert!(lo == 0.0 && (hi - 0.277_533).abs() < 1e-5, "{lo} {hi}");
        let (lo, hi) = wilson_interval(10, 10);
        assert!((lo - 0.722_467).abs() < 1e-5 && hi <= 1.0, "{lo} {hi}");
        assert_eq!(wilson_interval(0, 0), (0.0, 1.0));
    }
}
