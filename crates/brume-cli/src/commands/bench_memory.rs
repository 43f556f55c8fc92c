//! `brume bench memory`: estimate vs measured peak memory over a grid of
//! device tiers x resolutions x memory plans, each row run in a child process
//! under an enforced limit equal to its budget, to show that a plan the
//! planner accepts completes within it and one it refuses is refused cleanly
//! (never an OOM kill).
//!
//! The limit: a cgroup v2 `memory.max` when this process may create a child
//! cgroup; otherwise `RLIMIT_DATA`, which since Linux 4.7 charges private
//! writable mappings (heap, anonymous maps, stacks) and not the read-only
//! mapping of the weight files: the same line a phone draws between dirty
//! memory (charged) and clean, evictable file pages (not charged).

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};
use brume::memory::planner::{self, fixed, ResolutionFallback};
use brume::memory::{ModelProfile, Plan, RequestShape};
use brume::pipelines::GenerationRequest;
use brume::runtime::budget::Budget;
use brume::runtime::memory::mib;
use candle_core::DType;

use super::memory::fixed_strategy;
use super::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct MemArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Square image sizes in pixels.
    #[arg(long, value_delimiter = ',', default_value = "256,512")]
    sizes: Vec<usize>,
    /// Memory plans: auto (the planner's choice) and fixed ones (resident, sequential, split, chunked, tiled).
    #[arg(long, value_delimiter = ',', default_value = "auto,resident,sequential,chunked,tiled")]
    plans: Vec<String>,
    /// Device tiers whose safe budget each row runs under (`--tiers ''`: none, only `--budgets`).
    #[arg(long, value_delimiter = ',', default_value = "a16,a17-pro,desktop-8gb")]
    tiers: Vec<String>,
    /// Also explicit budgets (e.g. 1.5GB), as extra columns of the grid.
    #[arg(long, value_delimiter = ',')]
    budgets: Vec<String>,
    #[arg(long, default_value_t = 1)]
    steps: usize,
    /// Classifier-free guidance (two UNet branches), as in ordinary generation.
    #[arg(long, default_value_t = 7.5)]
    guidance: f64,
    /// Only print the estimates and plans; run nothing.
    #[arg(long)]
    dry_run: bool,
}

/// How a child's limit was enforced.
#[derive(Debug, Clone, Copy)]
enum Limit {
    CgroupV2,
    RlimitData,
}

struct Row {
    budget: Budget,
    size: usize,
    plan_name: String,
}

