//! Every sampler in a whole txt2img run: brume with `--rng torch` and diffusers'
//! StableDiffusionPipeline with the same seed and scheduler land on the same
//! latents (tools/samplers/make_pipeline_fixtures.py), <= 1e-3 relative.

mod common;

use brume::pipelines::{txt2img, Flow, GenerationRequest, OpenOptions, RunOptions, SdModel};
use brume::samplers::{noise_source, RngKind, SamplerKind};
use common::{fixtures, Io};

#[test]
fn every_sampler_reproduces_diffusers_from_the_same_seed() {
    let model = SdModel::open(&fixtures().join("parity/pipeline_sd1/model"), &OpenOptions::default()).unwrap();
    let dir = fixtures().join("sampler_pipelines");
    let io = Io::open(dir.join("io.safetensors"));
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    let names: Vec<&String> = meta["samplers"].as_object().unwrap().keys().collect();
    assert_eq!(names.len(), SamplerKind::ALL.len(), "a fixture per sampler");
    let mut failures = Vec::new();
    for name in names {
        let kind = SamplerKind::parse(name).unwrap();
        let req = GenerationRequest {
            steps: meta["steps"].as_u64().unwrap() as usize,
            guidance_scale: meta["guidance"].as_f64().unwrap(),
            seed: meta["seed"].as_u64().unwrap(),
            rng: RngKind::Torch,
            sampler: Some(kind),
            ..GenerationRequest::new(meta["prompt"].as_str().unwrap(), 64)
        };
        let mut noise = noise_source(req.rng, req.seed);
        let out = txt2img(&model, &req, &RunOptions::default(), noise.as_mut(), None, &mut |_| Flow::Continue).unwrap();
        let e = common::rel_err(&out.latents, &io.f32(&format!("{name}.latents")));
        eprintln!("{name}: relative error {e:.3e}");
        if e > 1e-3 {
            failures.push(format!("{name} {e:.3e}"));
        }
    }
    assert!(failures.is_empty(), "samplers off diffusers: {failures:?}");
}
