use brume::runtime::budget::{available, TIERS};
use brume::runtime::memory::{self, mib};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    memory: super::MemoryArgs,
}

/// CPU features that decide which kernels can run fast here.
fn cpu_features() -> Vec<&'static str> {
    #[allow(unused_mut)]
    let mut f = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            f.push("avx2");
        }
        if std::arch::is_x86_feature_detected!("fma") {
            f.push("fma");
        }
        if std::arch::is_x86_feature_detected!("f16c") {
            f.push("f16c");
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            f.push("avx512f");
        }
        if std::arch::is_x86_feature_detected!("avx512bf16") {
            f.push("avx512bf16");
        }
        // CPU support and the OS's grant of the tile state: what `--compute bf16` runs on.
        if brume::kernels::amx::supported() {
            f.push("amx-bf16");
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            f.push("neon");
        }
        if std::arch::is_aarch64_feature_detected!("fp16") {
            f.push("fp16");
        }
        if std::arch::is_aarch64_feature_detected!("bf16") {
            f.push("bf16");
        }
    }
    f
}

pub fn run(a: Args) -> anyhow::Result<()> {
    println!("brume {}", env!("CARGO_PKG_VERSION"));
    println!("os           {} / {}", std::env::consts::OS, std::env::consts::ARCH);
    println!(
        "cpu          {} threads, features: {}",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        cpu_features().join(" ")
    );
    println!("device       {:?}", brume::runtime::default_device());
    let m = memory::read();
    println!(
        "this process RSS {}, private dirty {}",
        m.rss.map(mib).unwrap_or_else(|| "unknown".into()),
        m.private_dirty.map(mib).unwrap_or_else(|| "unknown".into())
    );
    match available() {
        Some(a) => {
            println!("available    {} (the smallest of):", mib(a.bytes));
            for f in &a.findings {
                println!("             {:>12}  {}", mib(f.bytes), f.source);
            }
        }
        None => println!("available    unknown on this platform (use --memory-budget or --device-tier)"),
    }
    println!("budget       {}", a.memory.budget()?);
    println!("\ndevice tiers (working set / safe model budget):");
    for t in TIERS {
        println!("  {:<14} {:>10} / {:>10}  {}", t.name, mib(t.working_set), mib(t.safe_budget), t.description);
    }
    Ok(())
}