pub fn run(mut a: MemArgs) -> anyhow::Result<()> {
    a.tiers.retain(|t| !t.trim().is_empty());
    if a.sizes.is_empty() || a.plans.is_empty() || (a.tiers.is_empty() && a.budgets.is_empty()) {
        bail!("give at least one size, plan and tier or budget");
    }
    let model = a.model.open()?;
    let profile = ModelProfile::of(&model, DType::F32);
    let mut budgets = Vec::new();
    for t in &a.tiers {
        budgets.push(Budget::resolve(Some(t), None)?);
    }
    for b in &a.budgets {
        budgets.push(Budget::resolve(None, Some(b))?);
    }
    let mut rows = Vec::new();
    for b in &budgets {
        for &size in &a.sizes {
            for p in &a.plans {
                rows.push(Row { budget: b.clone(), size, plan_name: p.clone() });
            }
        }
    }
    let exe = std::env::current_exe().context("locating the brume executable")?;
    let model_path = a.model.model.clone();
    println!("memory grid: model {}, {} step(s), guidance {}, f32 compute; private = private dirty, RSS includes mapped weights", model.name, a.steps, a.guidance);
    println!(
        "{:<12} {:>5} {:<9} {:<34} {:>10} {:>10} {:>7} {:>10} {:>10} {:>7} {:<12} {:<22} {:>7}",
        "budget", "size", "plan", "strategy (fallbacks)", "est priv", "meas priv", "err", "est RSS", "meas RSS", "err", "limit", "outcome", "time s"
    );
    let mut worst: f64 = 0.0;
    for (i, row) in rows.iter().enumerate() {
        let req = GenerationRequest { guidance_scale: a.guidance, steps: a.steps, ..GenerationRequest::new("a red circle on the left", row.size) };
        req.validate(&model)?;
        let shape = RequestShape { batch: 1, guided: req.guided(&model), width: row.size, height: row.size, encodes_image: false };
        let planned: Result<Plan, String> = match row.plan_name.as_str() {
            "auto" => planner::plan(&profile, &shape, &row.budget, ResolutionFallback::Upscale, &[]).map_err(|e| e.to_string()),
            name => fixed_strategy(name, &profile, &shape, row.budget.bytes())
                .map_err(|e| e.to_string())
                .and_then(|s| fixed(&profile, &shape, &row.budget, s).map_err(|e| e.to_string())),
        };
        let budget_label = match row.budget.source() {
            brume::runtime::budget::BudgetSource::Tier(t) => t.name.to_string(),
            _ => mib(row.budget.bytes()),
        };
        let (strategy, est) = match &planned {
            Ok(p) => {
                let fb = p.fallbacks();
                let mut s = if fb.is_empty() { p.strategy.label() } else { format!("{} ({})", p.strategy.label(), fb.len()) };
                if p.over_working_set().is_some() {
                    s.push_str(" >ws");
                }
                (s, Some(p.estimate.peak))
            }
            Err(_) => ("refused by the planner".to_string(), None),
        };
        if a.dry_run {
            println!(
                "{:<12} {:>5} {:<9} {:<34} {:>10}",
                budget_label,
                row.size,
                row.plan_name,
                strategy,
                est.map(|e| mib(e.private_dirty)).unwrap_or_else(|| "-".into())
            );
            continue;
        }
        let out = std::env::temp_dir().join(format!("brume-bench-memory-{}-{i}.png", std::process::id()));
        let mut cmd = Command::new(&exe);
        // The child runs the kernels this process estimated for.
        cmd.args(["--kernels", brume::kernels::mode().name()]);
        cmd.arg("generate").arg("a red circle on the left");
        if let Some(m) = &model_path {
            cmd.arg("--model").arg(m);
        }
        cmd.args(["--width", &row.size.to_string(), "--height", &row.size.to_string()])
            .args(["--steps", &a.steps.to_string(), "--guidance", &a.guidance.to_string()])
            .args(["--memory-plan", &row.plan_name]);
        // A tier, not its byte figure, so the child plans with the tier's working set too.
        match row.budget.source() {
            brume::runtime::budget::BudgetSource::Tier(t) => cmd.args(["--device-tier", t.name]),
            _ => cmd.args(["--memory-budget", &row.budget.bytes().to_string()]),
        };
        cmd
            .arg("--memory-report")
            .arg("--force")
            .arg("--out")
            .arg(&out);
        let start = Instant::now();
        let (result, limit) = run_limited(cmd, row.budget.bytes())?;
        let secs = start.elapsed().as_secs_f64();
        let _ = std::fs::remove_file(&out);
        let stderr = String::from_utf8_lossy(&result.stderr);
        let report = stderr.lines().find_map(parse_report);
        let outcome = match (result.status.code(), &planned) {
            (Some(0), Ok(_)) => "completed".to_string(),
            (Some(0), Err(_)) => "ran though refused?!".to_string(),
            (Some(_), Err(_)) if stderr.contains("out of memory budget") => "refused cleanly".to_string(),
            (Some(c), _) => format!("FAILED exit {c}"),
            (None, _) => format!("KILLED {}", signal_name(&result.status)),
        };
        let pct = |e: u64, m: u64| if m == 0 { f64::NAN } else { (e as f64 - m as f64) / m as f64 * 100.0 };
        let (mp, mr, ep, er) = match (report, est) {
            (Some((rss, dirty)), Some(e)) if result.status.success() => {
                let (ep, er) = (pct(e.private_dirty, dirty), pct(e.rss, rss));
                worst = worst.max(ep.abs()).max(er.abs());
                (mib(dirty), mib(rss), format!("{ep:+.1}%"), format!("{er:+.1}%"))
            }
            _ => ("-".into(), "-".into(), "-".into(), "-".into()),
        };
        println!(
            "{:<12} {:>5} {:<9} {:<34} {:>10} {:>10} {:>7} {:>10} {:>10} {:>7} {:<12} {:<22} {:>7.1}",
            budget_label,
            row.size,
            row.plan_name,
            strategy,
            est.map(|e| mib(e.private_dirty)).unwrap_or_else(|| "-".into()),
            mp,
            ep,
            est.map(|e| mib(e.rss)).unwrap_or_else(|| "-".into()),
            mr,
            er,
            match limit {
                Limit::CgroupV2 => "memory.max",
                Limit::RlimitData => "RLIMIT_DATA",
            },
            outcome,
            secs
        );
        if outcome.starts_with("FAILED") || outcome.starts_with("KILLED") {
            let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
            println!("    stderr: {}", tail.into_iter().rev().collect::<Vec<_>>().join(" | "));
        }
    }
    if !a.dry_run {
        println!("largest |estimate - measured| / measured over completed rows: {worst:.1}% (bar: 15%)");
    }
    println!("(>ws: estimated RSS above the tier's working set, so mapped weights are paged from storage during the run)");
    Ok(())
}

