//! Training-set writer: `NNNNNNN.png` files plus `captions.jsonl`, one line per image with the
//! file name, caption, seeds, the full spec and the scene geometry.
//!
//! Every file is written to a temporary name and renamed into place, so an interrupted run never
//! leaves a truncated PNG or a half-written `captions.jsonl`; rerunning with the same arguments
//! skips PNGs that already exist (the content is a pure function of the seed) and rewrites the
//! caption file in one go at the end.

use crate::caption::caption_spec;
use crate::render::render;
use crate::rng::{mix, Rng};
use crate::scene::{is_held_out, sample_scene, Layout, SampleConfig, Scene, Spec};
use std::io::Write;
use std::path::Path;

/// Seed of image `index` in the dataset stream `seed` (scene and template seeds derive from it).
pub fn item_seed(seed: u64, index: u64) -> u64 {
    mix(seed, index)
}

/// How often a training caption leaves out something its picture still shows.
///
/// A model trained only on captions that name every object's size and a single object's position
/// has never seen a prompt without them, and people write such prompts first ("a red circle on a
/// blue background"): run 5, trained that way, drew a blue circle on brown for exactly that prompt.
/// Leaving the size or position out of some captions teaches that an unnamed attribute may take any
/// value. The default omits nothing, which reproduces the captions of earlier runs exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CaptionConfig {
    /// Probability, per object, that the caption does not name its size.
    pub omit_size: f64,
    /// Probability that a one-object caption does not name the object's position.
    pub omit_position: f64,
}

impl CaptionConfig {
    /// Checks both probabilities lie in [0, 1], naming the field that does not.
    pub fn validate(&self) -> Result<(), String> {
        for (name, p) in [("omit_size", self.omit_size), ("omit_position", self.omit_position)] {
            if !(0.0..=1.0).contains(&p) {
                return Err(format!("{name} must be a probability in [0, 1], got {p}"));
            }
        }
        Ok(())
    }
}

/// What the caption of `scene` states: its full spec, less the omissions `cfg` draws.
///
/// The omissions use their own random stream, so the scene and the caption template do not change
/// with `cfg`. A reduced spec that falls in the held-out split is not used (the full caption is):
/// the held-out rule then still holds for every training caption, not only for every picture.
pub fn caption_spec_of(scene: &Scene, item_seed: u64, cfg: &CaptionConfig) -> Spec {
    let full = scene.spec();
    if cfg.omit_size <= 0.0 && cfg.omit_position <= 0.0 {
        return full;
    }
    let mut rng = Rng::new(mix(item_seed, 0x0A17_CA97));
    let mut spec = full.clone();
    for o in &mut spec.objects {
        if rng.chance(cfg.omit_size) {
            o.size = None;
        }
    }
    if let Layout::Single(position) = &mut spec.layout {
        if rng.chance(cfg.omit_position) {
            *position = None;
        }
    }
    if is_held_out(&spec) {
        full
    } else {
        spec
    }
}

/// One `captions.jsonl` line for image `index` of stream `seed` (also what `write_dataset` writes).
/// `spec` is what the caption states; `scene` is the full geometry of the picture.
pub fn dataset_record(index: u64, seed: u64, cfg: &CaptionConfig) -> serde_json::Value {
    let s = item_seed(seed, index);
    let scene = sample_scene(s, &SampleConfig::default());
    let spec = caption_spec_of(&scene, s, cfg);
    serde_json::json!({
        "file": file_name(index),
        "caption": caption_spec(&spec, s),
        "seed": s,
        "spec": spec.to_json(),
        "scene": scene.to_json(),
    })
}

fn file_name(index: u64) -> String {
    format!("{index:07}.png")
}

fn write_atomically(path: &Path, write: impl FnOnce(&Path) -> std::io::Result<()>) -> std::io::Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let result = write(&tmp).and_then(|_| std::fs::rename(&tmp, path));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Writes `count` training images of `size`×`size` and `captions.jsonl` into `dir` (created if
/// needed). Held-out specs never appear. Returns the number of PNGs actually rendered (existing
/// ones are kept; captions depend on `cfg`, pictures do not).
pub fn write_dataset(dir: &Path, count: u64, size: u32, seed: u64, cfg: &CaptionConfig) -> std::io::Result<u64> {
    std::fs::create_dir_all(dir)?;
    let mut lines = Vec::with_capacity(count as usize);
    let mut rendered = 0;
    for index in 0..count {
        let record = dataset_record(index, seed, cfg);
        let path = dir.join(file_name(index));
        if !path.exists() {
            let s = item_seed(seed, index);
            let img = render(&sample_scene(s, &SampleConfig::default()), size);
            write_atomically(&path, |tmp| {
                img.save_with_format(tmp, image::ImageFormat::Png).map_err(std::io::Error::other)
            })?;
            rendered += 1;
        }
        lines.push(record.to_string());
    }
    write_atomically(&dir.join("captions.jsonl"), |tmp| {
        let mut f = std::io::BufWriter::new(std::fs::File::create(tmp)?);
        for l in &lines {
            writeln!(f, "{l}")?;
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()
    })?;
    Ok(rendered)
}
