//! The runtime's errors: a refused submission names the field at fault, a
//! failed job says why in words a person can act on.

use std::time::Duration;

/// Why a job was not accepted. Nothing was queued.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    /// A setting is out of range or does not fit the model; `field` names it as
    /// the job spec does (`steps`, `width`, `image`, `mask`, ...).
    #[error("{field}: {message}")]
    Invalid { field: &'static str, message: String },
    /// The queue holds its limit of jobs; try again after `retry_after`.
    #[error("the queue is full ({limit} jobs); retry in {} s", retry_after.as_secs().max(1))]
    QueueFull { limit: usize, retry_after: Duration },
    /// The runtime is shutting down or its worker has stopped.
    #[error("the runtime is not running")]
    Stopped,
}

impl SubmitError {
    pub fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        SubmitError::Invalid { field, message: message.into() }
    }

    /// The field at fault, if the error is about one.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            SubmitError::Invalid { field, .. } => Some(field),
            _ => None,
        }
    }
}

/// Why an accepted job failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct JobError {
    /// What kind of failure, for clients that branch on it.
    pub kind: JobErrorKind,
    /// The request field at fault, when one is (a size the memory plan refuses
    /// names `width`).
    pub field: Option<&'static str>,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobErrorKind {
    /// The request does not fit the model (found once the model was open).
    Invalid,
    /// No memory plan fits the budget; the message says the smallest need and
    /// the fallbacks that would fit.
    OverBudget,
    /// The model could not be opened or loaded.
    Model,
    /// The result could not be stored (the sink refused it).
    Storage,
    /// Anything else from the engine.
    Engine,
}

impl JobError {
    pub fn new(kind: JobErrorKind, field: Option<&'static str>, message: impl Into<String>) -> Self {
        Self { kind, field, message: message.into() }
    }

    /// Classifies an engine error.
    pub fn from_run(e: brume::RunError) -> Self {
        use brume::RunError;
        match e {
            RunError::Invalid(m) => JobError::new(JobErrorKind::Invalid, None, m),
            e @ RunError::OverBudget { .. } => JobError::new(JobErrorKind::OverBudget, Some("width"), e.to_string()),
            RunError::Load(l) => JobError::new(JobErrorKind::Model, Some("model"), l.to_string()),
            e => JobError::new(JobErrorKind::Engine, None, e.to_string()),
        }
    }
}

/// The runtime could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("no models to serve")]
    NoModels,
    #[error("model `{name}`: {message}")]
    Model { name: String, message: String },
    #[error("two models are named `{0}`")]
    DuplicateName(String),
    #[error("cannot start the worker thread: {0}")]
    Thread(#[from] std::io::Error),
}
