//! Any bytes as a recipe (the JSON chunk `--from` reads): a request whose
//! numbers are checked, or an error.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(r) = serde_json::from_slice::<brume::pipelines::recipe::Recipe>(data) else { return };
    let _ = r.parameters_text();
    if let Ok(req) = r.request() {
        let _ = brume::pipelines::request::check_guidance_eta(req.guidance_scale, req.eta);
        let _ = brume::pipelines::img2img::strength_in_range(r.strength.unwrap_or(0.5));
    }
    let _ = serde_json::to_string(&r);
});
