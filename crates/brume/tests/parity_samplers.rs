//! Sampler parity with diffusers' schedulers, from `fixtures/samplers/`
//! (tools/samplers/make_sampler_fixtures.py): timesteps, teacher-forced
//! steps, whole trajectories, add_noise; plus the configuration errors.

mod common;

use std::collections::VecDeque;
use std::path::Path;

use brume::models::config::ConfigReader;
use brume::samplers::{self, SamplerKind, ScheduleConfig};
use common::{fixtures, rel_err, Io, ReplayNoise};
use serde_json::Value;

struct Case {
    name: String,
    meta: Value,
    io: Io,
    cfg: ScheduleConfig,
    kind: SamplerKind,
}

fn cases() -> Vec<Case> {
    let dir = fixtures().join("samplers");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| {
            let p = e.ok()?.path();
            (p.extension()? == "json").then(|| p.file_stem()?.to_str().map(str::to_string))?
        })
        .collect();
    names.sort();
    assert!(names.len() >= 30, "expected the sampler fixtures, found {}", names.len());
    names
        .into_iter()
        .map(|name| {
            let meta: Value = serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap()).unwrap();
            let cfg_text = serde_json::to_string(&meta["config"]).unwrap();
            let reader = ConfigReader::parse(Path::new(&format!("{name}/scheduler_config.json")), &cfg_text).unwrap();
            let cfg = ScheduleConfig::from_reader(&reader).unwrap_or_else(|e| panic!("{name}: {e}"));
            let kind = SamplerKind::parse(meta["sampler"].as_str().unwrap()).unwrap();
            let io = Io::open(dir.join(format!("{name}.safetensors")));
            Case { name, meta, io, cfg, kind }
        })
        .collect()
}

impl Case {
    fn build(&self) -> Box<dyn samplers::Sampler> {
        let steps = self.meta["steps"].as_u64().unwrap() as usize;
        let eta = self.meta["eta"].as_f64().unwrap();
        samplers::build(self.kind, &self.cfg, steps, eta).unwrap_or_else(|e| panic!("{}: {e}", self.name))
    }

    fn evaluations(&self) -> usize {
        self.meta["evaluations"].as_u64().unwrap() as usize
    }

    fn noise(&self) -> ReplayNoise {
        let queue: VecDeque<_> = self.meta["noise_at"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| self.io.f32(&format!("noise.{}", i.as_u64().unwrap())))
            .collect();
        ReplayNoise::new(queue.into_iter().collect())
    }
}

#[test]
fn timesteps_and_init_noise_sigma_match() {
    for c in cases() {
        let s = c.build();
        let want: Vec<f64> = c.meta["timesteps"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(s.timesteps().len(), want.len(), "{}: timesteps {:?} vs {want:?}", c.name, s.timesteps());
        for (g, w) in s.timesteps().iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{}: timesteps {:?} vs {want:?}", c.name, s.timesteps());
        }
        let sigma = c.meta["init_noise_sigma"].as_f64().unwrap();
        assert!((s.init_noise_sigma() - sigma).abs() <= 1e-6 * sigma, "{}: init_noise_sigma {} vs {sigma}", c.name, s.init_noise_sigma());
    }
}

#[test]
fn teacher_forced_steps_match() {
    let mut worst = (0.0f64, String::new());
    for c in cases() {
        let mut s = c.build();
        let mut noise = c.noise();
        for i in 0..c.evaluations() {
            let x = c.io.f32(&format!("in.{i}"));
            let e = rel_err(&s.scale_model_input(&x, i).unwrap(), &c.io.f32(&format!("scaled.{i}")));
            assert!(e <= 1e-5, "{} eval {i}: scale_model_input error {e:.3e}", c.name);
            let out = c.io.f32(&format!("out.{i}"));
            let prev = s.step(&out, i, &x, &mut noise).unwrap();
            let e = rel_err(&prev, &c.io.f32(&format!("prev.{i}")));
            assert!(e <= 1e-5, "{} eval {i}: step error {e:.3e}", c.name);
            if e > worst.0 {
                worst = (e, format!("{} eval {i}", c.name));
            }
        }
        assert!(noise.draws.is_empty(), "{}: brume drew less noise than diffusers", c.name);
    }
    eprintln!("worst teacher-forced step error: {:.3e} ({})", worst.0, worst.1);
}

/// The synthetic model of the fixture script, in f32.
fn model(x: &candle_core::Tensor, t: f64) -> candle_core::Tensor {
    let t = t as f32;
    let a = (x * (0.9 * (t / 300.0).cos()) as f64).unwrap();
    let b = ((x + (t / 100.0) as f64).unwrap().sin().unwrap() * 0.1).unwrap();
    (a + b).unwrap()
}

#[test]
fn whole_trajectories_match() {
    let mut worst = (0.0f64, String::new());
    for c in cases() {
        let mut s = c.build();
        let mut noise = c.noise();
        let mut x = c.io.f32("sample.0");
        let timesteps = s.timesteps().to_vec();
        for (i, &t) in timesteps.iter().enumerate() {
            let scaled = s.scale_model_input(&x, i).unwrap();
            let out = model(&scaled, t);
            x = s.step(&out, i, &x, &mut noise).unwrap();
        }
        let e = rel_err(&x, &c.io.f32(&format!("prev.{}", timesteps.len() - 1)));
        assert!(e <= 1e-4, "{}: trajectory error {e:.3e}", c.name);
        if e > worst.0 {
            worst = (e, c.name.clone());
        }
    }
    eprintln!("worst trajectory error: {:.3e} ({})", worst.0, worst.1);
}