/// `memory-report peak_rss=N peak_private_dirty=M` -> (rss, dirty).
fn parse_report(line: &str) -> Option<(u64, u64)> {
    let rest = line.strip_prefix("memory-report ")?;
    let mut rss = None;
    let mut dirty = None;
    for kv in rest.split_whitespace() {
        match kv.split_once('=')? {
            ("peak_rss", v) => rss = v.parse().ok(),
            ("peak_private_dirty", v) => dirty = v.parse().ok(),
            _ => {}
        }
    }
    Some((rss?, dirty?))
}

fn signal_name(status: &std::process::ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(s) = status.signal() {
            return format!("signal {s}");
        }
    }
    format!("{status}")
}

/// Runs `cmd` with its memory limited to `bytes`: in a fresh cgroup v2 with
/// `memory.max` when one can be made, else under `RLIMIT_DATA`.
fn run_limited(mut cmd: Command, bytes: u64) -> anyhow::Result<(std::process::Output, Limit)> {
    if let Some(dir) = make_cgroup(bytes) {
        // The child is moved into the cgroup right after it starts, before it
        // has opened the model (it has allocated next to nothing by then).
        cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        let child = cmd.spawn().context("running the child")?;
        let moved = std::fs::write(dir.join("cgroup.procs"), child.id().to_string());
        let out = child.wait_with_output().context("waiting for the child");
        let _ = std::fs::remove_dir(&dir);
        moved.context("moving the child into its cgroup")?;
        return Ok((out?, Limit::CgroupV2));
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: setrlimit is async-signal-safe; it only affects the child.
        unsafe {
            cmd.pre_exec(move || {
                let lim = libc::rlimit { rlim_cur: bytes as libc::rlim_t, rlim_max: bytes as libc::rlim_t };
                if libc::setrlimit(libc::RLIMIT_DATA, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    Ok((cmd.output().context("running the child")?, Limit::RlimitData))
}

/// A child cgroup of ours with `memory.max = bytes`, when cgroup v2 is mounted writable.
fn make_cgroup(bytes: u64) -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    let base = PathBuf::from(format!("/sys/fs/cgroup{}", path.trim_end_matches('/')));
    if !base.join("memory.max").exists() && !base.join("cgroup.subtree_control").exists() {
        return None;
    }
    let dir = base.join(format!("brume-bench-{}", std::process::id()));
    std::fs::create_dir(&dir).ok()?;
    if std::fs::write(dir.join("memory.max"), bytes.to_string()).is_err() || std::fs::write(dir.join("memory.swap.max"), "0").is_err() {
        let _ = std::fs::remove_dir(&dir);
        return None;
    }
    Some(dir)
}
