//! `brume bench kernels`: each CPU kernel against candle's plain path (what
//! `--kernels reference` runs) and against PyTorch, on the shapes of an SD 1.5
//! UNet at 512x512. Single runs alternate between the variants, so a busy machine
//! slows them alike; the table gives median, min and max seconds, GFLOP/s and the
//! output error against the plain path.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context};
use brume::kernels::conv3x3_bf16::PackedConvPairs;
use brume::kernels::winograd_bf16::PackedWinogradPairs;
use brume::kernels::flash_attention::flash_attention;
use brume::kernels::matmul_bf16::PackedStrips;
use brume::kernels::group_norm::group_norm;
use brume::layers::mapped::conv2d_dense;
use brume::layers::{attention_reference, Activation, AttentionMask, GroupNorm};
use candle_core::{Device, Tensor};

use super::bench::spread;

#[derive(clap::Args, Debug)]
pub struct KernelArgs {
    /// Timed runs per variant (after one warm-up), alternated between the variants.
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// A Python with torch and numpy for PyTorch's column; `none` leaves it out.
    #[arg(long, default_value = "python3")]
    python: String,
    /// PyTorch's side (default: tools/bench/kernels.py of this source tree).
    #[arg(long)]
    torch_script: Option<PathBuf>,
    /// Only the cases whose name contains this (attn_self, attn_cross, gn, gn_silu,
    /// conv3x3_320, conv3x3_640_64, conv3x3_960_320_64, conv3x3_640, conv3x3_1280_32, conv3x3_1920_640, conv3x3_1280_16, conv3x3_1280_8, conv1x1_320, conv3x3_64_256, conv3x3_64_512, linear_320, linear_geglu, linear_256_1280, linear_256_ff_out, linear_77_1024, linear_77_fc1, linear_77_fc2).
    #[arg(long)]
    only: Option<String>,
}

enum Op {
    Attention { q: Tensor, k: Tensor, scale: f64 },
    GroupNorm { x: Tensor, w: Tensor, b: Tensor, groups: usize, silu: bool },
    /// `pairs`: a 3x3 kernel rounded into bf16 pairs once, as a conv layer keeps it
    /// under `--compute bf16` (CPUs with AVX512-BF16).
    /// `wino`: the same kernel's Winograd F(2x2, 3x3) transform in bf16 pairs, made once.
    Conv { x: Tensor, w: Tensor, padding: usize, pairs: Option<PackedConvPairs>, wino: Option<PackedWinogradPairs> },
    /// `strips`: W^T rounded into bf16 panels once, as a linear layer keeps it.
    Linear { x: Tensor, w: Tensor, strips: Option<PackedStrips> },
}

struct Case {
    name: &'static str,
    label: String,
    /// Nominal floating-point operations of one run.
    flops: f64,
    op: Op,
}

const EPS: f64 = 1e-5;

impl Case {
    fn fast(&self) -> candle_core::Result<Tensor> {
        match &self.op {
            Op::Attention { q, k, scale } => flash_attention(q, k, k, *scale, false),
            Op::GroupNorm { x, w, b, groups, silu } => group_norm(x, w, b, *groups, EPS, *silu),
            Op::Conv { x, w, padding, .. } => conv2d_dense(x, w, 1, *padding, true),
            Op::Linear { x, w, .. } => brume::kernels::matmul::linear(x, w),
        }
    }

