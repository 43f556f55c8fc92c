//! Shared helpers: small PNGs with a brume recipe, made without a model.
#![allow(dead_code)]

use brume::pipelines::recipe::{encode_png, Recipe};
use brume_gallery::NewImage;

/// A recipe as brume would write it (built from JSON so new optional fields need no edit here).
pub fn recipe(prompt: &str, seed: u64, w: u32, h: u32) -> Recipe {
    serde_json::from_value(serde_json::json!({
        "brume_version": "0.1.0", "mode": "txt2img", "prompt": prompt, "negative_prompt": "blurry, dark",
        "steps": 20, "sampler": "ddim", "guidance_scale": 7.5, "seed": seed, "rng": "cpu",
        "width": w, "height": h, "batch": 1, "eta": 0.0, "clip_skip": 0,
        "model_name": "builtin", "model_path": "/models/builtin", "model_hash": "abcdef0123",
        "strength": null, "image": null, "mask": null, "extend": null, "feather": null
    }))
    .expect("test recipe")
}

/// A w x h picture whose pixels depend on `seed`, as a PNG with `recipe`'s chunks.
pub fn png(seed: u64, w: u32, h: u32, recipe: Option<&Recipe>) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        let v = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add((x as u64) << 8 | y as u64);
        image::Rgb([(v >> 3) as u8, (v >> 11) as u8, (v >> 19) as u8 ^ x as u8])
    });
    encode_png(&img, recipe).expect("encode")
}

/// An image brume "made": PNG with its recipe, fields from the recipe.
pub fn made(prompt: &str, seed: u64, w: u32, h: u32) -> NewImage {
    let r = recipe(prompt, seed, w, h);
    NewImage::from_recipe(png(seed, w, h, Some(&r)), &r)
}

/// A PNG with one `parameters` text chunk (as the A1111 web UI writes), via the png crate.
pub fn a1111_png(text: &str, compressed: bool) -> Vec<u8> {
    let mut buf = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut buf, 8, 8);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        if compressed {
            enc.add_ztxt_chunk("parameters".into(), text.into()).unwrap();
        } else {
            enc.add_text_chunk("parameters".into(), text.into()).unwrap();
        }
        let mut w = enc.write_header().unwrap();
        w.write_image_data(&[90u8; 8 * 8 * 3]).unwrap();
        w.finish().unwrap();
    }
    buf
}
