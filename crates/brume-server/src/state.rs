//! What every handler shares: the runtime, the gallery, the settings, the
//! A1111 emulation's little state, and the shutdown signal long-lived streams
//! watch.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, RwLock};

use brume_gallery::Gallery;
use brume_runtime::{ModelEntry, Runtime};
use tokio::sync::watch;

use crate::error::ApiError;

#[derive(Clone)]
pub struct AppState {
    pub runtime: Runtime,
    pub gallery: Arc<Gallery>,
    pub settings: Arc<Settings>,
    pub a1111: Arc<A1111State>,
    /// Turns true when the server begins to stop (SSE and WebSocket streams end).
    pub shutdown: watch::Receiver<bool>,
}

/// The parts of the configuration handlers read.
pub struct Settings {
    pub token: Option<String>,
    pub cors_origins: Vec<String>,
    pub body_limit: usize,
    pub loopback: bool,
    /// The served models as configured (for A1111's `filename`).
    pub models: Vec<ModelEntry>,
    pub queue_limit: usize,
}

/// A1111's process-wide settings: the checkpoint later requests use, the
/// options clients set (echoed back), and the flags `progress` reports.
pub struct A1111State {
    pub model: RwLock<String>,
    pub options: Mutex<serde_json::Map<String, serde_json::Value>>,
    pub interrupted: AtomicBool,
    pub skipped: AtomicBool,
}

impl A1111State {
    pub fn new(default_model: &str) -> Self {
        Self {
            model: RwLock::new(default_model.to_string()),
            options: Mutex::new(serde_json::Map::new()),
            interrupted: AtomicBool::new(false),
            skipped: AtomicBool::new(false),
        }
    }

    pub fn current_model(&self) -> String {
        self.model.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Runs blocking work (gallery calls, image decoding) off the async threads.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal("a blocking task", e))
}
