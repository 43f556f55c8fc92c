//! `brume serve`: the local image service (brume's API, A1111's, OpenAI's, the
//! web editor) over the job runtime and the gallery. It runs outside the
//! compute pool: the runtime puts each job there itself.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use brume_runtime::{ModelEntry, ModelSource};

use super::MemoryArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A model to serve, as NAME=PATH (a diffusers folder or a single-file
    /// checkpoint); repeat for several, the first is the default. None: the
    /// built-in model, as `builtin`.
    #[arg(long = "model", value_name = "NAME=PATH")]
    pub models: Vec<String>,
    /// Which served model requests get when they name none (default: the first).
    #[arg(long, value_name = "NAME")]
    pub default_model: Option<String>,
    /// Address to listen on; anything but loopback needs --token. Port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:7860", value_name = "ADDR")]
    pub listen: String,
    /// The gallery's folder (default: $BRUME_DATA_DIR, else $XDG_DATA_HOME/brume,
    /// else ~/.local/share/brume); created 0700.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Require this token on every request (`Authorization: Bearer T`, or HTTP
    /// Basic with T as the password for A1111 clients).
    #[arg(long, value_name = "T", conflicts_with = "token_file")]
    pub token: Option<String>,
    /// Read the token from the first line of a file (keeps it out of `ps`).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// Allow a web origin to call the API from a browser (e.g.
    /// http://localhost:3000); repeat for several. None: no CORS.
    #[arg(long, value_name = "ORIGIN")]
    pub cors: Vec<String>,
    /// Jobs waiting at most; past it requests get 429 with Retry-After.
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub queue_limit: usize,
    /// A job running longer is cancelled at its next step (0: no limit).
    #[arg(long, default_value_t = 600, value_name = "S")]
    pub max_job_seconds: u64,
    /// Largest request body in MiB (a base64 picture is 4/3 of its file).
    #[arg(long, default_value_t = 32, value_name = "MIB")]
    pub max_body_mib: usize,
    #[command(flatten)]
    pub memory: MemoryArgs,
}

fn model_entries(specs: &[String]) -> anyhow::Result<Vec<ModelEntry>> {
    if specs.is_empty() {
        // $BRUME_BUILTIN_MODEL (a folder) stands in for the embedded copy, as for `generate`.
        let source = match std::env::var_os("BRUME_BUILTIN_MODEL") {
            Some(p) => ModelSource::Path {
                path: PathBuf::from(p),
                config_dir: None,
                variant: None,
            },
            None => ModelSource::Embedded {
                files: crate::builtin::FILES,
            },
        };
        return Ok(vec![ModelEntry {
            name: "builtin".into(),
            source,
        }]);
    }
    specs
        .iter()
        .map(|s| {
            let (name, path) = match s.split_once('=') {
                Some((n, p)) => (n.trim().to_string(), PathBuf::from(p)),
                None => {
                    let p = PathBuf::from(s);
                    let n = p
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    (n, p)
                }
            };
            if name.is_empty() || name.chars().any(|c| c.is_control()) {
                bail!("--model {s}: expected NAME=PATH with a non-empty name");
            }
            if !path.exists() {
                bail!("--model {s}: {} does not exist", path.display());
            }
            Ok(ModelEntry {
                name,
                source: ModelSource::Path {
                    path,
                    config_dir: None,
                    variant: None,
                },
            })
        })
        .collect()
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let listen: SocketAddr = args
        .listen
        .replace("localhost:", "127.0.0.1:")
        .parse()
        .with_context(|| {
            format!(
                "--listen {}: expected an address like 127.0.0.1:7860 or 0.0.0.0:7860",
                args.listen
            )
        })?;
    let token = match (&args.token, &args.token_file) {
        (Some(t), _) => Some(t.clone()),
        (None, Some(f)) => {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("--token-file {}", f.display()))?;
            Some(text.lines().next().unwrap_or("").trim().to_string())
        }
        (None, None) => None,
    };
    let data_dir = match args
        .data_dir
        .clone()
        .or_else(brume_server::default_data_dir)
    {
        Some(d) => d,
        None => bail!("no data directory: pass --data-dir DIR (or set $BRUME_DATA_DIR or $HOME)"),
    };
    let mut config = brume_server::ServerConfig::new(model_entries(&args.models)?, data_dir);
    config.listen = listen;
    config.token = token;
    config.cors_origins = args.cors.clone();
    config.default_model = args.default_model.clone();
    config.memory = args.memory.policy();
    config.queue_limit = args.queue_limit.max(1);
    config.max_job_time =
        (args.max_job_seconds > 0).then(|| Duration::from_secs(args.max_job_seconds));
    config.body_limit = args.max_body_mib.max(1) << 20;
    config.check()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("brume-serve")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let server = brume_server::serve(config).await?;
        let report = server.reconcile_report();
        if !report.is_clean() {
            eprintln!("gallery: {report}");
        }
        // The browser tests and scripts read this line for the port.
        println!("listening on http://{}", server.addr());
        let _ = std::io::stdout().flush();
        tokio::select! {
            _ = brume_server::shutdown_signal() => eprintln!("stopping: finishing open requests"),
            _ = server.stopped() => {}
        }
        server.shutdown().await;
        anyhow::Ok(())
    })?;
    tracing::debug!("async runtime ended");
    Ok(())
}
