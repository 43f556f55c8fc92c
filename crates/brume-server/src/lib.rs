//! `brume serve`: the local image service. Three APIs over one runtime and
//! one gallery: brume's own under `/api/v1` (jobs, events over SSE and
//! WebSocket, the gallery, an OpenAPI document), AUTOMATIC1111's subset under
//! `/sdapi/v1` and OpenAI's images API under `/v1`; and the web editor at `/`.
//!
//! Layers, outside in (as axum's examples and mini-redis arrange them):
//! [`respond`] (errors as JSON in each API's shape, the origin guard, auth),
//! the handlers ([`native`], [`gallery_api`], [`a1111`], [`openai`], [`web`]),
//! [`jobs`] (what they share about jobs), [`state`] (the runtime, the gallery),
//! and [`sink`] (every picture stored in the gallery before its job is done).
//! The runtime and the gallery are blocking libraries: handlers await
//! `Runtime::finished` and call the gallery through `spawn_blocking`.
//!
//! ```no_run
//! # async fn f(models: Vec<brume_runtime::ModelEntry>) -> Result<(), brume_server::ServeError> {
//! let mut config = brume_server::ServerConfig::new(models, "/tmp/brume-data".into());
//! config.listen = "127.0.0.1:0".parse().unwrap();
//! let server = brume_server::serve(config).await?;
//! println!("listening on http://{}", server.addr());
//! server.shutdown().await;
//! # Ok(()) }
//! ```

pub mod a1111;
pub mod config;
pub mod error;
pub mod extract;
pub mod gallery_api;
pub mod jobs;
pub mod native;
pub mod openai;
pub mod openapi;
pub mod respond;
pub mod sink;
pub mod state;
pub mod web;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::http::{header, HeaderValue, Method};
use axum::routing::{get, post};
use axum::Router;
use brume_gallery::{Gallery, ReconcileReport};
use brume_runtime::{Runtime, RuntimeConfig};
use tokio::sync::watch;

pub use brume_gallery::default_data_dir;
pub use config::ServerConfig;
pub use error::ApiError;
use state::{A1111State, AppState, Settings};

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Gallery(#[from] brume_gallery::GalleryError),
    #[error("{0}")]
    Runtime(#[from] brume_runtime::StartError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Internal(String),
}

/// A running server. Dropping it leaves the server running until the tokio
/// runtime ends; call [`Server::shutdown`] to stop it cleanly.
pub struct Server {
    addr: SocketAddr,
    runtime: Runtime,
    gallery: Arc<Gallery>,
    reconcile: ReconcileReport,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Server {
    /// The address bound (with the real port when port 0 was asked).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    pub fn gallery(&self) -> &Arc<Gallery> {
        &self.gallery
    }

    /// What opening the gallery found (orphans reconciled).
    pub fn reconcile_report(&self) -> &ReconcileReport {
        &self.reconcile
    }

    /// A handle that stops the server from elsewhere (a signal handler).
    pub fn stopper(&self) -> Stopper {
        Stopper(self.stop.clone())
    }

    /// Resolves when a [`Stopper`] asked the server to stop.
    pub async fn stopped(&self) {
        let mut rx = self.stop.subscribe();
        let _ = rx.wait_for(|v| *v).await;
    }

    /// Cancels the queued jobs and the running one at its next step (their
    /// waiting requests answer, their streams get the last event), then stops
    /// taking requests, ends the remaining event streams, and waits for open
    /// requests to finish (at most 10 s).
    pub async fn shutdown(self) {
        // The runtime first: its jobs end as cancelled (reason shutdown) and
        // that last event still reaches the streams watching them.
        let rt = self.runtime.clone();
        let _ = tokio::task::spawn_blocking(move || rt.shutdown()).await;
        tracing::debug!("runtime stopped");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let _ = self.stop.send(true);
        match tokio::time::timeout(Duration::from_secs(10), self.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!("the server stopped with an error: {e}"),
            Ok(Err(e)) => tracing::warn!("the server task failed: {e}"),
            Err(_) => tracing::warn!("open requests did not finish within 10 s; stopping anyway"),
        }
        tracing::debug!("server stopped");
    }
}

/// Asks a server to stop (see [`Server::stopped`]).
#[derive(Clone)]
pub struct Stopper(watch::Sender<bool>);

impl Stopper {
    pub fn stop(&self) {
        let _ = self.0.send(true);
    }
}

/// Opens the gallery, starts the runtime with the gallery as its result sink,
/// binds the address and serves until [`Server::shutdown`].
pub async fn serve(config: ServerConfig) -> Result<Server, ServeError> {
    config.check()?;
    let dir = config.data_dir.clone();
    let (gallery, reconcile) = tokio::task::spawn_blocking(move || Gallery::open(&dir))
        .await
        .map_err(|e| ServeError::Internal(e.to_string()))??;
    let gallery = Arc::new(gallery);
    let mut rc = RuntimeConfig::new(config.models.clone());
    rc.default_model = config.default_model.clone();
    rc.memory = config.memory.clone();
    rc.limits = config.limits.clone();
    rc.queue_limit = config.queue_limit;
    rc.max_job_time = config.max_job_time;
    rc.sink = Some(Arc::new(sink::GallerySink::new(gallery.clone())));
    let runtime = tokio::task::spawn_blocking(move || Runtime::start(rc))
        .await
        .map_err(|e| ServeError::Internal(e.to_string()))??;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: config.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| ServeError::Bind {
        addr: config.listen,
        source,
    })?;
    let (stop, stop_rx) = watch::channel(false);
    let state = AppState {
        a1111: Arc::new(A1111State::new(runtime.default_model())),
        runtime: runtime.clone(),
        gallery: gallery.clone(),
        settings: Arc::new(Settings {
            token: config.token.clone(),
            cors_origins: config.cors_origins.clone(),
            body_limit: config.body_limit,
            loopback: addr.ip().is_loopback(),
            models: config.models.clone(),
            queue_limit: config.queue_limit,
        }),
        shutdown: stop_rx.clone(),
    };
    let app = router(state);
    let mut rx = stop_rx;
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = rx.wait_for(|v| *v).await;
            })
            .await
    });
    tracing::info!(%addr, models = runtime.models().len(), "serving");
    Ok(Server {
        addr,
        runtime,
        gallery,
        reconcile,
        stop,
        task,
    })
}

