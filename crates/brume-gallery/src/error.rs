//! The gallery's errors: each names the file or image it is about, and "not
//! found" is its own variant so callers (HTTP 404, CLI messages) can tell it
//! from a broken disk.

use std::path::PathBuf;

use crate::ImageId;

/// Everything that can go wrong in the gallery.
#[derive(Debug, thiserror::Error)]
pub enum GalleryError {
    /// No image with this id (or it is soft-deleted where live images were asked for).
    #[error("gallery image {0} not found")]
    NotFound(ImageId),
    /// A file or directory operation failed.
    #[error("{path}: {action}: {source}")]
    Io {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The data directory is unusable (a symlink, a file, ...).
    #[error("gallery data directory {path}: {reason}")]
    DataDir { path: PathBuf, reason: String },
    /// SQLite refused something.
    #[error("gallery database: {context}: {source}")]
    Db {
        context: &'static str,
        #[source]
        source: rusqlite::Error,
    },
    /// The database was written by a newer brume (its schema version is higher than ours).
    #[error("gallery database has schema version {found}, this brume knows up to {known}: upgrade brume")]
    TooNew { found: i64, known: i64 },
    /// The bundled SQLite lacks a feature the gallery needs.
    #[error("the SQLite in this build lacks {0}")]
    MissingFeature(&'static str),
    /// The bytes are not a PNG the gallery can store (with the reason).
    #[error("{what}: not a usable PNG: {reason}")]
    BadPng { what: String, reason: String },
    /// A PNG's text metadata is malformed or too large to read safely.
    #[error("{what}: metadata: {reason}")]
    Metadata { what: String, reason: String },
    /// An imported PNG carries neither a brume recipe nor A1111 parameters.
    #[error("{0}: carries no brume recipe or A1111 parameters to import")]
    NoRecipe(String),
    /// A query or edit argument is invalid.
    #[error("{field}: {message}")]
    Invalid { field: &'static str, message: String },
}

impl GalleryError {
    pub(crate) fn io(path: impl Into<PathBuf>, action: &'static str) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| GalleryError::Io { path, action, source }
    }

    pub(crate) fn db(context: &'static str) -> impl FnOnce(rusqlite::Error) -> Self {
        move |source| GalleryError::Db { context, source }
    }

    pub(crate) fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        GalleryError::Invalid {
            field,
            message: message.into(),
        }
    }

    /// Whether this is a "no such image" error (for a 404 rather than a 500).
    pub fn is_not_found(&self) -> bool {
        matches!(self, GalleryError::NotFound(_))
    }
}

/// The gallery's result type.
pub type Result<T, E = GalleryError> = std::result::Result<T, E>;