#[test]
fn add_noise_matches() {
    for c in cases() {
        let s = c.build();
        let (x0, n) = (c.io.f32("add.x0"), c.io.f32("add.noise"));
        for k in c.meta["add_noise_at"].as_array().unwrap() {
            let k = k.as_u64().unwrap() as usize;
            let e = rel_err(&s.add_noise(&x0, &n, k).unwrap(), &c.io.f32(&format!("add.{k}")));
            assert!(e <= 1e-5, "{} add_noise at {k}: error {e:.3e}", c.name);
        }
    }
}

#[test]
fn every_cli_name_has_a_fixture() {
    let covered: Vec<SamplerKind> = cases().iter().map(|c| c.kind).collect();
    for k in SamplerKind::ALL {
        assert!(covered.contains(k), "no fixture for {}", k.cli_name());
    }
}

fn config(json: &str) -> ScheduleConfig {
    ScheduleConfig::from_reader(&ConfigReader::parse(Path::new("scheduler_config.json"), json).unwrap()).unwrap()
}

#[test]
fn unknown_sampler_name_is_an_error() {
    let e = SamplerKind::parse("dpmpp_3m").unwrap_err().to_string();
    assert!(e.contains("unknown sampler `dpmpp_3m`") && e.contains("unipc") && e.contains("dpmpp_2m_sde"), "{e}");
}

#[test]
fn unknown_scheduler_class_is_an_error() {
    let e = SamplerKind::from_config(&config(r#"{"_class_name": "KDPM2DiscreteScheduler"}"#)).unwrap_err().to_string();
    assert!(e.contains("KDPM2DiscreteScheduler") && e.contains("--sampler"), "{e}");
}

#[test]
fn class_names_map_to_samplers() {
    for (class, extra, want) in [
        ("PNDMScheduler", "", "ddim"),
        ("DDPMScheduler", "", "ddpm"),
        ("EulerDiscreteScheduler", "", "euler"),
        ("EulerAncestralDiscreteScheduler", "", "euler_a"),
        ("HeunDiscreteScheduler", "", "heun"),
        ("DPMSolverMultistepScheduler", "", "dpmpp_2m"),
        ("DPMSolverMultistepScheduler", r#", "use_karras_sigmas": true"#, "dpmpp_2m_karras"),
        ("DPMSolverMultistepScheduler", r#", "algorithm_type": "sde-dpmsolver++""#, "dpmpp_2m_sde"),
        ("UniPCMultistepScheduler", "", "unipc"),
        ("LCMScheduler", "", "lcm"),
        ("TCDScheduler", "", "tcd"),
    ] {
        let cfg = config(&format!(r#"{{"_class_name": "{class}"{extra}}}"#));
        assert_eq!(SamplerKind::from_config(&cfg).unwrap().cli_name(), want, "{class}{extra}");
    }
}

#[test]
fn unsupported_options_name_the_field() {
    let dpm = |extra: &str| config(&format!(r#"{{"_class_name": "DPMSolverMultistepScheduler"{extra}}}"#));
    let e = samplers::build(SamplerKind::DpmPP2M, &dpm(r#", "solver_order": 3"#), 20, 0.0).err().unwrap().to_string();
    assert!(e.contains("solver_order") && e.contains('3'), "{e}");
    let e = SamplerKind::from_config(&dpm(r#", "algorithm_type": "deis""#)).unwrap_err().to_string();
    assert!(e.contains("algorithm_type") && e.contains("deis"), "{e}");
    let e = samplers::build(SamplerKind::Euler, &config(r#"{"use_exponential_sigmas": true}"#), 20, 0.0).err().unwrap().to_string();
    assert!(e.contains("use_exponential_sigmas"), "{e}");
    let e = samplers::build(SamplerKind::Ddpm, &config(r#"{"variance_type": "learned_range"}"#), 20, 0.0).err().unwrap().to_string();
    assert!(e.contains("variance_type") && e.contains("learned_range"), "{e}");
    let e = samplers::build(SamplerKind::UniPc, &config(r#"{"solver_type": "bh3"}"#), 20, 0.0).err().unwrap().to_string();
    assert!(e.contains("solver_type"), "{e}");
    let e = samplers::build(SamplerKind::Lcm, &config(r#"{"original_inference_steps": 4}"#), 8, 0.0).err().unwrap().to_string();
    assert!(e.contains("original_inference_steps"), "{e}");
}

#[test]
fn cli_name_decides_dpm_variant() {
    // A config asking for Karras and SDE still gives plain DPM-Solver++ under `dpmpp_2m`.
    let cfg = config(r#"{"_class_name": "DPMSolverMultistepScheduler", "use_karras_sigmas": true, "algorithm_type": "sde-dpmsolver++", "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "steps_offset": 1, "timestep_spacing": "leading"}"#);
    let plain = samplers::build(SamplerKind::DpmPP2M, &cfg, 20, 0.0).unwrap();
    let want = config(r#"{"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "steps_offset": 1, "timestep_spacing": "leading"}"#);
    let reference = samplers::build(SamplerKind::DpmPP2M, &want, 20, 0.0).unwrap();
    assert_eq!(plain.timesteps(), reference.timesteps());
    let karras = samplers::build(SamplerKind::DpmPP2MKarras, &want, 20, 0.0).unwrap();
    assert_ne!(karras.timesteps(), reference.timesteps());
}
