//! brume-world: a procedural text-to-image world whose ground truth is known, so that a small
//! text-to-image model's prompt adherence can be *measured* instead of eyeballed.
//!
//! - [`scene`]: vocabulary, specs, scene sampling and the held-out split;
//! - [`caption`]: caption grammar (generation with paraphrases, and parsing back);
//! - [`render`]: anti-aliased rendering and the blur/noise degradation used in tests;
//! - [`judge`]: the deterministic image-vs-caption analyser;
//! - [`edits`]: held-out prompts paired with pictures to edit towards them;
//! - [`dataset`]: the training-set writer (PNGs + `captions.jsonl`).

pub mod caption;
pub mod colour;
pub mod dataset;
pub mod edits;
pub mod judge;
pub mod render;
pub mod rng;
pub mod scene;

pub use caption::{caption, caption_spec, parse_caption, ParseError};
pub use colour::Colour;
pub use dataset::{write_dataset, CaptionConfig};
pub use edits::{edit_cases, object_mask, EditCase};
pub use judge::{analyse, judge, Analysis, Detection, ObjectVerdict, Verdict};
pub use render::{degrade, render};
pub use scene::{
    held_out_prompts, held_out_scene, is_held_out, sample_scene, scene_from_spec, Background, BackgroundSpec, BgKind,
    Layout, Object, ObjectSpec, Position, Relation, SampleConfig, Scene, Shape, Size, Spec,
};