    /// brume's other paths for this op, by name: the direct 3x3 kernel (where
    /// `BRUME_WINOGRAD=on` lets the layers run Winograd), the im2col + GEMM conv (what
    /// `--kernels reference` runs on mapped weights) and, on a CPU with
    /// AVX512-BF16, the bf16-product 3x3 conv, GEMM and attention; on a CPU with AMX, the tile
    /// kernels (what `--compute bf16` runs there).
    fn alternatives(&self) -> Vec<&'static str> {
        let mut v = match &self.op {
            Op::Conv { padding: 1, .. } if brume::kernels::conv3x3_bf16::supported() => vec!["im2col", "bf16", "wino-bf16"],
            Op::Conv { .. } => vec!["im2col"],
            Op::Linear { .. } if brume::kernels::conv3x3_bf16::supported() => vec!["bf16"],
            Op::Attention { .. } if brume::kernels::conv3x3_bf16::supported() => vec!["bf16"],
            _ => Vec::new(),
        };
        // The layers' path may be Winograd (`BRUME_WINOGRAD`, auto by default): the direct kernel
        // beside it, and F(4x4, 3x3) whatever the sizes, to see where it would win on this CPU.
        if matches!(&self.op, Op::Conv { padding: 1, .. }) {
            v.insert(0, "direct");
            v.insert(1, "wino43");
        }
        // AMX tiles (what `--compute bf16` runs where the CPU has them).
        let one_image_1x1 = matches!(&self.op, Op::Conv { x, padding: 0, .. } if x.dim(0).is_ok_and(|b| b == 1));
        if brume::kernels::amx::supported() && (matches!(&self.op, Op::Conv { padding: 1, .. } | Op::Linear { .. } | Op::Attention { .. }) || one_image_1x1) {
            v.push("amx");
        }
        v
    }

    fn alternative(&self, name: &str) -> candle_core::Result<Tensor> {
        match (&self.op, name) {
            (Op::Conv { x, w, padding, .. }, "im2col") => {
                brume::kernels::set_mode(brume::kernels::KernelMode::Reference);
                let y = conv2d_dense(x, w, 1, *padding, true);
                brume::kernels::set_mode(brume::kernels::KernelMode::Fast);
                y
            }
            // The direct f32 kernel, where the layers' path may take Winograd.
            (Op::Conv { x, w, padding: 1, .. }, "direct") => brume::kernels::conv3x3::conv3x3(x, w),
            (Op::Conv { x, w, padding: 1, .. }, "wino43") => brume::kernels::winograd43::conv3x3_on(brume::kernels::isa(), x, w),
            // The layers' path: the kernel's pairs were made once, at "load".
            (Op::Conv { x, pairs: Some(pairs), .. }, "bf16") => brume::kernels::conv3x3_bf16::conv3x3_bf16_packed(x, pairs),
            (Op::Conv { x, wino: Some(u), .. }, "wino-bf16") => brume::kernels::winograd_bf16::conv3x3_winograd_bf16_packed(x, u),
            (Op::Linear { x, strips: Some(strips), .. }, "bf16") => brume::kernels::matmul_bf16::linear_bf16_packed(x, strips),
            (Op::Attention { q, k, scale }, "bf16") => brume::kernels::attention_bf16::attention_bf16(q, k, k, *scale, false),
            (Op::Attention { q, k, scale }, "amx") => brume::kernels::attention_amx::attention_amx(q, k, k, *scale, false),
            (Op::Conv { x, w, padding: 1, .. }, "amx") => brume::kernels::amx::conv3x3_amx(x, w),
            (Op::Conv { x, w, .. }, "amx") => {
                let (b, c, h, wd) = x.dims4()?;
                let o = w.dim(0)?;
                let y = brume::kernels::amx::conv1x1_amx(&w.reshape((o, c))?, &x.reshape((c, b * h * wd))?)?;
                y.reshape((b, o, h, wd))
            }
            (Op::Linear { x, w, .. }, "amx") => brume::kernels::amx::linear_amx(x, w),
            _ => candle_core::bail!("no {name} path for {}", self.name),
        }
    }

    fn reference(&self) -> candle_core::Result<Tensor> {
        match &self.op {
            Op::Attention { q, k, scale } => attention_reference(q, k, k, *scale, AttentionMask::None),
            Op::GroupNorm { x, w, b, groups, silu } => {
                let y = GroupNorm::from_tensors(w.clone(), b.clone(), *groups, EPS)?.forward_reference(x)?;
                if *silu {
                    Activation::Silu.forward(&y)
                } else {
                    Ok(y)
                }
            }
            Op::Conv { x, w, padding, .. } => x.conv2d(w, *padding, 1, 1, 1),
            Op::Linear { x, w, .. } => x.matmul(&w.t()?),
        }
    }
}

