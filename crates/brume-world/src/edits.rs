//! Edit cases: a held-out prompt paired with a picture that differs from it in one known way,
//! so an edit (img2img, inpainting) can be graded by the same judge as text-to-image.
//!
//! The *target* of each case is a held-out prompt and its reference scene; the *sources* are
//! that scene with its first object changed. An edit asked to turn a source into the target
//! caption is right where the judge grades the result right against the caption, and the parts
//! of the picture the edit should keep (background, the other object, the place and size of the
//! edited one) are graded by the same verdict. Because the target is held out, no case's caption
//! occurs in training.

use image::GrayImage;

use crate::colour::Colour;
use crate::rng::{mix, Rng};
use crate::scene::{held_out_prompts, held_out_scene, Scene, Shape};

/// Seeds the sources' changes apart from the scenes' own streams.
const EDIT_STREAM: u64 = 0x4544_4954_5331_0001; // "EDITS1"

/// One held-out prompt and the pictures an edit starts from.
#[derive(Clone, Debug, PartialEq)]
pub struct EditCase {
    /// The held-out prompt the edit is asked for (and graded against).
    pub caption: String,
    /// The prompt's seed (its reference scene and caption template).
    pub seed: u64,
    /// The prompt's reference scene.
    pub target: Scene,
    /// The target with its first object in another colour: what a recolouring edit
    /// (img2img) starts from.
    pub recoloured: Scene,
    /// The target with its first object another shape in another colour, in the same
    /// place and size: what an object-replacing edit (inpainting) starts from.
    pub replaced: Scene,
}

/// Held-out prompts `from..from + count` as edit cases (the same prompts, in the same order, as
/// `held_out_prompts`).
pub fn edit_cases(from: usize, count: usize) -> Vec<EditCase> {
    let mut prompts = held_out_prompts(from + count);
    prompts
        .drain(from..)
        .map(|(caption, seed)| {
            let target = held_out_scene(seed);
            let mut rng = Rng::new(mix(seed, EDIT_STREAM));
            let recoloured = with_first_object(&target, |o, scene| o.colour = other_colour(scene, &mut rng));
            let replaced = with_first_object(&target, |o, scene| {
                o.colour = other_colour(scene, &mut rng);
                o.shape = loop {
                    let s = rng.pick(Shape::ALL);
                    if s != o.shape {
                        break s;
                    }
                };
            });
            EditCase { caption, seed, target, recoloured, replaced }
        })
        .collect()
}

fn with_first_object(scene: &Scene, change: impl FnOnce(&mut crate::scene::Object, &Scene)) -> Scene {
    let mut out = scene.clone();
    change(&mut out.objects[0], scene);
    out
}

/// A colour no part of `scene` has (its background, any object), so the changed object stays a
/// valid world object that the judge can tell apart from everything else.
fn other_colour(scene: &Scene, rng: &mut Rng) -> Colour {
    let free: Vec<Colour> = Colour::ALL
        .iter()
        .copied()
        .filter(|&c| c != scene.background.colour && scene.objects.iter().all(|o| o.colour != c))
        .collect();
    // Ten colours and at most three taken: never empty.
    rng.pick(&free)
}

