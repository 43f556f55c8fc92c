//! img2img and both inpainting modes against diffusers' pipelines on fixture
//! models (tools/edit_fixtures), with diffusers' own random draws replayed:
//! final latents and image within 1e-3; and brume's paste-back returns the
//! pixels outside the mask unchanged.

mod common;

use std::path::PathBuf;

use brume::pipelines::image_io::{load_image, load_mask, to_rgb8};
use brume::pipelines::{img2img, inpaint, Flow, GenerationRequest, OpenOptions, PasteBack, RunOptions, SdModel};
use candle_core::DType;
use common::{assert_close, fixtures, Io, ReplayNoise};

struct Case {
    dir: PathBuf,
    io: Io,
    meta: serde_json::Value,
}

fn case(name: &str) -> Case {
    let dir = fixtures().join("edit").join(name);
    let meta = serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    Case {
        io: Io::open(dir.join("io.safetensors")),
        dir,
        meta,
    }
}

impl Case {
    fn noise(&self) -> ReplayNoise {
        let draws = (0..)
            .map(|i| format!("noise.{i}"))
            .take_while(|n| self.io.has(n))
            .map(|n| self.io.f32(&n))
            .collect();
        ReplayNoise::new(draws)
    }

    fn request(&self) -> GenerationRequest {
        GenerationRequest {
            steps: self.meta["steps"].as_u64().unwrap() as usize,
            guidance_scale: self.meta["guidance"].as_f64().unwrap(),
            ..GenerationRequest::new(self.meta["prompt"].as_str().unwrap(), 64)
        }
    }

    fn strength(&self) -> f64 {
        self.meta["strength"].as_f64().unwrap()
    }
}

fn sd1() -> SdModel {
    SdModel::open(&fixtures().join("parity/pipeline_sd1/model"), &OpenOptions::default()).unwrap()
}

fn img2img_case(name: &str) {
    img2img_case_on(name, &sd1());
}

/// The tiny SD1 pipeline with an LCM UNet (its UNet config + time_cond_proj_dim 16, the
/// fixture's `model/unet`) and an `LCMScheduler`, under the `model_index.json` of `index_from`: an LCM case's own
/// (`LatentConsistencyModelPipeline`) or pipeline_sd1's (`StableDiffusionPipeline`).
fn lcm_folder(index_from: &std::path::Path) -> (tempfile::TempDir, SdModel) {
    let tmp = tempfile::tempdir().unwrap();
    let sd1 = fixtures().join("parity/pipeline_sd1/model");
    let lcm_case = fixtures().join("edit/img2img_lcm_pipeline/model");
    let copy_dir = |from: &std::path::Path, to: &std::path::Path| {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    };
    for part in ["text_encoder", "tokenizer", "vae"] {
        copy_dir(&sd1.join(part), &tmp.path().join(part));
    }
    copy_dir(&lcm_case.join("unet"), &tmp.path().join("unet"));
    copy_dir(&lcm_case.join("scheduler"), &tmp.path().join("scheduler"));
    std::fs::copy(index_from.join("model_index.json"), tmp.path().join("model_index.json")).unwrap();
    let model = SdModel::open(tmp.path(), &OpenOptions::default()).unwrap();
    (tmp, model)
}

/// A `LatentConsistencyModelPipeline` folder: diffusers' LCM img2img pipeline hands strength
/// to the scheduler, and all four steps run below timestep ~600.
#[test]
fn img2img_of_an_lcm_pipeline_folder() {
    let (_tmp, model) = lcm_folder(&fixtures().join("edit/img2img_lcm_pipeline/model"));
    assert!(model.is_lcm_pipeline());
    img2img_case_on("img2img_lcm_pipeline", &model);
}

/// The same UNet and scheduler in a `StableDiffusionPipeline` folder: Stable Diffusion's
/// img2img skips the first steps of the 4-step schedule instead (2 steps from 499).
#[test]
fn img2img_of_an_lcm_unet_in_a_stable_diffusion_folder() {
    let (_tmp, model) = lcm_folder(&fixtures().join("parity/pipeline_sd1/model"));
    assert!(!model.is_lcm_pipeline());
    img2img_case_on("img2img_lcm_sd_pipeline", &model);
}