fn cases() -> anyhow::Result<Vec<Case>> {
    let dev = Device::Cpu;
    let mut rng = brume::samplers::Rng::new(0);
    let (h, d, n) = (8, 40, 4096);
    let attn = |name, nk: usize, rng: &mut brume::samplers::Rng| -> anyhow::Result<Case> {
        Ok(Case {
            name,
            label: format!("attention 1x{h}x{n}x{nk} d{d}"),
            flops: 4.0 * (h * n * nk * d) as f64,
            op: Op::Attention {
                q: rng.randn(&[1, h, n, d], &dev)?,
                k: rng.randn(&[1, h, nk, d], &dev)?,
                scale: (d as f64).powf(-0.5),
            },
        })
    };
    let mut v = vec![attn("attn_self", n, &mut rng)?, attn("attn_cross", 77, &mut rng)?];
    let x = rng.randn(&[1, 320, 64, 64], &dev)?;
    let (w, b) = (rng.randn(&[320], &dev)?, rng.randn(&[320], &dev)?);
    for silu in [false, true] {
        v.push(Case {
            name: if silu { "gn_silu" } else { "gn" },
            label: format!("group norm 320ch 64x64 g32{}", if silu { " + SiLU" } else { "" }),
            // Nominal: 7 per element (mean, centred squares, normalise-scale-shift), SiLU 4 more.
            flops: (if silu { 11.0 } else { 7.0 }) * x.elem_count() as f64,
            op: Op::GroupNorm { x: x.clone(), w: w.clone(), b: b.clone(), groups: 32, silu },
        });
    }
    // The UNet's convolutions at 512x512: the bar's 3x3 320->320 at 64x64, a
    // deeper 3x3, the 1280-channel levels at 16x16 and 8x8 (batch 2, as under
    // guidance; narrower than a 32-pixel block) and the 1x1 projections around attention.
    for (name, b, c, o, hw, k) in [
        ("conv3x3_320", 1, 320, 320, 64, 3),
        // SD 1.5's 64x64 up path: the last upsampler's 640 channels, a concatenated input.
        ("conv3x3_640_64", 1, 640, 640, 64, 3),
        ("conv3x3_960_320_64", 1, 960, 320, 64, 3),
        ("conv3x3_640", 1, 640, 640, 32, 3),
        // The other 32x32 maps: SD 1.5's and SDXS's 64x64 level at 256 px, the step up
        // to 640 channels, SD 1.5's 960-channel concatenation.
        ("conv3x3_320_32", 1, 320, 320, 32, 3),
        ("conv3x3_320_640_32", 1, 320, 640, 32, 3),
        ("conv3x3_960_640_32", 1, 960, 640, 32, 3),
        // Up-block shapes at 32x32: the upsampler's 1280 channels, a concatenated input.
        ("conv3x3_1280_32", 1, 1280, 1280, 32, 3),
        ("conv3x3_1920_640", 1, 1920, 640, 32, 3),
        ("conv3x3_1280_16", 2, 1280, 1280, 16, 3),
        ("conv3x3_1280_8", 2, 1280, 1280, 8, 3),
        ("conv1x1_320", 1, 320, 320, 64, 1),
        // The tiny VAE decoder's (TAESD) last levels: few channels, wide maps.
        ("conv3x3_64_256", 1, 64, 64, 256, 3),
        ("conv3x3_64_512", 1, 64, 64, 512, 3),
        // The SD VAE decoder's last level.
        ("conv3x3_128_512", 1, 128, 128, 512, 3),
    ] {
        let w = (rng.randn(&[o, c, k, k], &dev)? * (1.0 / ((c * k * k) as f64).sqrt()))?;
        let (pairs, wino) = if k == 3 && brume::kernels::conv3x3_bf16::supported() {
            let ws = w.flatten_all()?.to_vec1::<f32>()?;
            (Some(PackedConvPairs::new(&ws, o, c)?), Some(PackedWinogradPairs::new(&ws, o, c)?))
        } else {
            (None, None)
        };
        v.push(Case {
            name,
            label: format!("conv {k}x{k} {c}->{o} {}{hw}x{hw}", if b > 1 { format!("{b}x ") } else { String::new() }),
            flops: 2.0 * (b * o * c * k * k * hw * hw) as f64,
            op: Op::Conv { x: rng.randn(&[b, c, hw, hw], &dev)?, w, padding: k / 2, pairs, wino },
        });
    }
    // Transformer-block projections at 64x64 tokens: attention q/k/v/out and GEGLU's;
    // and the 77-token products of SD 2.x / SDXS's text encoder (OpenCLIP ViT-H: width
    // 1024, MLP 4096), whose weights are packed per call for few rows.
    for (name, m, k, n) in [
        ("linear_320", 4096, 320, 320),
        ("linear_geglu", 4096, 320, 2560),
        // SD 1.5's 16x16 level (256 tokens, width 1280): attention and the feed-forward's second product.
        ("linear_256_1280", 256, 1280, 1280),
        ("linear_256_ff_out", 256, 5120, 1280),
        ("linear_77_1024", 77, 1024, 1024),
        ("linear_77_fc1", 77, 1024, 4096),
        ("linear_77_fc2", 77, 4096, 1024),
    ] {
        let w = (rng.randn(&[n, k], &dev)? * (1.0 / (k as f64).sqrt()))?;
        let strips = if brume::kernels::conv3x3_bf16::supported() {
            Some(PackedStrips::of_linear(&w.flatten_all()?.to_vec1::<f32>()?, n, k)?)
        } else {
            None
        };
        v.push(Case {
            name,
            label: format!("linear {m}x{k} -> {n}"),
            flops: 2.0 * (m * k * n) as f64,
            op: Op::Linear { x: rng.randn(&[m, k], &dev)?, w, strips },
        });
    }
    Ok(v)
}

