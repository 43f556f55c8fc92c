//! `brume`: generate and inspect Stable Diffusion models on this machine, offline.

mod builtin;
mod commands;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Counts heap bytes so that memory reports carry the exact private-memory
/// peak, not only what a sampler happened to see.
#[global_allocator]
static ALLOCATOR: brume::runtime::memory::CountingAllocator = brume::runtime::memory::CountingAllocator;

#[derive(Parser)]
#[command(name = "brume", version, about = "Offline, on-device latent diffusion")]
struct Cli {
    /// Log level filter (error, warn, info, debug, trace); RUST_LOG also works.
    #[arg(long, global = true, default_value = "warn")]
    log: String,
    /// CPU kernels: `fast` (brume's fused kernels) or `reference` (candle's plain
    /// ops, to check a result or a timing against them).
    #[arg(long, global = true, default_value = "fast", value_parser = ["fast", "reference"])]
    kernels: String,
    /// What the CPU kernels multiply in: `f32`, or `bf16` (the factors of convolutions,
    /// linear layers and attention rounded to bf16, f32 sums and softmax; on AMX tiles where
    /// the CPU has them, else AVX512-BF16; ~1e-3 relative error per layer; the timestep and
    /// text projections and each network's first and last convolution stay f32). In-place
    /// f32 weights then keep a packed bf16 copy (half their bytes, private memory).
    #[arg(long, global = true, default_value = "f32", value_parser = ["f32", "bf16"])]
    compute: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Text to image.
    Generate(commands::generate::Args),
    /// Edit a picture: img2img (no mask), inpainting (--mask) or outpainting (--extend).
    Edit(commands::edit::Args),
    /// Rewrite a model at a precision tier: fp16, bf16, int8, palettized 4-bit, ternary, or a policy file.
    Convert(commands::convert::Args),
    /// Benchmarks that print tables (medians, alternating the variants).
    #[command(subcommand)]
    Bench(commands::bench::Bench),
    /// What this machine offers: CPU features, available memory and where that
    /// figure comes from, and the device tiers.
    Doctor(commands::doctor::Args),
    /// Quality evaluations (prompt adherence on held-out prompts).
    #[command(subcommand)]
    Eval(commands::eval::Eval),
    /// The gallery of made and imported images: list, search, show, export, delete, import.
    Gallery(commands::gallery::Args),
    /// Print the recipe stored in an image.
    Info(commands::info::Args),
    /// Print a model's architecture, parameter counts and bytes per segment.
    Inspect(commands::inspect::Args),
    /// Write a random-weight model of a real architecture (for speed and memory work).
    RandomModel(commands::random_model::Args),
    /// The local image service: brume's API, A1111's and OpenAI's, and the web editor.
    Serve(commands::serve::Args),
    /// Real-time img2img of a video or frame folder through a three-stage pipeline, with timings.
    Live(commands::live::Args),
}

fn main() -> ExitCode {
    brume::runtime::use_one_thread_pool();
    // Piping into `head` must end the output quietly, not panic in println!.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    brume::runtime::memory::return_freed_memory_promptly();
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cli.log));
    // ANSI colour only on a terminal: a log file or a pipe gets plain text.
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(brume::output::stderr_is_terminal()).init();
    if let Some(mode) = brume::kernels::KernelMode::parse(&cli.kernels) {
        brume::kernels::set_mode(mode);
    }
    if let Some(c) = brume::kernels::Compute::parse(&cli.compute) {
        if let Err(e) = brume::kernels::set_compute(c) {
            eprintln!("error: --compute {}: {e}", cli.compute);
            return ExitCode::FAILURE;
        }
    }
    let result = match cli.command {
        // These run their job through the runtime, which puts it on the compute
        // pool itself (and waits for it off the pool).
        Command::Generate(a) => commands::generate::run(a),
        Command::Edit(a) => commands::edit::run(a),
        // The service waits on its own threads; the runtime puts jobs on the pool.
        Command::Serve(a) => commands::serve::run(a),
        // Live runs its own stage threads and puts diffusion on the pool itself; a pool
        // thread blocked waiting for the stages would take one of the two cores' workers.
        Command::Live(a) => commands::live::run(a),
        Command::Bench(commands::bench::Bench::Live(a)) => commands::bench_live::run(a),
        command => brume::runtime::on_compute_thread(move || run_on_pool(command)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            ExitCode::FAILURE
        }
    }
}

/// Runs a command on a compute-pool thread (see `brume::runtime::on_compute_thread`).
fn run_on_pool(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Generate(a) => commands::generate::run(a),
        Command::Edit(a) => commands::edit::run(a),
        Command::Info(a) => commands::info::run(a),
        Command::Gallery(a) => commands::gallery::run(a),
        Command::Bench(b) => commands::bench::run(b),
        Command::Convert(a) => commands::convert::run(a),
        Command::Doctor(a) => commands::doctor::run(a),
        Command::Eval(e) => commands::eval::run(e),
        Command::Inspect(a) => commands::inspect::run(a),
        Command::RandomModel(a) => commands::random_model::run(a),
        Command::Serve(a) => commands::serve::run(a),
        Command::Live(a) => commands::live::run(a),
    }
}

/// The error and its causes, each said once: a cause whose text its parent
/// already carries (error messages often embed their source, and `{:#}` would
/// print it again) is skipped. Control characters are escaped: messages quote
/// text from files (config values, metadata keywords).
fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let s = cause.to_string();
        if out.contains(&s) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&s);
    }
    brume::output::escape_control(&out)
}
