//! How a server is set up: where it listens, its token, its limits, CORS
//! origins, the data directory and the runtime's models and memory policy.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use brume_runtime::{Limits, MemoryPolicy, ModelEntry};

/// Request bodies larger than this are refused with 413 (a 4096 x 4096 PNG in
/// base64 and its mask fit).
pub const DEFAULT_BODY_LIMIT: usize = 32 << 20;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Port 0 picks a free port; [`crate::Server::addr`] tells which.
    pub listen: SocketAddr,
    /// When set, every request needs it (Bearer, or HTTP Basic's password);
    /// required for any address but loopback.
    pub token: Option<String>,
    /// Origins allowed to call from a browser (`--cors`); none: no CORS headers,
    /// and requests carrying another site's Origin are refused.
    pub cors_origins: Vec<String>,
    /// The gallery's directory (created 0700).
    pub data_dir: PathBuf,
    pub body_limit: usize,
    pub models: Vec<ModelEntry>,
    pub default_model: Option<String>,
    pub memory: MemoryPolicy,
    pub limits: Limits,
    pub queue_limit: usize,
    pub max_job_time: Option<Duration>,
}

impl ServerConfig {
    /// Loopback on port 7860 with the runtime's default limits.
    pub fn new(models: Vec<ModelEntry>, data_dir: PathBuf) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 7860)),
            token: None,
            cors_origins: Vec::new(),
            data_dir,
            body_limit: DEFAULT_BODY_LIMIT,
            models,
            default_model: None,
            memory: MemoryPolicy::default(),
            limits: Limits::default(),
            queue_limit: 64,
            max_job_time: Some(Duration::from_secs(600)),
        }
    }

    /// Refuses settings the server must not start with.
    pub fn check(&self) -> Result<(), crate::ServeError> {
        if let Some(t) = &self.token {
            if t.is_empty() || t.chars().any(|c| c.is_control() || c.is_whitespace()) {
                return Err(crate::ServeError::Config(
                    "--token must be non-empty, without spaces or control characters".into(),
                ));
            }
        }
        if !self.listen.ip().is_loopback() && self.token.is_none() {
            return Err(crate::ServeError::Config(format!(
                "refusing to listen on {} without a token: anyone who can reach it could use it. \
                 Pass --token T (clients send `Authorization: Bearer T`), or listen on 127.0.0.1",
                self.listen
            )));
        }
        for o in &self.cors_origins {
            if o != "*" && !(o.starts_with("http://") || o.starts_with("https://")) {
                return Err(crate::ServeError::Config(format!(
                    "--cors {o}: expected an origin like http://localhost:3000"
                )));
            }
        }
        if self.body_limit == 0 {
            return Err(crate::ServeError::Config(
                "the body limit must be positive".into(),
            ));
        }
        Ok(())
    }
}
