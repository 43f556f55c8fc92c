//! Any text as a component config: parsed or refused, never a panic; a
//! scheduler config that parses gives samplers that build and step without panicking.
#![no_main]
use std::path::Path;

use brume::models::config::ConfigReader;
use brume::samplers::{build, noise_source, RngKind, SamplerKind};
use candle_core::{DType, Device, Tensor};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&steps, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    let Ok(c) = ConfigReader::parse(Path::new("config.json"), text) else { return };
    let _ = brume::models::UNetConfig::from_reader(&c);
    let _ = brume::models::ClipTextConfig::from_reader(&c);
    if let Ok(v) = brume::models::AutoencoderKLConfig::from_reader(&c) {
        let _ = v.scale_factor();
    }
    let _ = brume::models::autoencoder_tiny::AutoencoderTinyConfig::from_reader(&c);
    let _ = brume::pipelines::SamplingDefaults::from_reader(&c);
    let Ok(cfg) = brume::samplers::schedule::ScheduleConfig::from_reader(&c) else { return };
    let dev = Device::Cpu;
    let x = Tensor::ones((1, 4, 2, 2), DType::F32, &dev).unwrap();
    let eps = (Tensor::ones((1, 4, 2, 2), DType::F32, &dev).unwrap() * 0.1).unwrap();
    for &kind in SamplerKind::ALL {
        let Ok(mut s) = build(kind, &cfg, 1 + steps as usize % 50, 0.0) else { continue };
        let n = s.timesteps().len();
        let mut noise = noise_source(RngKind::Brume, 0);
        let mut cur = x.clone();
        let _ = s.add_noise(&x, &eps, 0);
        for i in 0..n {
            let _ = s.scale_model_input(&cur, i);
            match s.step(&eps, i, &cur, noise.as_mut()) {
                Ok(next) => cur = next,
                Err(_) => break,
            }
        }
    }
});
