//! What a person runs: a model opened segment by segment, and the pipelines over it.

pub mod conditioning;
pub mod decode;
pub mod denoise;
pub mod image_io;
pub mod img2img;
pub mod inpaint;
pub mod model;
pub mod preview;
pub mod random_model;
pub mod recipe;
pub mod request;
pub mod sampling_defaults;
pub mod single_file;
pub mod tiled_decode;
pub mod txt2img;

pub use conditioning::{Conditioning, ConditioningCache};
pub use denoise::{Inpainting, RunOptions};
pub use img2img::img2img;
pub use inpaint::{inpaint, outpaint_canvas, PasteBack};
pub use model::{AnyVaeDecoder, AnyVaeEncoder, EmbeddedFile, OpenOptions, SdModel, VaeConfig, EMBEDDED_ROOT};
pub use model::scheduler_folder_for;
pub use sampling_defaults::SamplingDefaults;
pub use request::{Flow, GenerationRequest, Generated, Progress, ProgressFn};
pub use txt2img::txt2img;
