//! Property tests over the request and config space (issue 52, classes 2-4):
//! whatever a user or a file says, brume gives a clean error or a correct
//! result (finite pixels in [0, 1] of the asked shape), never a panic, an
//! abort, or a black picture reported as success. Cases are few and pictures
//! tiny so the file runs in seconds; `fuzz/` runs the parsers for longer.

use std::io::Cursor;
use std::path::{Path, PathBuf};

use brume::memory::planner::{plan, ResolutionFallback};
use brume::memory::{ModelProfile, RequestShape};
use brume::models::config::ConfigReader;
use brume::pipelines::{img2img, inpaint, txt2img, Flow, GenerationRequest, OpenOptions, PasteBack, RunOptions, SdModel};
use brume::runtime::budget::Budget;
use brume::samplers::schedule::ScheduleConfig;
use brume::samplers::{build, noise_source, RngKind, SamplerKind};
use candle_core::{DType, Device, Tensor};
use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::{json, Map, Value};

fn builtin_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/builtin"))
}

fn open(unet: Option<&str>) -> SdModel {
    SdModel::open(&builtin_root(), &OpenOptions { unet: unet.map(str::to_string), ..Default::default() }).unwrap()
}

/// A correct picture: the asked shape, every value finite and in [0, 1].
fn assert_picture(img: &Tensor, req: &GenerationRequest) {
    let (b, c, h, w) = img.dims4().unwrap();
    assert_eq!((b, c, h, w), (req.batch, 3, req.height, req.width));
    let v = img.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(v.iter().all(|x| x.is_finite() && (0.0..=1.0).contains(x)), "non-finite or out-of-range pixels reported as success");
}

fn side() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => (1usize..=6).prop_map(|k| k * 8),
        1 => 0usize..70,
        1 => Just(4),
        1 => Just(4104),
        1 => Just(usize::MAX),
    ]
}

fn number(lo: f64, hi: f64) -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => lo..hi,
        1 => Just(f64::NAN),
        1 => Just(f64::INFINITY),
        1 => Just(-1e300),
        1 => Just(1e300),
        1 => Just(0.0),
    ]
}

prop_compose! {
    fn request()(
        prompt in prop_oneof![".{0,30}", Just("a red circle and a blue square ".repeat(20)), Just("\u{1b}[2J\r\u{0}".to_string())],
        negative in proptest::option::of(".{0,10}"),
        steps in prop_oneof![4 => 1usize..=3, 1 => Just(0usize), 1 => Just(1001usize), 1 => Just(usize::MAX)],
        guidance in number(-5.0, 150.0),
        eta in number(-0.5, 1.5),
        width in side(),
        height in side(),
        batch in prop_oneof![4 => 1usize..=2, 1 => Just(0usize), 1 => Just(65usize)],
        clip_skip in prop_oneof![4 => 0usize..=3, 1 => 4usize..=40, 1 => Just(usize::MAX)],
        sampler in proptest::option::of(0usize..SamplerKind::ALL.len()),
        torch in any::<bool>(),
        seed in any::<u64>(),
    ) -> GenerationRequest {
        GenerationRequest {
            prompt,
            negative_prompt: negative,
            steps,
            guidance_scale: guidance,
            width,
            height,
            seed,
            rng: if torch { RngKind::Torch } else { RngKind::Brume },
            eta,
            clip_skip,
            sampler: sampler.map(|i| SamplerKind::ALL[i]),
            batch,
        }
    }
}

