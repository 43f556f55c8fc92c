//! Training-set writer: `NNNNNNN.png` files plus `captions.jsonl`, one line per image with the
//! file name, caption, seeds, the full spec and the scene geometry.
//!
//! Every file is written to a temporary name and renamed into place, so an interrupted run never
//! leaves a truncated PNG or a half-written `captions.jsonl`; rerunning with the same arguments
//! skips PNGs that already exist (the content is a pure function of the seed) and rewrites the
//! caption file in one go at the end.

use crate::caption::caption;
use crate::render::render;
use crate::rng::mix;
use crate::scene::{sample_scene, SampleConfig};
use std::io::Write;
use std::path::Path;

/// Seed of image `index` in the dataset stream `seed` (scene and template seeds derive from it).
pub fn item_seed(seed: u64, index: u64) -> u64 {
    mix(seed, index)
}

/// One `captions.jsonl` line for image `index` of stream `seed` (also what `write_dataset` writes).
pub fn dataset_record(index: u64, seed: u64) -> serde_json::Value {
    let s = item_seed(seed, index);
    let scene = sample_scene(s, &SampleConfig::default());
    serde_json::json!({
        "file": file_name(index),
        "caption": caption(&scene, s),
        "seed": s,
        "spec": scene.spec().to_json(),
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
/// ones are kept).
pub fn write_dataset(dir: &Path, count: u64, size: u32, seed: u64) -> std::io::Result<u64> {
    std::fs::create_dir_all(dir)?;
    let mut lines = Vec::with_capacity(count as usize);
    let mut rendered = 0;
    for index in 0..count {
        let record = dataset_record(index, seed);
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