/// Every route, with the middleware.
pub fn router(state: AppState) -> Router {
    let limit = state.settings.body_limit;
    let cors = cors_layer(&state.settings.cors_origins);
    let routes = Router::new()
        // brume's own API
        .route("/api/v1/models", get(native::models))
        .route("/api/v1/samplers", get(native::samplers))
        .route("/api/v1/capabilities", get(native::capabilities))
        .route("/api/v1/jobs", post(native::create_job))
        .route(
            "/api/v1/jobs/{id}",
            get(native::get_job).delete(native::cancel_job),
        )
        .route("/api/v1/jobs/{id}/cancel", post(native::cancel_job))
        .route("/api/v1/jobs/{id}/events", get(native::job_events))
        .route("/api/v1/ws", get(native::ws))
        .route("/api/v1/gallery", get(gallery_api::list))
        .route("/api/v1/gallery/import", post(gallery_api::import))
        .route("/api/v1/gallery/purge", post(gallery_api::purge))
        .route(
            "/api/v1/gallery/{id}",
            get(gallery_api::get)
                .patch(gallery_api::patch)
                .delete(gallery_api::delete),
        )
        .route("/api/v1/gallery/{id}/image", get(gallery_api::image))
        .route("/api/v1/gallery/{id}/thumb", get(gallery_api::thumb))
        .route("/api/v1/openapi.json", get(openapi::document))
        // AUTOMATIC1111
        .route("/sdapi/v1/txt2img", post(a1111::txt2img))
        .route("/sdapi/v1/img2img", post(a1111::img2img))
        .route("/sdapi/v1/progress", get(a1111::progress))
        .route("/sdapi/v1/interrupt", post(a1111::interrupt))
        .route("/sdapi/v1/skip", post(a1111::skip))
        .route(
            "/sdapi/v1/options",
            get(a1111::get_options).post(a1111::set_options),
        )
        .route("/sdapi/v1/sd-models", get(a1111::sd_models))
        .route("/sdapi/v1/samplers", get(a1111::samplers))
        .route("/sdapi/v1/schedulers", get(a1111::schedulers))
        .route("/sdapi/v1/upscalers", get(a1111::empty_list))
        .route("/sdapi/v1/latent-upscale-modes", get(a1111::empty_list))
        .route("/sdapi/v1/sd-vae", get(a1111::empty_list))
        .route("/sdapi/v1/sd-modules", get(a1111::empty_list))
        .route("/sdapi/v1/loras", get(a1111::empty_list))
        .route("/sdapi/v1/png-info", post(a1111::png_info))
        // OpenAI
        .route("/v1/images/generations", post(openai::generations))
        .route("/v1/images/edits", post(openai::edits))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{id}", get(openai::model_by_id))
        // the web editor
        .route("/", get(web::index))
        .route("/assets/{*path}", get(web::asset))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            respond::guard,
        ));
    let routes = match cors {
        Some(c) => routes.layer(c),
        None => routes,
    };
    routes
        .layer(axum::middleware::from_fn(respond::errors))
        .with_state(state)
}

fn cors_layer(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use tower_http::cors::{AllowOrigin, CorsLayer};
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([
                Method::GET,
                Method::POST,
                Method::PATCH,
                Method::DELETE,
                Method::OPTIONS,
            ])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE])
            .expose_headers([header::RETRY_AFTER])
            .max_age(Duration::from_secs(600)),
    )
}

/// Resolves on Ctrl-C or (on Unix) SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