fn img2img_case_on(name: &str, model: &SdModel) {
    let c = case(name);
    // The timesteps run are the ones diffusers ran.
    let (sampler, start) = brume::pipelines::img2img::schedule(model, &c.request(), c.strength()).unwrap();
    let want: Vec<f64> = c.io.i64("out.timesteps").0.into_iter().map(|t| t as f64).collect();
    assert_eq!(sampler.timesteps()[start..], want[..], "{name} timesteps");
    let image = load_image(&c.dir.join("input.png"), 8).unwrap();
    assert_close(&format!("{name} preprocessed image"), &image.tensor, &c.io.f32("out.init_image"), 1e-6);
    let mut noise = c.noise();
    let out = img2img(model, &c.request(), &image.tensor, c.strength(), &RunOptions::default(), &mut noise, None, &mut |_| {
        Flow::Continue
    })
    .unwrap();
    assert!(noise.draws.is_empty(), "every diffusers draw was used");
    assert_close(&format!("{name} latents"), &out.latents, &c.io.f32("out.latents"), 1e-3);
    assert_close(&format!("{name} image"), &out.image.permute((0, 2, 3, 1)).unwrap(), &c.io.f32("out.image"), 1e-3);
}

/// diffusers drew every tensor from `Generator("cpu").manual_seed(seed)`: brume's
/// torch-compatible generator with the same seed reproduces the edit.
#[test]
fn torch_rng_seed_reproduces_diffusers_edits() {
    let model = sd1();
    for name in ["img2img", "inpaint_4ch"] {
        let c = case(name);
        let image = load_image(&c.dir.join("input.png"), 8).unwrap();
        let seed = c.meta["seed"].as_u64().unwrap();
        let mut noise = brume::samplers::TorchRng::new(seed);
        let req = c.request();
        let out = if name == "img2img" {
            img2img(&model, &req, &image.tensor, c.strength(), &RunOptions::default(), &mut noise, None, &mut |_| Flow::Continue)
        } else {
            let mask = load_mask(&c.dir.join("mask.png"), &image).unwrap();
            inpaint(&model, &req, &image.tensor, &mask, c.strength(), None, &RunOptions::default(), &mut noise, None, &mut |_| {
                Flow::Continue
            })
        }
        .unwrap();
        assert_close(&format!("{name} with torch rng"), &out.latents, &c.io.f32("out.latents"), 1e-3);
    }
}

#[test]
fn img2img_strength_0_6() {
    img2img_case("img2img");
}

#[test]
fn img2img_single_step() {
    img2img_case("img2img_1step");
}

fn inpaint_case(name: &str, model: &SdModel) {
    let c = case(name);
    let image = load_image(&c.dir.join("input.png"), 8).unwrap();
    let mask = load_mask(&c.dir.join("mask.png"), &image).unwrap();
    let bin = mask.ge(0.5).unwrap().to_dtype(DType::F32).unwrap();
    assert_close(&format!("{name} binarised mask"), &bin, &c.io.f32("out.mask_condition"), 0.0);
    let mut noise = c.noise();
    let req = c.request();
    let opts = RunOptions::default();
    let out = inpaint(model, &req, &image.tensor, &mask, c.strength(), None, &opts, &mut noise, None, &mut |_| Flow::Continue).unwrap();
    assert!(noise.draws.is_empty(), "every diffusers draw was used");
    assert_close(&format!("{name} latents"), &out.latents, &c.io.f32("out.latents"), 1e-3);
    assert_close(&format!("{name} image"), &out.image.permute((0, 2, 3, 1)).unwrap(), &c.io.f32("out.image"), 1e-3);

    // With paste-back, every pixel outside the mask is the input's, bit for bit.
    let mut noise = c.noise();
    let pasted = inpaint(
        model,
        &req,
        &image.tensor,
        &mask,
        c.strength(),
        Some(PasteBack { feather: 3 }),
        &opts,
        &mut noise,
        None,
        &mut |_| Flow::Continue,
    )
    .unwrap();
    let got = to_rgb8(&pasted.image).unwrap();
    let input = image::open(c.dir.join("input.png")).unwrap().to_rgb8();
    let m = image::open(c.dir.join("mask.png")).unwrap().to_luma8();
    let mut outside = 0;
    let mut changed_inside = 0;
    for (x, y, p) in input.enumerate_pixels() {
        if m.get_pixel(x, y).0[0] < 128 {
            assert_eq!(got.get_pixel(x, y), p, "{name}: pixel ({x}, {y}) outside the mask changed");
            outside += 1;
        } else if got.get_pixel(x, y) != p {
            changed_inside += 1;
        }
    }
    assert!(outside > 0 && changed_inside > 0, "{name}: {outside} kept, {changed_inside} repainted");
}

