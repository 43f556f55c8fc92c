//! Real-time img2img over brume's engine: frames from a camera-like source go
//! through three threads (capture / decode -> diffuse -> encode / display) joined
//! by bounded queues that drop the oldest frame, so latency stays bounded and
//! nothing backs up when diffusion is slower than the source.
//!
//! - [`queue`]: the bounded, drop-oldest queue between stages.
//! - [`source`] / [`y4m`]: PNG frame folders, Y4M files, other video through ffmpeg.
//! - [`diffuser`]: [`diffuser::FrameDiffuser`], one img2img per frame with every model
//!   segment resident, the prompt's conditioning computed once, and one fixed noise.
//! - [`techniques`]: frame-to-frame tricks, each switchable (similarity skip,
//!   previous-latent blending, display smoothing) and the flicker measure.
//! - [`governor`]: picks resolution and steps for a target frame time from measured timings.
//! - [`pipeline`]: the threaded pipeline, the same work in one thread, and the per-frame report.

pub mod diffuser;
pub mod error;
pub mod governor;
pub mod pipeline;
pub mod queue;
pub mod source;
pub mod split;
pub mod techniques;
pub mod y4m;

pub use error::{LiveError, Result};
pub use pipeline::{Diffuse, Diffused, FrameTimes, PipelineOptions, Report};
pub use queue::{DropQueue, WhenFull};