pub(super) fn write_f32(path: &Path, t: &Tensor) -> anyhow::Result<()> {
    let data = t.flatten_all()?.to_vec1::<f32>()?;
    let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
    brume::output::Output::new(path, true).write_bytes(&bytes).map(|_| ()).with_context(|| format!("writing {}", path.display()))
}

pub(super) fn read_f32(path: &Path, like: &Tensor) -> anyhow::Result<Tensor> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let data: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    if data.len() != like.elem_count() {
        bail!("{}: {} values, expected {}", path.display(), data.len(), like.elem_count());
    }
    Ok(Tensor::from_vec(data, like.shape(), like.device())?)
}

/// PyTorch in a child process that runs one op per request.
struct Torch {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    version: String,
}

impl Torch {
    fn start(python: &str, script: &Path, folder: &Path, cases: &[Case]) -> anyhow::Result<Self> {
        let mut spec = Vec::new();
        for c in cases {
            match &c.op {
                Op::Attention { q, k, scale } => {
                    write_f32(&folder.join(format!("{}.q.f32", c.name)), q)?;
                    write_f32(&folder.join(format!("{}.k.f32", c.name)), k)?;
                    write_f32(&folder.join(format!("{}.v.f32", c.name)), k)?;
                    spec.push(serde_json::json!({"name": c.name, "op": "attention", "q": q.dims(), "k": k.dims(), "scale": scale}));
                }
                Op::GroupNorm { x, w, b, groups, silu } => {
                    write_f32(&folder.join(format!("{}.x.f32", c.name)), x)?;
                    write_f32(&folder.join(format!("{}.w.f32", c.name)), w)?;
                    write_f32(&folder.join(format!("{}.b.f32", c.name)), b)?;
                    spec.push(serde_json::json!({"name": c.name, "op": "group_norm", "x": x.dims(), "groups": groups, "eps": EPS, "silu": silu}));
                }
                Op::Linear { x, w, .. } => {
                    write_f32(&folder.join(format!("{}.x.f32", c.name)), x)?;
                    write_f32(&folder.join(format!("{}.w.f32", c.name)), w)?;
                    spec.push(serde_json::json!({"name": c.name, "op": "linear", "x": x.dims(), "w": w.dims()}));
                }
                Op::Conv { x, w, padding, .. } => {
                    write_f32(&folder.join(format!("{}.x.f32", c.name)), x)?;
                    write_f32(&folder.join(format!("{}.w.f32", c.name)), w)?;
                    spec.push(serde_json::json!({"name": c.name, "op": "conv2d", "x": x.dims(), "w": w.dims(), "padding": padding}));
                }
            }
        }
        brume::output::Output::new(folder.join("cases.json"), true).write_bytes(serde_json::to_string(&spec)?.as_bytes())?;
        let mut child = Command::new(python)
            .arg(script)
            .arg(folder)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {python}"))?;
        let (stdin, stdout) = match (child.stdin.take(), child.stdout.take()) {
            (Some(i), Some(o)) => (i, BufReader::new(o)),
            _ => bail!("no pipes to {python}"),
        };
        let mut t = Self { child, stdin, stdout, version: String::new() };
        let ready = t.line()?;
        t.version = ready.strip_prefix("ready ").map(str::to_owned).context("PyTorch script did not start")?;
        Ok(t)
    }

