//! `brume convert`: rewrite a model at a precision tier (a preset or a policy file).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use brume::quantization::convert::{convert_with, ConfigSource};
use brume::quantization::policy::PRESETS;
use brume::quantization::Policy;
use brume::runtime::memory::{self, mib};

use super::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// A preset (fp32, fp16, bf16, int8, int4, int4-attn-fp16, ternary-attn-fp16) or a policy file.
    #[arg(long)]
    precision: String,
    /// The new model folder.
    #[arg(long)]
    out: PathBuf,
    /// Replace OUT if it exists (never the input model).
    #[arg(long)]
    force: bool,
}

/// A preset by name, else a policy file.
pub fn policy(spec: &str) -> anyhow::Result<Policy> {
    if let Some(p) = Policy::preset(spec) {
        return Ok(p);
    }
    let path = PathBuf::from(spec);
    if !path.is_file() {
        let names: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
        bail!("--precision `{spec}` is neither a preset ({}) nor a policy file", names.join(", "));
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading policy file {}", path.display()))?;
    Ok(Policy::parse(&path.display().to_string(), &text)?)
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let policy = policy(&a.precision)?;
    let model = a.model.open()?;
    let input = a.model.path();
    let config_dir = match &input {
        Some(p) if p.is_dir() => Some(p.clone()),
        Some(p) => match &a.model.config {
            Some(c) => Some(c.clone()),
            None => bail!(
                "{} is a single-file checkpoint: pass --config DIR (a diffusers folder with its configs) so the \
                 converted folder can carry them",
                p.display()
            ),
        },
        None => None,
    };
    let configs = match &config_dir {
        Some(d) => ConfigSource::Folder(d),
        None => ConfigSource::Embedded(crate::builtin::FILES),
    };
    // Every other UNet folder comes along (the built-in model's `unet_lcm`), so
    // what ran on the original runs on the copy.
    let mut extra = Vec::new();
    for folder in other_unet_folders(input.as_deref(), &model.unet_folder) {
        let mut args = a.model.clone();
        args.unet = Some(folder.clone());
        extra.push(args.open().with_context(|| format!("opening the model's other UNet folder `{folder}`"))?);
    }
    let extra_refs: Vec<&brume::pipelines::SdModel> = extra.iter().collect();
    // Ctrl-C stops between tensors; the temporary folder is then removed.
    let cancel = Arc::new(AtomicBool::new(false));
    let flag = cancel.clone();
    if let Err(e) = ctrlc::set_handler(move || {
        if !flag.swap(true, Ordering::SeqCst) {
            eprintln!("\ncancelling: removing the partial copy");
        }
    }) {
        tracing::warn!("cannot install the Ctrl-C handler: {e}");
    }
    let start = Instant::now();
    let cancelled = || cancel.load(Ordering::SeqCst);
    let record = match convert_with(&model, &extra_refs, configs, input.as_deref(), &policy, &a.out, a.force, &cancelled) {
        Err(brume::RunError::Cancelled) => bail!("cancelled; nothing was written"),
        other => other?,
    };
    let secs = start.elapsed().as_secs_f64();
    println!("converted {} ({}) at {} into {} in {secs:.1} s", model.name, record.source_hash, policy.name, a.out.display());
    for seg in brume::loading::Segment::ALL {
        let before = model.segment_bytes(seg) as u64;
        let after = record.segment_bytes.get(seg.name()).copied().unwrap_or(0);
        println!("{:<14} {:>12} -> {:>12}", seg.name(), mib(before), mib(after));
    }
    let schemes: Vec<String> = record.schemes.iter().map(|(s, n)| format!("{n} {s}")).collect();
    println!("tensors: {}", schemes.join(", "));
    if let Some(peak) = memory::read().peak_rss {
        println!("peak RSS {}", mib(peak));
    }
    Ok(())
}

/// The model's UNet folders other than `current`: subfolders named `unet*`
/// with a config (on disk), or those compiled into the built-in model.
fn other_unet_folders(input: Option<&std::path::Path>, current: &str) -> Vec<String> {
    let mut found: Vec<String> = match input {
        Some(root) if root.is_dir() => std::fs::read_dir(root)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with("unet") && root.join(n).join("config.json").is_file())
                    .collect()
            })
            .unwrap_or_default(),
        Some(_) => Vec::new(),
        None => crate::builtin::FILES
            .iter()
            .filter_map(|f| f.path.strip_suffix("/config.json"))
            .filter(|d| d.starts_with("unet"))
            .map(str::to_string)
            .collect(),
    };
    found.retain(|f| f != current);
    found.sort();
    found.dedup();
    found
}
