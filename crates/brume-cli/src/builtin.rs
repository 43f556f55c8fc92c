//! The built-in model, compiled into the executable so `brume generate` works
//! on a fresh install with no path and no download.

use brume::pipelines::EmbeddedFile;

macro_rules! embed {
    ($($path:literal),* $(,)?) => {
        &[$(EmbeddedFile { path: $path, bytes: include_bytes!(concat!("../../../models/builtin/", $path)) }),*]
    };
}

/// Every file of `models/builtin/` the engine reads (the tokenizer is the
/// engine's embedded CLIP vocabulary).
pub static FILES: &[EmbeddedFile] = embed!(
    "model_index.json",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "unet/config.json",
    "unet/diffusion_pytorch_model.safetensors",
    "unet/sampling_defaults.json",
    "unet_lcm/config.json",
    "unet_lcm/diffusion_pytorch_model.safetensors",
    "unet_lcm/sampling_defaults.json",
    "scheduler_lcm/scheduler_config.json",
    // The vocabulary is the engine's; these two small files carry its settings
    // so a converted copy has the original's tokenizer folder.
    "tokenizer/tokenizer_config.json",
    "tokenizer/special_tokens_map.json",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
);

/// Every word the built-in model's captions use (its shapes world: colours,
/// shapes, sizes, positions, relations, backgrounds and the caption templates'
/// own words), gathered from the world's caption generator so it stays in step.
pub fn vocabulary() -> &'static std::collections::BTreeSet<String> {
    static WORDS: std::sync::OnceLock<std::collections::BTreeSet<String>> = std::sync::OnceLock::new();
    WORDS.get_or_init(|| {
        let cfg = brume_world::scene::SampleConfig::default();
        let mut words = std::collections::BTreeSet::new();
        for seed in 0..2000u64 {
            let scene = brume_world::scene::sample_scene(seed, &cfg);
            // Template seeds pick the template and the synonyms: several per scene.
            for t in 0..4 * brume_world::caption::TEMPLATES as u64 {
                for w in words_of(&brume_world::caption(&scene, seed.wrapping_mul(31).wrapping_add(t))) {
                    words.insert(w);
                }
            }
        }
        // Words the caption grammar accepts that sampling may not draw.
        for w in ["there", "is", "picture", "image", "of", "with", "corner", "tiny", "little", "big", "center", "centre", "middle", "grey", "gray", "plain"] {
            words.insert(w.to_string());
        }
        words
    })
}

fn words_of(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()).map(str::to_lowercase)
}

/// A warning when a prompt for the built-in model uses words it never saw:
/// it only knows its shapes world, so they have no effect (or a random one).
/// Generate and edit call it when the built-in model runs.
pub fn vocabulary_warning(prompt: &str) -> Option<String> {
    let known = vocabulary();
    let mut unknown: Vec<String> = Vec::new();
    for w in words_of(prompt).filter(|w| !known.contains(w)) {
        if !unknown.contains(&w) {
            unknown.push(w);
        }
    }
    if unknown.is_empty() {
        return None;
    }
    unknown.truncate(12);
    let colours: Vec<&str> = brume_world::Colour::ALL.iter().map(|c| c.name()).collect();
    let shapes: Vec<&str> = brume_world::scene::Shape::ALL.iter().map(|s| s.name()).collect();
    Some(format!(
        "the built-in model only knows its shapes world; these words are outside its vocabulary and do nothing \
         useful: {}. It knows colours ({}), shapes ({}), sizes (small, large), positions (left, right, top, bottom, \
         centre, top left, ...), relations (left of, right of, above, below) and backgrounds (plain, gradient, \
         striped, checkered), e.g. \"a small red circle above a large blue square on a striped green background\"",
        brume::output::escape_control(&unknown.join(", ")),
        colours.join(", "),
        shapes.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_vocabulary_warning_names_unknown_words_only() {
        assert_eq!(super::vocabulary_warning("a red circle on a blue background"), None);
        // The README's examples stay inside the vocabulary.
        for p in [
            "a large red circle on a blue background",
            "a small yellow star above a large green square on a gray background",
            "there is a big purple ring in the centre on a white striped background",
            "a large orange triangle on the left on a black checkered background",
            "a tiny cyan diamond in the top left corner on a plain pink background",
        ] {
            assert_eq!(super::vocabulary_warning(p), None, "{p}");
        }
        let w = super::vocabulary_warning("a photo of a cat").unwrap();
        assert!(w.contains("photo") && w.contains("cat") && !w.contains("useful: a,"), "{w}");
    }
}
