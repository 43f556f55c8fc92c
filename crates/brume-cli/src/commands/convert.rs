//! `brume convert`: rewrite a model at a precision tier (a preset or a policy file).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use brume::quantization::convert::{convert, ConfigSource};
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
    let start = Instant::now();
    let record = convert(&model, configs, input.as_deref(), &policy, &a.out, a.force)?;
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
