//! Any bytes as a PNG's metadata: text read within its bound or an error; a
//! recipe in it parsed into a request, or refused.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(chunks) = brume::pipelines::recipe::read_png_text_from(std::io::Cursor::new(data), "fuzz.png") else { return };
    let total: usize = chunks.iter().map(|(_, v)| v.len()).sum();
    assert!(total <= brume::pipelines::recipe::MAX_PNG_TEXT_BYTES);
    for (k, v) in chunks {
        let _ = brume::output::escape_control(&k);
        let _ = brume::output::escape_control(&v);
        if k == brume::pipelines::recipe::RECIPE_KEY {
            if let Ok(r) = serde_json::from_str::<brume::pipelines::recipe::Recipe>(&v) {
                let _ = r.parameters_text();
                let _ = r.request();
            }
        }
    }
});
