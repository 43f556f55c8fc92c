use std::path::PathBuf;

use anyhow::bail;
use brume::loading::safetensors::StoredDType;
use brume::pipelines::random_model::{preset, write, PRESETS};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Architecture to build (see --list).
    #[arg(long, required_unless_present = "list")]
    preset: Option<String>,
    /// The new model folder to write.
    #[arg(long, required_unless_present = "list")]
    out: Option<PathBuf>,
    /// Stored precision: f16 (as published checkpoints) or f32.
    #[arg(long, default_value = "f16")]
    dtype: String,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// List the presets.
    #[arg(long)]
    list: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.list {
        for p in PRESETS {
            println!("{:<20} {}", p.name, p.description);
        }
        return Ok(());
    }
    let (Some(name), Some(out)) = (a.preset, a.out) else {
        bail!("--preset and --out are required");
    };
    let Some(p) = preset(&name) else {
        let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
        bail!("unknown preset `{name}` (known: {})", names.join(", "));
    };
    let dtype = match a.dtype.as_str() {
        "f16" | "fp16" => StoredDType::F16,
        "f32" | "fp32" => StoredDType::F32,
        other => bail!("--dtype must be f16 or f32, not `{other}`"),
    };
    let start = std::time::Instant::now();
    write(p, &out, dtype, a.seed)?;
    println!("wrote {} ({}) to {} in {:.1} s", p.name, a.dtype, out.display(), start.elapsed().as_secs_f64());
    Ok(())
}
