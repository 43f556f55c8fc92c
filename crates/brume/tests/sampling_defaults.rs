//! A UNet folder's recommended settings (`sampling_defaults.json`): read, checked,
//! and applied only where a request leaves a setting out.

mod common;

use brume::pipelines::sampling_defaults::{self, Resolved, SamplingDefaults};
use brume::pipelines::{OpenOptions, SdModel};
use brume::samplers::SamplerKind;
use common::fixtures;

fn builtin(unet: Option<&str>) -> SdModel {
    let opts = OpenOptions { unet: unet.map(str::to_string), ..Default::default() };
    SdModel::open(&fixtures().join("../models/builtin"), &opts).unwrap()
}

fn written(text: &str) -> Result<SamplingDefaults, String> {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join(sampling_defaults::FILE), text).unwrap();
    SamplingDefaults::read_dir(tmp.path()).map_err(|e| e.to_string())
}

#[test]
fn the_builtin_model_brings_its_own_settings() {
    let model = builtin(None);
    let own = model.sampler_kind(None).unwrap();
    assert_eq!(own, SamplerKind::Ddim);
    let (g, steps) = (model.sampling.guidance_scale.unwrap(), model.sampling.steps.unwrap());
    assert!(g < sampling_defaults::GUIDANCE, "the built-in model's guidance {g} is its own, not diffusers' 7.5");
    assert_eq!(model.sampling_settings(own, None, None).unwrap(), Resolved { steps, guidance_scale: g });
    // What the request names wins, one setting at a time.
    assert_eq!(model.sampling_settings(own, Some(7), None).unwrap(), Resolved { steps: 7, guidance_scale: g });
    assert_eq!(model.sampling_settings(own, None, Some(7.5)).unwrap(), Resolved { steps, guidance_scale: 7.5 });
    // The step count is for the model's own scheduler; guidance is the model's for any.
    assert_eq!(model.sampling_settings(SamplerKind::EulerAncestral, None, None).unwrap(), Resolved { steps: sampling_defaults::STEPS, guidance_scale: g });
    assert_eq!(model.sampling_settings(SamplerKind::Lcm, None, None).unwrap().steps, sampling_defaults::FEW_STEPS);

    let lcm = builtin(Some("unet_lcm"));
    let own = lcm.sampler_kind(None).unwrap();
    assert_eq!(own, SamplerKind::Lcm);
    let r = lcm.sampling_settings(own, None, None).unwrap();
    assert_eq!(r.steps, 4);
    assert_eq!(Some(r.guidance_scale), lcm.sampling.guidance_scale);
    // img2img strength is a share of the steps: four LCM steps need a larger one than
    // twenty-five DDIM steps to start from as much noise (`brume eval edits`).
    assert_eq!(model.sampling.img2img_strength(None), 0.6);
    assert_eq!(lcm.sampling.img2img_strength(None), 0.75);
    assert_eq!(lcm.sampling.img2img_strength(Some(0.3)), 0.3);
}

#[test]
fn a_model_that_says_nothing_gets_the_usual_defaults() {
    let tmp = tempfile::tempdir().unwrap();
    assert_eq!(SamplingDefaults::read_dir(tmp.path()).unwrap(), SamplingDefaults::default());
    let none = SamplingDefaults::default();
    assert_eq!(none.resolve(SamplerKind::Ddim, SamplerKind::Ddim, None, None), Resolved { steps: 20, guidance_scale: 7.5 });
    assert_eq!(none.resolve(SamplerKind::Tcd, SamplerKind::Ddim, None, None), Resolved { steps: 4, guidance_scale: 7.5 });
    // A file may name one setting and leave the other.
    let only = written(r#"{"num_inference_steps": 30}"#).unwrap();
    assert_eq!(only, SamplingDefaults { guidance_scale: None, steps: Some(30), strength: None });
    assert_eq!(only.img2img_strength(None), sampling_defaults::STRENGTH);
    assert_eq!(only.resolve(SamplerKind::Ddim, SamplerKind::Ddim, None, None), Resolved { steps: 30, guidance_scale: 7.5 });
}

#[test]
fn a_bad_file_is_an_error_naming_it_and_the_field() {
    for (text, field) in [
        (r#"{"guidance_scale": -1}"#, "guidance_scale"),
        (r#"{"guidance_scale": 75}"#, "guidance_scale"),
        (r#"{"guidance_scale": "NaN"}"#, "guidance_scale"),
        (r#"{"guidance_scale": "four"}"#, "guidance_scale"),
        (r#"{"num_inference_steps": 0}"#, "num_inference_steps"),
        (r#"{"num_inference_steps": 2.5}"#, "num_inference_steps"),
        (r#"{"num_inference_steps": 100000}"#, "num_inference_steps"),
        (r#"{"guidance": 4}"#, "guidance"),
        (r#"{"strength": 0}"#, "strength"),
        (r#"{"strength": 1.5}"#, "strength"),
        (r#"{"strength": "NaN"}"#, "strength"),
    ] {
        let e = written(text).unwrap_err();
        assert!(e.contains(sampling_defaults::FILE) && e.contains(field), "{text}: {e}");
    }
    let e = written("{not json").unwrap_err();
    assert!(e.contains(sampling_defaults::FILE), "{e}");
}
