//! Where a small job's time goes through the runtime: the built-in model at
//! 128 px, repeated, with the few-step UNet and the full one. Prints medians.
//! `cargo run --release -p brume-runtime --example job_times [MODEL_DIR]`

use std::path::PathBuf;

use brume_runtime::*;

fn main() {
    let path = std::env::args().nth(1).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("models/builtin"));
    let entry = ModelEntry { name: "builtin".into(), source: ModelSource::Path { path, config_dir: None, variant: None } };
    let rt = Runtime::start(RuntimeConfig::new(vec![entry])).expect("model opens");
    for (unet, steps) in [(Some("unet_lcm"), 1), (Some("unet_lcm"), 4), (None, 25)] {
        let mut rows: Vec<Timings> = Vec::new();
        for i in 0..12 {
            let spec = JobSpec {
                unet: unet.map(str::to_string),
                steps: Some(steps),
                seed: Some(i),
                previews: PreviewPolicy::OFF,
                ..JobSpec::txt2img(if i % 2 == 0 { "a red circle on a blue background" } else { "a big green square" })
            };
            let id = rt.submit(spec).unwrap();
            let s = rt.wait(id).unwrap();
            rows.push(s.output.expect("done").timings.clone());
        }
        let med = |f: &dyn Fn(&Timings) -> f64| {
            let mut v: Vec<f64> = rows.iter().skip(2).map(f).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        println!(
            "{:9} {steps:2} steps: total {:6.1} ms (text {:5.1}, denoise {:6.1}, decode {:5.1}); cached prompts {}/{}",
            unet.unwrap_or("unet"),
            med(&|t| t.total_ms),
            med(&|t| t.text_encoder_ms),
            med(&|t| t.denoise_ms),
            med(&|t| t.decode_ms),
            rows.iter().filter(|t| t.text_encoder_cached).count(),
            rows.len()
        );
    }
}