#[test]
fn inpaint_with_9_channel_unet() {
    let model = SdModel::open(&fixtures().join("edit/inpaint_9ch/model"), &OpenOptions::default()).unwrap();
    inpaint_case("inpaint_9ch", &model);
}

#[test]
fn inpaint_with_ordinary_unet() {
    inpaint_case("inpaint_4ch", &sd1());
}

#[test]
fn bad_masks_are_clear_errors() {
    let c = case("inpaint_4ch");
    let model = sd1();
    let image = load_image(&c.dir.join("input.png"), 8).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // Another size.
    let small = tmp.path().join("small.png");
    image::GrayImage::new(32, 32).save(&small).unwrap();
    let e = load_mask(&small, &image).err().unwrap().to_string();
    assert!(e.contains("32x32") && e.contains("64x64"), "{e}");
    // Not an image.
    let txt = tmp.path().join("mask.png");
    std::fs::write(&txt, "hello").unwrap();
    let e = load_mask(&txt, &image).err().unwrap().to_string();
    assert!(e.contains("not an image") || e.contains("decode"), "{e}");
    // Empty.
    let empty = brume::pipelines::image_io::gray_to_mask(&image::GrayImage::new(64, 64)).unwrap();
    let mut noise = brume::samplers::Rng::new(0);
    let e = inpaint(&model, &c.request(), &image.tensor, &empty, 1.0, None, &RunOptions::default(), &mut noise, None, &mut |_| {
        Flow::Continue
    })
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("mask is empty"), "{e}");
}

#[test]
fn image_sizes_follow_the_documented_rule() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("odd.png");
    image::RgbImage::new(70, 45).save(&p).unwrap();
    let img = load_image(&p, 8).unwrap();
    assert_eq!(img.size, (64, 40));
    assert_eq!(img.tensor.dims(), [1, 3, 40, 64]);
    let tiny = tmp.path().join("tiny.png");
    image::RgbImage::new(5, 40).save(&tiny).unwrap();
    assert!(load_image(&tiny, 8).err().unwrap().to_string().contains("at least 8"));
    let e = load_image(&tmp.path().join("missing.png"), 8).err().unwrap().to_string();
    assert!(e.contains("missing.png"), "{e}");
}

#[test]
fn outpaint_canvas_extends_and_masks_the_new_area() {
    let c = case("img2img");
    let image = load_image(&c.dir.join("input.png"), 8).unwrap();
    let (canvas, mask) = brume::pipelines::outpaint_canvas(&image.tensor, [16, 0, 5, 8], 4, 8).unwrap();
    assert_eq!(canvas.dims(), [1, 3, 72, 88]); // 64+16+5 -> 88 (rounded up), 64+8 = 72
    // The original sits unchanged at (16, 0).
    let inner = canvas.narrow(3, 16, 64).unwrap().narrow(2, 0, 64).unwrap();
    assert_close("outpaint original region", &inner, &image.tensor, 0.0);
    let m = mask.squeeze(0).unwrap().squeeze(0).unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(m[10][5], 1.0); // new left strip
    assert_eq!(m[10][18], 1.0); // overlap into the original
    assert_eq!(m[10][40], 0.0); // kept
    assert_eq!(m[0][40], 0.0); // top not extended: no overlap there
    assert_eq!(m[70][40], 1.0); // new bottom strip
    assert!(brume::pipelines::outpaint_canvas(&image.tensor, [0, 0, 0, 0], 4, 8).is_err());
}