    fn line(&mut self) -> anyhow::Result<String> {
        let mut s = String::new();
        if self.stdout.read_line(&mut s)? == 0 {
            bail!("the PyTorch script exited");
        }
        Ok(s.trim().to_owned())
    }

    fn run(&mut self, case: &str) -> anyhow::Result<f64> {
        writeln!(self.stdin, "{case}")?;
        self.stdin.flush()?;
        Ok(self.line()?.parse()?)
    }
}

impl Drop for Torch {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

/// A script of this source tree's tools/ folder, from the working directory or
/// from where the executable was built.
pub(super) fn tool_script(rel: &str) -> PathBuf {
    let local = PathBuf::from(rel);
    if local.exists() {
        local
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(rel)
    }
}

/// max |got - want| / max |want|.
pub(super) fn rel_err(got: &Tensor, want: &Tensor) -> anyhow::Result<f32> {
    let got = got.contiguous()?;
    let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    Ok(diff / want.abs()?.max_all()?.to_scalar::<f32>()?.max(f32::MIN_POSITIVE))
}

/// Seconds of one call in steady state: the call runs once untimed just before, so
/// the blocks the allocator keeps for reuse are this op's own, as when a UNet repeats
/// its shapes. Without that, a variant paid for unmapping what the one before it freed
/// (the reference attention's 512 MiB of scores took 30 ms of a bf16 attention call's
/// 105), or, with the kept blocks released, for faulting in its output afresh.
fn time(f: impl Fn() -> candle_core::Result<Tensor>) -> anyhow::Result<f64> {
    drop(f()?);
    let t = Instant::now();
    drop(f()?);
    Ok(t.elapsed().as_secs_f64())
}

pub fn run(a: KernelArgs) -> anyhow::Result<()> {
    if a.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let mut cases = cases()?;
    if let Some(only) = &a.only {
        cases.retain(|c| c.name.contains(only.as_str()));
        if cases.is_empty() {
            bail!("no case matches --only {only}");
        }
    }
    let folder = std::env::temp_dir().join(format!("brume-bench-kernels-{}", std::process::id()));
    let mut torch = None;
    let mut torch_note = String::from("PyTorch column left out (--python none)");
    if a.python != "none" {
        // A fresh folder of our own: create_dir fails on anything already there
        // (a folder or a link someone planted at this predictable name), never reusing it.
        std::fs::create_dir(&folder).with_context(|| format!("creating {}", folder.display()))?;
        let script = a.torch_script.clone().unwrap_or_else(|| tool_script("tools/bench/kernels.py"));
        match Torch::start(&a.python, &script, &folder, &cases) {
            Ok(t) => torch = Some(t),
            Err(e) => torch_note = format!("PyTorch column left out: {e:#}"),
        }
    }
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    println!("brume bench kernels: isa {}, {threads} CPU threads, {} alternated runs per variant", brume::kernels::isa().name(), a.runs);
    match &torch {
        Some(t) => println!("PyTorch: {}", t.version),
        None => println!("{torch_note}"),
    }
    println!(
        "{:<36} {:<16} {:>10} {:>10} {:>10} {:>9} {:>12}",
        "op", "variant", "median s", "min s", "max s", "GFLOP/s", "err vs ref"
    );
    for case in &cases {
        let want = case.reference()?;
        let fast_err = rel_err(&case.fast()?, &want)?;
        let torch_err = match torch.as_mut() {
            Some(t) => {
                t.run(case.name)?; // warm-up; writes the output
                Some(rel_err(&read_f32(&folder.join(format!("{}.torch.f32", case.name)), &want)?, &want)?)
            }
            None => None,
        };
        let alts = case.alternatives();
        let mut alt_err = Vec::new();
        for name in &alts {
            alt_err.push(rel_err(&case.alternative(name)?, &want)?);
        }
        // PyTorch's bf16 conv beside brume's (the bar compares each precision).
        let torch_bf16 = alts.iter().any(|a| *a == "bf16" || *a == "amx") && torch.is_some();
        let bf16_name = format!("{}.bf16", case.name);
        let torch_bf16_err = match torch.as_mut() {
            Some(t) if torch_bf16 => {
                t.run(&bf16_name)?;
                Some(rel_err(&read_f32(&folder.join(format!("{bf16_name}.torch.f32")), &want)?, &want)?)
            }
            _ => None,
        };
        let mut pt16 = Vec::new();
        let (mut fast, mut plain, mut pt): (Vec<f64>, Vec<f64>, Vec<f64>) = Default::default();
        let mut alt: Vec<Vec<f64>> = vec![Vec::new(); alts.len()];
        for _ in 0..a.runs {
            fast.push(time(|| case.fast())?);
            plain.push(time(|| case.reference())?);
            for (i, name) in alts.iter().enumerate() {
                alt[i].push(time(|| case.alternative(name))?);
            }
            if let Some(t) = torch.as_mut() {
                pt.push(t.run(case.name)?);
                if torch_bf16 {
                    pt16.push(t.run(&bf16_name)?);
                }
            }
        }
        let timed = |v: &[f64]| spread(v).context("no timed runs");
        let mut rows = vec![("brume fast", timed(&fast)?, format!("{fast_err:.1e}")), ("brume reference", timed(&plain)?, "0".into())];
        if let Some(e) = torch_err {
            rows.push(("pytorch", timed(&pt)?, format!("{e:.1e}")));
        }
        if let Some(e) = torch_bf16_err {
            rows.push(("pytorch bf16", timed(&pt16)?, format!("{e:.1e}")));
        }
        for (i, name) in alts.iter().enumerate() {
            let label = match *name {
                "bf16" => "brume bf16",
                "wino-bf16" => "brume wino bf16",
                "amx" => "brume amx bf16",
                "direct" => "brume direct",
                "wino43" => "brume wino43",
                _ => "brume im2col",
            };
            rows.push((label, timed(&alt[i])?, format!("{:.1e}", alt_err[i])));
        }
        for (variant, (med, min, max), err) in &rows {
            println!(
                "{:<36} {:<16} {:>10.5} {:>10.5} {:>10.5} {:>9.1} {:>12}",
                case.label,
                variant,
                med,
                min,
                max,
                case.flops / med / 1e9,
                err
            );
        }
        let ratio = |i: usize| rows[0].1 .0 / rows[i].1 .0;
        let ratios: Vec<String> = (1..rows.len()).map(|i| format!("fast/{} {:.3}", rows[i].0.trim_start_matches("brume "), ratio(i))).collect();
        println!("{:<36} {}", "", ratios.join(", "));
    }
    drop(torch);
    // Only the folder this run created is removed (never one that was there).
    if a.python != "none" {
        std::fs::remove_dir_all(&folder).ok();
    }
    println!("GFLOP/s: attention 4*h*n_q*n_k*d; group norm nominal 7 per element (+4 for SiLU); conv 2*o*c*k*k*h*w; linear 2*m*k*n. err: max|out - ref| / max|ref|.");
    Ok(())
}