proptest! {
    #![proptest_config(Config { cases: 48, failure_persistence: None, ..Config::default() })]

    /// txt2img over the request space, on both UNets of the built-in model,
    /// with the memory planner run first on the same request as the CLI does.
    #[test]
    fn any_request_gives_a_clean_error_or_a_correct_picture(req in request(), lcm in any::<bool>()) {
        let model = open(lcm.then_some("unet_lcm"));
        let profile = ModelProfile::of(&model, DType::F32);
        let shape = RequestShape { batch: req.batch, guided: req.guided(&model), width: req.width, height: req.height, encodes_image: false };
        let planned = plan(&profile, &shape, &Budget::explicit(64 << 30, "test"), ResolutionFallback::Report, &[]);
        let valid = req.validate(&model);
        if valid.is_ok() {
            prop_assert!(planned.is_ok(), "a valid request must plan: {:?}", planned.err().map(|e| e.to_string()));
        }
        let mut noise = noise_source(req.rng, req.seed);
        match txt2img(&model, &req, &RunOptions::default(), noise.as_mut(), None, &mut |_| Flow::Continue) {
            Ok(out) => {
                prop_assert!(valid.is_ok());
                assert_picture(&out.image, &req);
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    /// img2img and inpainting over strength, masks, feathering and outpainting sides.
    #[test]
    fn any_edit_gives_a_clean_error_or_a_correct_picture(
        req in request(),
        strength in number(-0.5, 1.5),
        mask_bits in proptest::collection::vec(any::<bool>(), 64),
        feather in prop_oneof![0usize..=4, Just(usize::MAX)],
        extend in proptest::array::uniform4(prop_oneof![0usize..=16, Just(usize::MAX / 2)]),
        mode in 0u8..3,
    ) {
        let model = open(None);
        let req = GenerationRequest { width: 32, height: 32, batch: 1, ..req };
        let dev = Device::Cpu;
        let image = ((Tensor::rand(0f32, 1f32, (1, 3, 32, 32), &dev).unwrap() * 2.0).unwrap() - 1.0).unwrap();
        let mut noise = noise_source(req.rng, req.seed);
        let opts = RunOptions::default();
        let result = match mode {
            0 => img2img(&model, &req, &image, strength, &opts, noise.as_mut(), None, &mut |_| Flow::Continue).map(|g| (g, (32, 32))),
            1 => {
                let m: Vec<f32> = (0..32 * 32).map(|i| if mask_bits[(i / 32 / 4) * 8 + (i % 32) / 4] { 1.0 } else { 0.0 }).collect();
                let mask = Tensor::from_vec(m, (1, 1, 32, 32), &dev).unwrap();
                inpaint(&model, &req, &image, &mask, strength, Some(PasteBack { feather }), &opts, noise.as_mut(), None, &mut |_| Flow::Continue).map(|g| (g, (32, 32)))
            }
            _ => match brume::pipelines::outpaint_canvas(&image, extend, 4, 8) {
                Ok((canvas, mask)) => {
                    let (_, _, h, w) = canvas.dims4().unwrap();
                    let req = GenerationRequest { width: w, height: h, ..req.clone() };
                    inpaint(&model, &req, &canvas, &mask, 1.0, Some(PasteBack { feather }), &opts, noise.as_mut(), None, &mut |_| Flow::Continue).map(|g| (g, (w, h)))
                }
                Err(e) => Err(e),
            },
        };
        match result {
            Ok((out, (w, h))) => assert_picture(&out.image, &GenerationRequest { width: w, height: h, ..req }),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }
}

/// Values a config field may hold: plausible ones and wild ones of every JSON type.
fn json_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => (0u64..2000).prop_map(Value::from),
        1 => any::<u64>().prop_map(Value::from),
        1 => any::<i64>().prop_map(Value::from),
        3 => (-1.0f64..2.0).prop_map(Value::from),
        1 => any::<f64>().prop_filter("JSON numbers are finite", |v| v.is_finite()).prop_map(Value::from),
        1 => prop_oneof![Just("Infinity"), Just("NaN"), Just("-Infinity")].prop_map(Value::from),
        2 => any::<bool>().prop_map(Value::from),
        1 => Just(Value::Null),
        1 => proptest::collection::vec(0u64..3000, 0..6).prop_map(|v| json!(v)),
        2 => prop_oneof![
            Just("linear"), Just("scaled_linear"), Just("squaredcos_cap_v2"), Just("epsilon"), Just("v_prediction"),
            Just("sample"), Just("leading"), Just("linspace"), Just("trailing"), Just("DDIMScheduler"),
            Just("EulerDiscreteScheduler"), Just("LCMScheduler"), Just("DPMSolverMultistepScheduler"),
            Just("UniPCMultistepScheduler"), Just("TCDScheduler"), Just("dpmsolver++"), Just("zero"), Just(""),
        ].prop_map(Value::from),
    ]
}

fn config_map(keys: &'static [&'static str]) -> impl Strategy<Value = Map<String, Value>> {
    proptest::collection::vec((0..keys.len(), json_value()), 0..12)
        .prop_map(move |kv| kv.into_iter().map(|(k, v)| (keys[k].to_string(), v)).collect())
}

const SCHEDULER_KEYS: &[&str] = &[
    "_class_name", "num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "prediction_type",
    "timestep_spacing", "steps_offset", "set_alpha_to_one", "clip_sample", "clip_sample_range", "use_karras_sigmas",
    "solver_order", "original_inference_steps", "final_sigmas_type", "lower_order_final", "algorithm_type",
    "timestep_type", "interpolation_type", "euler_at_final", "use_lu_lambdas", "thresholding", "trained_betas",
    "rescale_betas_zero_snr", "solver_type", "predict_x0", "disable_corrector", "timestep_scaling",
];

const MODEL_KEYS: &[&str] = &[
    "_class_name", "in_channels", "out_channels", "block_out_channels", "layers_per_block", "latent_channels",
    "norm_num_groups", "act_fn", "scaling_factor", "shift_factor", "sample_size", "cross_attention_dim",
    "attention_head_dim", "num_attention_heads", "down_block_types", "up_block_types", "transformer_layers_per_block",
    "time_cond_proj_dim", "hidden_size", "intermediate_size", "num_hidden_layers", "max_position_embeddings",
    "vocab_size", "upsampling_scaling_factor", "encoder_block_out_channels", "decoder_block_out_channels",
    "num_encoder_blocks", "num_decoder_blocks", "hidden_act", "projection_dim", "use_linear_projection",
];

proptest! {
    #![proptest_config(Config { cases: 256, failure_persistence: None, ..Config::default() })]

    /// Any scheduler config: an error naming a field, or a schedule every
    /// sampler builds and steps through with finite values and in-range timesteps.
    #[test]
    fn any_scheduler_config_is_an_error_or_a_working_schedule(map in config_map(SCHEDULER_KEYS), steps in 1usize..60, eta in 0.0f64..=1.0) {
        let reader = ConfigReader::from_map(Path::new("scheduler_config.json"), map);
        let Ok(cfg) = ScheduleConfig::from_reader(&reader) else { return Ok(()) };
        let ac = cfg.alphas_cumprod();
        prop_assert!(ac.iter().all(|a| a.is_finite() && *a > 0.0 && *a <= 1.0));
        let dev = Device::Cpu;
        let sample = Tensor::ones((1, 4, 2, 2), DType::F32, &dev).unwrap();
        let out = (Tensor::ones((1, 4, 2, 2), DType::F32, &dev).unwrap() * 0.1).unwrap();
        for &kind in SamplerKind::ALL {
            let Ok(mut s) = build(kind, &cfg, steps, eta) else { continue };
            let ts = s.timesteps().to_vec();
            prop_assert!(!ts.is_empty());
            prop_assert!(ts.iter().all(|t| t.is_finite() && *t >= 0.0 && *t < cfg.num_train_timesteps as f64), "{kind:?}: {ts:?}");
            let mut noise = noise_source(RngKind::Brume, 0);
            let mut x = (sample.clone() * s.init_noise_sigma()).unwrap();
            let _ = s.add_noise(&sample, &out, 0);
            for i in 0..ts.len() {
                let scaled = s.scale_model_input(&x, i);
                prop_assert!(scaled.is_ok());
                match s.step(&out, i, &x, noise.as_mut()) {
                    Ok(next) => x = next,
                    Err(_) => break,
                }
            }
        }
    }

    /// Any model config: parsed or refused with an error, never a panic.
    #[test]
    fn any_model_config_is_parsed_or_refused(map in config_map(MODEL_KEYS)) {
        let reader = ConfigReader::from_map(Path::new("config.json"), map);
        let _ = brume::models::UNetConfig::from_reader(&reader);
        let _ = brume::models::ClipTextConfig::from_reader(&reader);
        if let Ok(c) = brume::models::AutoencoderKLConfig::from_reader(&reader) {
            prop_assert!(c.scaling_factor.is_finite() && c.scaling_factor != 0.0);
            let _ = c.scale_factor();
        }
        if let Ok(c) = brume::models::autoencoder_tiny::AutoencoderTinyConfig::from_reader(&reader) {
            prop_assert!(c.scaling_factor.is_finite() && c.scaling_factor != 0.0);
        }
        let _ = brume::pipelines::SamplingDefaults::from_reader(&reader);
    }

    /// Any bytes in a PNG's metadata (a brume PNG with mutated bytes): text read
    /// within its bound or an error; a recipe parsed, then validated, or refused.
    #[test]
    fn any_png_metadata_is_read_or_refused(flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8), cut in any::<prop::sample::Index>(), truncate in any::<bool>()) {
        let mut bytes = sample_png();
        for (i, b) in flips {
            let i = i.index(bytes.len());
            bytes[i] = b;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        if let Ok(chunks) = brume::pipelines::recipe::read_png_text_from(Cursor::new(&bytes), "fuzz.png") {
            for (k, v) in chunks {
                if k == brume::pipelines::recipe::RECIPE_KEY {
                    if let Ok(r) = serde_json::from_str::<brume::pipelines::recipe::Recipe>(&v) {
                        if let Ok(req) = r.request() {
                            let _ = req.validate(&open(None));
                        }
                    }
                }
            }
        }
    }

    /// Any safetensors header: opened (every entry within the file) or refused.
    #[test]
    fn any_safetensors_header_is_opened_or_refused(header in prop_oneof![
        ".{0,200}",
        Just(r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#.to_string()),
        Just(r#"{"a":{"dtype":"F32","shape":[18446744073709551615,2],"data_offsets":[0,16]}}"#.to_string()),
        Just(r#"{"a":{"dtype":"F16","shape":[4294967296,4294967296],"data_offsets":[0,0]}}"#.to_string()),
        Just(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[16,0]}}"#.to_string()),
    ], len_delta in -4i64..4, data in proptest::collection::vec(any::<u8>(), 0..64)) {
        let mut bytes = ((header.len() as i64 + len_delta).max(0) as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&data);
        let leaked: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        if let Ok(f) = brume::loading::safetensors::SafetensorsFile::from_static(Path::new("fuzz.safetensors"), leaked) {
            for e in f.entries().values() {
                prop_assert!(f.bytes(e).len() <= leaked.len());
            }
        }
    }

    /// Any mask against any image: adapted or refused.
    #[test]
    fn any_mask_is_adapted_or_refused(iw in 0u32..40, ih in 0u32..40, mw in 0u32..40, mh in 0u32..40) {
        let img = image::DynamicImage::ImageRgb8(image::RgbImage::new(iw, ih));
        let Ok(loaded) = brume::pipelines::image_io::prepare_image(img, 8) else { return Ok(()) };
        let mask = image::DynamicImage::ImageLuma8(image::GrayImage::new(mw, mh));
        if let Ok(m) = brume::pipelines::image_io::prepare_mask(mask, "mask", &loaded) {
            prop_assert_eq!(m.dims4().unwrap(), (1, 1, loaded.size.1 as usize, loaded.size.0 as usize));
        }
    }
}

/// A small PNG as brume writes it, with both text chunks.
fn sample_png() -> Vec<u8> {
    static PNG: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    PNG.get_or_init(make_png).clone()
}

fn make_png() -> Vec<u8> {
    let model = open(None);
    let req = GenerationRequest::new("a red circle", 8);
    let recipe = brume::pipelines::recipe::Recipe::new(brume::pipelines::recipe::Mode::Txt2img, &req, SamplerKind::Ddim, &model);
    brume::pipelines::recipe::encode_png(&image::RgbImage::new(8, 8), Some(&recipe)).unwrap()
}