/// A `size` x `size` mask, white over object `index`'s bounding box grown by `margin` (a fraction
/// of the side) and then out to whole `cell` x `cell` blocks.
///
/// Snapping to the latent grid (`cell` = the VAE's factor) matters because inpainting with an
/// ordinary UNet blends in latent space with the mask sampled once per latent cell: an edge
/// through a cell could keep part of the old object there.
pub fn object_mask(scene: &Scene, index: usize, size: u32, margin: f64, cell: u32) -> GrayImage {
    let o = &scene.objects[index];
    let cell = cell.max(1);
    let px = |f: f64| f * f64::from(size);
    let lo = |c: f64| ((px(c - o.r - margin).max(0.0) / f64::from(cell)).floor() as u32) * cell;
    let hi = |c: f64| (((px(c + o.r + margin) / f64::from(cell)).ceil() as u32) * cell).min(size);
    let (x0, x1, y0, y1) = (lo(o.cx), hi(o.cx), lo(o.cy), hi(o.cy));
    GrayImage::from_fn(size, size, |x, y| image::Luma([if (x0..x1).contains(&x) && (y0..y1).contains(&y) { 255 } else { 0 }]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{judge, parse_caption, render};

    #[test]
    fn cases_follow_the_held_out_prompts_and_change_only_the_first_object() {
        let cases = edit_cases(3, 40);
        let prompts = held_out_prompts(43);
        assert_eq!(cases.len(), 40);
        assert_eq!(cases, edit_cases(3, 40), "deterministic");
        for (case, (caption, seed)) in cases.iter().zip(&prompts[3..]) {
            assert_eq!((&case.caption, case.seed), (caption, *seed));
            assert_eq!(parse_caption(caption).unwrap(), case.target.spec());
            let (t, rc, rp) = (&case.target.objects[0], &case.recoloured.objects[0], &case.replaced.objects[0]);
            assert!(rc.colour != t.colour && rc.shape == t.shape);
            assert!(rp.colour != t.colour && rp.shape != t.shape);
            for s in [&case.recoloured, &case.replaced] {
                s.spec().validate().unwrap();
                // Same place and size; the rest of the scene untouched.
                assert_eq!((s.objects[0].cx, s.objects[0].cy, s.objects[0].r), (t.cx, t.cy, t.r));
                assert_eq!((&s.background, &s.objects[1..], s.layout), (&case.target.background, &case.target.objects[1..], case.target.layout));
                assert!(s.objects[1..].iter().all(|o| o.colour != s.objects[0].colour));
            }
        }
    }

    #[test]
    fn the_judge_sees_each_source_as_wrong_only_where_it_was_changed() {
        // A case is only a test of the edit if the unedited source fails the caption on the
        // changed attribute and passes the ones the edit must keep.
        for case in edit_cases(0, 30) {
            let spec = case.target.spec();
            let v = judge(&render(&case.target, 128), &spec);
            assert!(v.all_correct(), "{}: the target render itself", case.caption);
            let v = judge(&render(&case.recoloured, 128), &spec);
            assert!(!v.objects[0].colour && v.background_colour && v.object_count, "{}: {v:?}", case.caption);
            let v = judge(&render(&case.replaced, 128), &spec);
            assert!(!v.objects[0].colour && !v.all_correct() && v.background_colour, "{}", case.caption);
        }
    }

    #[test]
    fn the_mask_covers_the_object_on_whole_cells_and_nothing_of_the_other() {
        for case in edit_cases(0, 30) {
            let s = &case.replaced;
            let mask = object_mask(s, 0, 128, 0.04, 8);
            let o = &s.objects[0];
            let inside = |x: u32, y: u32| mask.get_pixel(x, y)[0] == 255;
            // Every pixel the object could touch is white.
            for y in 0..128u32 {
                for x in 0..128u32 {
                    let (fx, fy) = ((f64::from(x) + 0.5) / 128.0, (f64::from(y) + 0.5) / 128.0);
                    if (fx - o.cx).abs() <= o.r + 0.5 / 128.0 && (fy - o.cy).abs() <= o.r + 0.5 / 128.0 {
                        assert!(inside(x, y), "{} ({x}, {y})", case.caption);
                    }
                }
            }
            // Whole 8x8 blocks, so the latent mask is the same box.
            for by in 0..16u32 {
                for bx in 0..16u32 {
                    let first = inside(bx * 8, by * 8);
                    assert!((0..8).all(|d| (0..8).all(|e| inside(bx * 8 + e, by * 8 + d) == first)));
                }
            }
            // The other object of a pair stays outside (pairs keep a gap of 0.05 or more).
            if let Some(b) = s.objects.get(1) {
                let centre = ((b.cx * 128.0) as u32, (b.cy * 128.0) as u32);
                assert!(!inside(centre.0, centre.1), "{}", case.caption);
            }
        }
    }
}
