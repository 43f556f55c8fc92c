//! The shipped built-in model is a standard diffusers model: diffusers' own
//! pipeline (tools/builtin/make_builtin_fixture.py) and brume make the same
//! images from the same seed (`--rng torch`), within 1e-3 relative.

mod common;

use brume::pipelines::{txt2img, Flow, GenerationRequest, OpenOptions, RunOptions, SdModel};
use brume::samplers::{noise_source, RngKind, SamplerKind};
use common::{assert_close, fixtures, Io};

#[test]
fn builtin_model_matches_diffusers() {
    let root = fixtures().join("../models/builtin");
    let dir = fixtures().join("builtin");
    let io = Io::open(dir.join("io.safetensors"));
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    for (i, c) in meta["cases"].as_array().unwrap().iter().enumerate() {
        // Distilled cases run the model's other UNet folder (unet_lcm) with its scheduler.
        let unet = c["unet"].as_str().map(str::to_string);
        let model = SdModel::open(&root, &OpenOptions { unet: unet.clone(), ..Default::default() }).unwrap();
        let sampler = SamplerKind::parse(c["sampler"].as_str().unwrap()).unwrap();
        assert_eq!(sampler, SamplerKind::from_config(&model.schedule).unwrap(), "case {i}: the folder's own scheduler");
        let req = GenerationRequest {
            steps: c["steps"].as_u64().unwrap() as usize,
            guidance_scale: c["guidance"].as_f64().unwrap(),
            seed: c["seed"].as_u64().unwrap(),
            rng: RngKind::Torch,
            sampler: Some(sampler),
            ..GenerationRequest::new(c["prompt"].as_str().unwrap(), model.default_size())
        };
        let mut noise = noise_source(req.rng, req.seed);
        let out = txt2img(&model, &req, &RunOptions::default(), noise.as_mut(), None, &mut |_| Flow::Continue).unwrap();
        assert_close(&format!("case {i} latents"), &out.latents, &io.f32(&format!("out.{i}.latents")), 1e-3);
        assert_close(&format!("case {i} image"), &out.image.permute((0, 2, 3, 1)).unwrap(), &io.f32(&format!("out.{i}.image")), 1e-3);
    }
}
