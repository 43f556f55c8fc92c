//! The conditioning cache: cross-attention keys/values computed once per prompt
//! give exactly the uncached result, and a repeated prompt skips the text encoder.

mod common;

use brume::loading::diffusers::open_component;
use brume::models::attention::{CrossContext, KvCache};
use brume::models::{UNet2DConditionModel, UNetConfig};
use brume::pipelines::{txt2img, ConditioningCache, Flow, GenerationRequest, OpenOptions, RunOptions, SdModel};
use brume::samplers::Rng;
use candle_core::{DType, Device};
use common::{fixtures, rel_err, Io};

#[test]
fn cached_cross_attention_equals_uncached_and_is_reused() {
    for case in ["unet_sd1", "unet_sdxs", "unet_sd2"] {
        let dir = fixtures().join("parity").join(case);
        let io = Io::open(dir.join("io.safetensors"));
        let cfg = UNetConfig::from_file(&dir.join("model/config.json")).unwrap();
        let store = open_component(&dir.join("model"), None).unwrap();
        let unet = UNet2DConditionModel::load(&store, &cfg, &Device::Cpu, DType::F32).unwrap();
        let ts: Vec<f32> = io.f32("in.timestep").to_vec1().unwrap();
        let ctx = io.f32("in.encoder_hidden_states");
        let sample = io.f32("in.sample");
        let plain = unet.forward(&sample, &ts, &ctx, None).unwrap();
        let cache = KvCache::new();
        let cached = CrossContext {
            cache: Some(&cache),
            ..CrossContext::uncached(&ctx)
        };
        let first = unet.forward_with(&sample, &ts, &cached, None).unwrap();
        let (computed, reused) = cache.stats();
        assert!(computed > 0 && reused == 0, "{case}: first step fills the cache");
        // A later step (another timestep, another sample) reuses every entry.
        let sample2 = (&sample * 0.5).unwrap();
        let second = unet.forward_with(&sample2, &[500.0], &cached, None).unwrap();
        assert_eq!(cache.stats(), (computed, computed), "{case}: second step reuses all");
        assert!(rel_err(&first, &plain) <= 1e-6, "{case}");
        let plain2 = unet.forward(&sample2, &[500.0], &ctx, None).unwrap();
        assert!(rel_err(&second, &plain2) <= 1e-6, "{case}");
        assert!(cache.nbytes() > 0);
    }
}

#[test]
fn pipeline_results_identical_with_and_without_reuse_and_prompt_cache_hits() {
    let model = SdModel::open(&fixtures().join("parity/pipeline_sd1/model"), &OpenOptions::default()).unwrap();
    let req = GenerationRequest {
        steps: 4,
        batch: 2,
        ..GenerationRequest::new("a red circle on a blue background", 64)
    };
    let run = |opts: &RunOptions, cache: Option<&mut ConditioningCache>| {
        let mut noise = Rng::new(3);
        txt2img(&model, &req, opts, &mut noise, cache, &mut |_| Flow::Continue).unwrap()
    };
    let uncached = run(&RunOptions { reuse_kv: false, ..Default::default() }, None);
    let mut cache = ConditioningCache::new(2);
    let a = run(&RunOptions::default(), Some(&mut cache));
    let b = run(&RunOptions::default(), Some(&mut cache));
    assert_eq!(cache.stats(), (1, 1), "second generation with the same prompt hits");
    assert!(rel_err(&a.latents, &uncached.latents) <= 1e-6);
    assert!(rel_err(&b.latents, &uncached.latents) <= 1e-6);
    assert_eq!(a.image.dims(), [2, 3, 64, 64]);
    // Batch images differ (consecutive noise), prompt shared.
    assert!(rel_err(&a.latents.get(0).unwrap(), &a.latents.get(1).unwrap()) > 1e-3);
}
