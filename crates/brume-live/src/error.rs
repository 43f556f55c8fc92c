//! Errors of the live pipeline: each names the input, field or stage at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    /// An input that cannot be read as frames (path and what is wrong).
    #[error("{path}: {message}")]
    Input { path: PathBuf, message: String },
    /// A Y4M stream that does not follow the format (what and where).
    #[error("Y4M: {0}")]
    Y4m(String),
    /// A setting out of range (names the setting).
    #[error("{0}")]
    Invalid(String),
    /// ffmpeg is needed for this input and is missing or failed.
    #[error("ffmpeg: {0}")]
    Ffmpeg(String),
    #[error(transparent)]
    Run(#[from] brume::RunError),
    #[error(transparent)]
    Load(Box<brume::LoadError>),
    #[error(transparent)]
    Output(#[from] brume::output::OutputError),
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
    /// A stage's thread panicked (a bug: reported, not propagated as a panic).
    #[error("the {0} thread stopped unexpectedly")]
    Thread(&'static str),
}

impl From<brume::LoadError> for LiveError {
    fn from(e: brume::LoadError) -> Self {
        LiveError::Load(Box::new(e))
    }
}

pub type Result<T, E = LiveError> = std::result::Result<T, E>;
