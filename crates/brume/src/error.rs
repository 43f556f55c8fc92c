//! Errors as types: every failure names the file, tensor, field or shape involved,
//! so a person can fix the input without reading our code.

use std::path::PathBuf;

/// Errors from reading model files.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not found{hint}")]
    NotFound { path: PathBuf, hint: String },
    #[error(
        "{path}: this is a PyTorch pickle checkpoint ({kind}). brume never unpickles files, because unpickling can \
         run arbitrary code. Convert it once to .safetensors, e.g. with \
         `python -c \"import torch, safetensors.torch as st; sd = torch.load('IN', map_location='cpu', weights_only=True); \
         sd = sd.get('state_dict', sd); st.save_file({{k: v.contiguous() for k, v in sd.items()}}, 'OUT.safetensors')\"`"
    )]
    Pickle { path: PathBuf, kind: &'static str },
    #[error("{path}: truncated: the file has {len} bytes but {needed} are needed ({what})")]
    Truncated {
        path: PathBuf,
        len: u64,
        needed: u64,
        what: String,
    },
    #[error("{path}: invalid safetensors header: {reason}")]
    BadHeader { path: PathBuf, reason: String },
    #[error("{path}: tensor `{tensor}`: {reason}")]
    BadTensor {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
    #[error("{path}: missing tensor `{tensor}` (expected shape {expected:?}) needed by {module}")]
    MissingTensor {
        path: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        module: String,
    },
    #[error("{path}: tensor `{tensor}` has shape {found:?} but {module} needs {expected:?}")]
    ShapeMismatch {
        path: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
        module: String,
    },
    #[error("{path}: tensor `{tensor}` has dtype {found} which {module} cannot use (expected a floating point type)")]
    DTypeMismatch {
        path: PathBuf,
        tensor: String,
        found: String,
        module: String,
    },
    #[error("{path}: compressed tensor `{tensor}`: {source}")]
    Quantized {
        path: PathBuf,
        tensor: String,
        /// Boxed to keep `LoadError` small (it travels in every load `Result`).
        #[source]
        source: Box<crate::quantization::QuantError>,
    },
    #[error("{path}: {count} unexpected tensor(s) for {module}, e.g. {examples}")]
    UnexpectedTensors {
        path: PathBuf,
        count: usize,
        examples: String,
        module: String,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: config field `{field}`: {reason}")]
    Config {
        path: PathBuf,
        field: String,
        reason: String,
    },
    #[error("{path}: {reason}")]
    Layout { path: PathBuf, reason: String },
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] brume_tokenizer::TokenizerError),
    #[error("tensor error while loading {context}: {source}")]
    Candle {
        context: String,
        #[source]
        source: candle_core::Error,
    },
}

/// Errors while running a model or pipeline.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Boxed: a `LoadError` carries paths and names, and every `Result` in the
    /// run path would otherwise grow to its size.
    #[error(transparent)]
    Load(Box<LoadError>),
    #[error("{0}")]
    Invalid(String),
    #[error("cancelled")]
    Cancelled,
    /// The request cannot run within the memory budget, found before the
    /// allocation that would have got the process killed.
    #[error("out of memory budget {when}: the budget is {budget} but the smallest plan ({plan}) needs {need} of private memory (its estimate plus headroom)")]
    OverBudget {
        /// What was about to run (e.g. "before planning", "before unet", "before step 7").
        when: String,
        /// The budget, as resolved (with where it came from).
        budget: String,
        need: String,
        plan: String,
    },
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("{path}: cannot write: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl From<LoadError> for RunError {
    fn from(e: LoadError) -> Self {
        RunError::Load(Box::new(e))
    }
}

pub type Result<T, E = RunError> = std::result::Result<T, E>;
