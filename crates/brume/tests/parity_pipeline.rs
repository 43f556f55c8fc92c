//! Whole txt2img runs against diffusers' StableDiffusionPipeline on complete
//! fixture model folders: same initial latents, N DDIM steps with guidance,
//! decode; final latents and image within 1e-3 relative.

mod common;

use brume::pipelines::{txt2img, Flow, GenerationRequest, OpenOptions, RunOptions, SdModel};
use common::{assert_close, fixtures, Io, ReplayNoise};

fn pipeline_case(case: &str) {
    let dir = fixtures().join("parity").join(case);
    let io = Io::open(dir.join("io.safetensors"));
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    let model = SdModel::open(&dir.join("model"), &OpenOptions::default()).unwrap();

    // The tokenizer gives diffusers' ids.
    let (want_ids, _) = io.i64("out.input_ids");
    let prompt = meta["prompt"].as_str().unwrap().to_string();
    let got_ids: Vec<i64> = model.tokenizer.encode_padded(&prompt).into_iter().map(i64::from).collect();
    assert_eq!(got_ids, want_ids, "prompt ids");

    // Timesteps are diffusers' DDIM timesteps.
    let steps = meta["steps"].as_u64().unwrap() as usize;
    let (want_ts, _) = io.i64("out.timesteps");
    use brume::samplers::Sampler;
    let sampler = brume::samplers::Ddim::new(&model.schedule, steps, 0.0);
    let got_ts: Vec<i64> = sampler.timesteps().iter().map(|&t| t as i64).collect();
    assert_eq!(got_ts, want_ts, "timesteps");

    let req = GenerationRequest {
        negative_prompt: meta["negative_prompt"].as_str().map(str::to_string),
        steps,
        guidance_scale: meta["guidance_scale"].as_f64().unwrap(),
        width: meta["width"].as_u64().unwrap() as usize,
        height: meta["height"].as_u64().unwrap() as usize,
        ..GenerationRequest::new(prompt, 64)
    };
    // diffusers' only random draw here is the initial latents.
    let mut noise = ReplayNoise::new(vec![io.f32("in.latents")]);
    let out = txt2img(&model, &req, &RunOptions::default(), &mut noise, None, &mut |_| Flow::Continue).unwrap();
    assert_close(&format!("{case} final latents"), &out.latents, &io.f32("out.latents"), 1e-3);
    let image_nhwc = out.image.permute((0, 2, 3, 1)).unwrap();
    assert_close(&format!("{case} image"), &image_nhwc, &io.f32("out.image"), 1e-3);
}

/// The fixture's latents are `torch.randn` from `Generator().manual_seed(0)`: with
/// `--rng torch` and seed 0, brume draws them itself and makes diffusers' picture.
#[test]
fn torch_rng_seed_reproduces_diffusers_txt2img() {
    let dir = fixtures().join("parity/pipeline_sd1");
    let io = Io::open(dir.join("io.safetensors"));
    let model = SdModel::open(&dir.join("model"), &OpenOptions::default()).unwrap();
    let req = GenerationRequest {
        steps: 5,
        seed: 0,
        rng: brume::samplers::RngKind::Torch,
        ..GenerationRequest::new("a red circle on a blue background", 64)
    };
    let mut noise = brume::samplers::noise_source(req.rng, req.seed);
    let out = txt2img(&model, &req, &RunOptions::default(), noise.as_mut(), None, &mut |_| Flow::Continue).unwrap();
    assert_close("torch rng latents", &out.latents, &io.f32("out.latents"), 1e-3);
    assert_close("torch rng image", &out.image.permute((0, 2, 3, 1)).unwrap(), &io.f32("out.image"), 1e-3);
}

#[test]
fn pipeline_sd1_ddim_guidance() {
    pipeline_case("pipeline_sd1");
}

#[test]
fn pipeline_sd2_v_prediction_negative_prompt() {
    pipeline_case("pipeline_sd2v");
}
