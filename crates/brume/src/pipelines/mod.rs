//! What a person runs: a model opened segment by segment, and the pipelines over it.

pub mod image_io;
pub mod model;
pub mod random_model;
pub mod single_file;
pub mod txt2img;

pub use model::{AnyVaeDecoder, AnyVaeEncoder, OpenOptions, SdModel, VaeConfig};
pub use txt2img::{txt2img, Generated, Progress, Txt2ImgRequest};
