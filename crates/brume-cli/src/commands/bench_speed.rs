//! `brume bench speed`: brume against its peers, component by component, in one run.
//!
//! Every engine runs the same random-weight model folder (built from the real SD 1.5
//! and SDXS-512 configs by `brume random-model`) on the same inputs: brume in this
//! process, PyTorch / ONNX Runtime / OpenVINO in a child Python (`tools/bench/speed.py`)
//! that answers one timed forward pass per request, so the variants alternate run by
//! run and a busy machine slows them alike. Errors are against PyTorch f32; GFLOP/s
//! count the convolutions, matmuls and attention as PyTorch's FlopCounterMode does,
//! and the percentage is of the ceiling this machine measures for itself
//! ([`brume::kernels::peak`]).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use brume::kernels::{Compute, KernelMode};
use brume::loading::safetensors::StoredDType;
use brume::loading::Segment;
use brume::pipelines::model::{OpenOptions, SdModel};
use brume::pipelines::random_model;
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use super::bench::spread;
use super::bench_kernels::{read_f32, rel_err, tool_script, write_f32};

#[derive(clap::Args, Debug)]
pub struct SpeedArgs {
    /// Components, each KIND-MODEL[@SIZE]: unet-sd15@512, unet-sdxs@256, vae-sd15@512
    /// (the KL decoder), taesd-sdxs@512 (the tiny decoder), text-sd15; whole images:
    /// image-sdxs@512 (text encoder + 1 UNet step + tiny VAE decoder) and
    /// image-sd15@512 (prompt and empty negative prompt, 20 guided DDIM steps, KL decoder).
    #[arg(long, value_delimiter = ',', default_values_t = [
        "text-sd15".to_string(), "unet-sd15@256".into(), "unet-sdxs@256".into(), "unet-sdxs@512".into(),
        "taesd-sdxs@512".into(), "vae-sd15@512".into(), "unet-sd15@512".into()])]
    components: Vec<String>,
    /// Peer variants (torch-f32 always runs: it is the error reference): torch-bf16,
    /// onnxruntime-f32, openvino-f32, openvino-bf16, and stable-diffusion.cpp with f32,
    /// f16 or q8_0 weights (sdcpp-f32, sdcpp-f16, sdcpp-q8_0: timed from its own log of
    /// each stage of a generation from its own noise, so its error is "n/a"); `none`
    /// for PyTorch f32 alone.
    #[arg(long, value_delimiter = ',', default_values_t = [
        "torch-bf16".to_string(), "onnxruntime-f32".into(), "openvino-f32".into(), "openvino-bf16".into(), "sdcpp-f32".into()])]
    peers: Vec<String>,
    /// brume's modes: `fast` (its kernels, f32, Winograd F(4x4, 3x3) on the large 3x3
    /// convolutions where it wins), `direct` (the same with the direct 3x3 kernel
    /// everywhere), `bf16` (its kernels with bf16 products on AMX tiles or
    /// AVX512-BF16, where the CPU has them; Winograd F(2x2, 3x3) on the large 3x3
    /// convolutions without AMX), `bf16-direct` (the same with the direct 3x3 kernel)
    /// and `reference` (candle's plain ops).
    #[arg(long, value_delimiter = ',', default_values_t = ["fast".to_string(), "bf16".into(), "reference".into()])]
    modes: Vec<String>,
    /// Timed runs per variant (after one warm-up), alternated between the variants.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// SD 1.5 model folder (default: a random f32 one written into --work).
    #[arg(long)]
    sd15: Option<PathBuf>,
    /// SDXS-512 model folder (default: a random f32 one written into --work).
    #[arg(long)]
    sdxs: Option<PathBuf>,
    /// Where the random models, the exported peers' graphs and the outputs go.
    #[arg(long, default_value = "/tmp/brume-bench-speed")]
    work: PathBuf,
    /// A Python with tools/bench/requirements.txt installed (tools/bench/setup.sh).
    #[arg(long, default_value = "python3")]
    python: String,
    /// The peers' script (default: tools/bench/speed.py of this source tree).
    #[arg(long)]
    script: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Unet,
    VaeDecoder,
    TinyDecoder,
    TextEncoder,
    /// A whole txt2img image: every segment, the model's own step count and guidance
    /// ([`Component::image_recipe`]).
    Image,
}

#[derive(Debug, Clone)]
struct Component {
    name: String,
    kind: Kind,
    /// `sd15` or `sdxs`.
    model: &'static str,
    size: usize,
}

impl Component {
    fn parse(s: &str) -> anyhow::Result<Self> {
        let (head, size) = match s.split_once('@') {
            Some((h, n)) => (h, n.parse::<usize>().with_context(|| format!("component `{s}`: size `{n}` is not a number"))?),
            None => (s, 512),
        };
        let (kind, model) = head.split_once('-').with_context(|| format!("component `{s}` is not KIND-MODEL[@SIZE]"))?;
        let kind = match kind {
            "unet" => Kind::Unet,
            "vae" => Kind::VaeDecoder,
            "taesd" => Kind::TinyDecoder,
            "text" => Kind::TextEncoder,
            "image" => Kind::Image,
            other => bail!("component `{s}`: unknown kind `{other}` (unet, vae, taesd, text, image)"),
        };
        let model = match model {
            "sd15" => "sd15",
            "sdxs" => "sdxs",
            other => bail!("component `{s}`: unknown model `{other}` (sd15, sdxs)"),
        };
        if size == 0 || size % 8 != 0 || size > 2048 {
            bail!("component `{s}`: size must be a multiple of 8 up to 2048");
        }
        Ok(Self { name: s.replace(['@', '-'], "_"), kind, model, size })
    }

    fn label(&self) -> String {
        match self.kind {
            Kind::TextEncoder => format!("{} text encoder, 77 tokens", self.model),
            Kind::Unet => format!("{} UNet {}x{}", self.model, self.size, self.size),
            Kind::VaeDecoder => format!("{} VAE decoder to {}x{}", self.model, self.size, self.size),
            Kind::TinyDecoder => format!("{} tiny VAE decoder to {}x{}", self.model, self.size, self.size),
            Kind::Image => {
                let (steps, guidance) = self.image_recipe();
                let guided = if guidance > 1.0 { format!("guided {guidance}") } else { "unguided".into() };
                format!("{} image {}x{}, {steps} step(s) {guided}", self.model, self.size, self.size)
            }
        }
    }

    /// Steps and guidance of a whole image: SD 1.5 as people run it (20 steps,
    /// guidance 7.5, so every step runs both branches), SDXS-512 as it was distilled
    /// to run (one step, no unconditional branch). DDIM on both sides: the folders'
    /// own PNDM has no one-step form, and the cost is the UNet's either way.
    fn image_recipe(&self) -> (usize, f64) {
        match self.model {
            "sdxs" => (1, 0.0),
            _ => (20, 7.5),
        }
    }

    fn subfolder(&self) -> &'static str {
        match self.kind {
            Kind::Unet => "unet",
            Kind::VaeDecoder | Kind::TinyDecoder => "vae",
            Kind::TextEncoder => "text_encoder",
            Kind::Image => "",
        }
    }

    fn segments(&self) -> &'static [Segment] {
        match self.kind {
            Kind::Unet => &[Segment::Unet],
            Kind::VaeDecoder | Kind::TinyDecoder => &[Segment::VaeDecoder],
            Kind::TextEncoder => &[Segment::TextEncoder],
            Kind::Image => &[Segment::TextEncoder, Segment::Unet, Segment::VaeDecoder],
        }
    }
}

/// One component loaded in brume, with the inputs both sides run.
enum Loaded {
    Unet(brume::models::unet_2d_condition::UNet2DConditionModel, Tensor, f32, Tensor),
    Decoder(brume::pipelines::model::AnyVaeDecoder, Tensor),
    Text(brume::models::clip::ClipTextModel, Tensor),
    Image(Box<ImageRun>),
}

impl Loaded {
    fn run(&self, model: &SdModel) -> anyhow::Result<Tensor> {
        Ok(match self {
            Loaded::Unet(u, x, t, ctx) => u.forward(x, &[*t], ctx, None)?,
            Loaded::Decoder(d, z) => d.decode(z)?,
            Loaded::Text(te, ids) => te.forward(ids, 0)?.hidden,
            Loaded::Image(run) => run.run(model)?,
        })
    }
}

/// A whole txt2img image with every segment loaded beforehand (loading is not what
/// is timed): the prompt (and, guided, the empty negative prompt) through the text
/// encoder, the steps through the UNet with the conditioning cache of one
/// generation, and the decoder. The peers run the same loop with diffusers' DDIM.
struct ImageRun {
    text: brume::models::clip::ClipTextModel,
    unet: brume::models::unet_2d_condition::UNet2DConditionModel,
    decoder: brume::pipelines::model::AnyVaeDecoder,
    /// The prompt; the negative prompt, when guided, is the empty one.
    prompt: &'static str,
    /// The initial noise, before the sampler's `init_noise_sigma`.
    noise: Tensor,
    steps: usize,
    guidance: f64,
}

impl ImageRun {
    /// The decoded image in [0, 1], as brume writes it.
    fn run(&self, model: &SdModel) -> anyhow::Result<Tensor> {
        use brume::pipelines::conditioning::encode_prompt;
        use brume::pipelines::{denoise::denoise, Conditioning, Flow, GenerationRequest, RunOptions};
        let (_, _, h, _) = self.noise.dims4()?;
        let req = GenerationRequest {
            steps: self.steps,
            guidance_scale: self.guidance,
            sampler: Some(brume::samplers::SamplerKind::Ddim),
            ..GenerationRequest::new("", h * model.vae_config.scale_factor())
        };
        let guided = req.guided(model);
        let encode = |text: &str| encode_prompt(model, &self.text, text, 0, &Device::Cpu);
        let cond = encode(self.prompt)?;
        let context = if guided { Tensor::cat(&[&encode("")?, &cond], 0)? } else { cond };
        let conditioning = Conditioning { context, guided, kv: brume::models::attention::KvCache::new(), encode_time: Duration::ZERO };
        let mut sampler = req.build_sampler(model)?;
        let latents = (&self.noise * sampler.init_noise_sigma())?;
        // DDIM at eta 0 draws nothing; the source is there for the signature.
        let mut rng = brume::samplers::Rng::new(0);
        let opts = RunOptions { device: Device::Cpu, ..RunOptions::default() };
        let latents = denoise(&self.unet, &conditioning, self.guidance, sampler.as_mut(), latents, 0, None, &mut rng, &opts, &mut |_| Flow::Continue)?;
        Ok(brume::pipelines::decode::decode_with(&self.decoder, model, &latents, &opts)?)
    }
}

/// `ids` as the u32 file the peers read, listed in `inputs`.
fn ids_input(work: &Path, file: String, ids: &[u32], inputs: &mut Vec<Value>) -> anyhow::Result<()> {
    let bytes: Vec<u8> = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
    // The work folder is the user's: replace only a regular file (ours from an earlier run), never follow a link.
    brume::output::Output::new(work.join(&file), true).write_bytes(&bytes)?;
    inputs.push(json!([file, [1, ids.len()], "u32"]));
    Ok(())
}

fn load(model: &SdModel, c: &Component, dev: &Device, work: &Path) -> anyhow::Result<(Loaded, Vec<Value>)> {
    let mut rng = brume::samplers::Rng::new(7);
    let mut inputs = Vec::new();
    let f32_input = |name: &str, t: &Tensor, inputs: &mut Vec<Value>| -> anyhow::Result<()> {
        let file = format!("{}.{name}.in", c.name);
        write_f32(&work.join(&file), t)?;
        inputs.push(json!([file, t.dims(), "f32"]));
        Ok(())
    };
    let loaded = match c.kind {
        Kind::Unet => {
            let unet = model.unet(dev, DType::F32)?;
            let f = model.vae_config.scale_factor();
            let x = rng.randn(&[1, model.unet_config.in_channels, c.size / f, c.size / f], dev)?;
            let ctx = rng.randn(&[1, 77, model.unet_config.cross_attention_dim[0]], dev)?;
            let t = 500f32;
            f32_input("sample", &x, &mut inputs)?;
            f32_input("t", &Tensor::new(&[t], dev)?, &mut inputs)?;
            f32_input("context", &ctx, &mut inputs)?;
            Loaded::Unet(unet, x, t, ctx)
        }
        Kind::VaeDecoder | Kind::TinyDecoder => {
            let dec = model.vae_decoder(dev, DType::F32)?;
            let f = model.vae_config.scale_factor();
            let z = rng.randn(&[1, model.vae_config.latent_channels(), c.size / f, c.size / f], dev)?;
            f32_input("latents", &z, &mut inputs)?;
            Loaded::Decoder(dec, z)
        }
        Kind::TextEncoder => {
            let te = model.text_encoder(dev, DType::F32)?;
            // A fixed, valid token sequence: BOS, words, EOS padding (as SD pads).
            let mut ids: Vec<u32> = vec![49406];
            ids.extend((1..20u32).map(|i| (i * 7919 + 13) % 49406));
            ids.resize(77, 49407);
            ids_input(work, format!("{}.ids.in", c.name), &ids, &mut inputs)?;
            Loaded::Text(te, Tensor::from_vec(ids, (1, 77), dev)?)
        }
        Kind::Image => {
            let (steps, guidance) = c.image_recipe();
            let f = model.vae_config.scale_factor();
            let noise = rng.randn(&[1, model.vae_config.latent_channels(), c.size / f, c.size / f], dev)?;
            let prompt = "a red fox in a snowy forest, oil painting";
            // The peers take the token ids brume's tokenizer makes of both prompts.
            ids_input(work, format!("{}.ids.in", c.name), &model.tokenizer.encode_padded(prompt), &mut inputs)?;
            ids_input(work, format!("{}.uncond_ids.in", c.name), &model.tokenizer.encode_padded(""), &mut inputs)?;
            f32_input("noise", &noise, &mut inputs)?;
            Loaded::Image(Box::new(ImageRun {
                text: model.text_encoder(dev, DType::F32)?,
                unet: model.unet(dev, DType::F32)?,
                decoder: model.vae_decoder(dev, DType::F32)?,
                prompt,
                noise,
                steps,
                guidance,
            }))
        }
    };
    Ok((loaded, inputs))
}

/// The peers' Python child.
struct Peers {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    version: String,
}

impl Peers {
    fn start(python: &str, script: &Path, work: &Path, threads: usize) -> anyhow::Result<Self> {
        let mut child = Command::new(python)
            .arg(script)
            .arg(work)
            .arg(threads.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {python} {}", script.display()))?;
        let (stdin, stdout) = match (child.stdin.take(), child.stdout.take()) {
            (Some(i), Some(o)) => (i, BufReader::new(o)),
            _ => bail!("no pipes to {python}"),
        };
        let mut p = Self { child, stdin, stdout, version: String::new() };
        let ready = p.read()?;
        p.version = ready["ready"].as_str().context("the peers' script did not start")?.to_owned();
        Ok(p)
    }

    fn read(&mut self) -> anyhow::Result<Value> {
        let mut s = String::new();
        if self.stdout.read_line(&mut s)? == 0 {
            bail!("the peers' script exited (its error is above)");
        }
        let v: Value = serde_json::from_str(&s).with_context(|| format!("the peers' script answered `{}`", s.trim()))?;
        if let Some(e) = v.get("error") {
            bail!("the peers' script: {e}");
        }
        Ok(v)
    }

    fn ask(&mut self, req: Value) -> anyhow::Result<Value> {
        writeln!(self.stdin, "{req}")?;
        self.stdin.flush()?;
        self.read()
    }
}

impl Drop for Peers {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"cmd": "quit"}));
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

/// The model folder for `name`: the user's, or a random f32 one from the real config.
fn model_folder(a: &SpeedArgs, name: &str) -> anyhow::Result<PathBuf> {
    let (given, preset) = match name {
        "sd15" => (&a.sd15, "sd15"),
        _ => (&a.sdxs, "sdxs-512"),
    };
    if let Some(p) = given {
        return Ok(p.clone());
    }
    let dir = a.work.join(format!("{preset}-f32"));
    if !dir.join("model_index.json").exists() {
        let p = random_model::preset(preset).context("missing preset")?;
        eprintln!("writing a random f32 {preset} model to {} ...", dir.display());
        random_model::write(p, &dir, StoredDType::F32, 0).with_context(|| format!("writing {}", dir.display()))?;
    }
    Ok(dir)
}

/// One way brume runs: which kernels, multiplying in what.
#[derive(Debug, Clone, Copy)]
struct Mode {
    kernels: KernelMode,
    compute: Compute,
    /// Whether 3x3 convolutions may take Winograd where it wins: F(4x4, 3x3) with f32
    /// products, F(2x2, 3x3) with bf16 ones.
    winograd: bool,
}

impl Mode {
    fn name(&self) -> &'static str {
        match (self.kernels, self.compute, self.winograd) {
            (KernelMode::Reference, ..) => "reference",
            (KernelMode::Fast, Compute::F32, true) => "fast",
            (KernelMode::Fast, Compute::F32, false) => "direct",
            (KernelMode::Fast, Compute::Bf16, true) => "bf16",
            (KernelMode::Fast, Compute::Bf16, false) => "bf16-direct",
        }
    }
}

struct Row {
    variant: String,
    precision: String,
    times: Vec<f64>,
    err: Option<f32>,
}

pub fn run(a: SpeedArgs) -> anyhow::Result<()> {
    if a.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let components = a.components.iter().map(|s| Component::parse(s)).collect::<anyhow::Result<Vec<_>>>()?;
    // `fast` runs Winograd as the layers would (BRUME_WINOGRAD, auto by default).
    let winograd_default = brume::kernels::winograd::mode();
    let mut modes = Vec::new();
    for m in &a.modes {
        match m.as_str() {
            "fast" => modes.push(Mode { kernels: KernelMode::Fast, compute: Compute::F32, winograd: true }),
            "direct" => modes.push(Mode { kernels: KernelMode::Fast, compute: Compute::F32, winograd: false }),
            "reference" => modes.push(Mode { kernels: KernelMode::Reference, compute: Compute::F32, winograd: false }),
            "bf16" | "bf16-direct" if brume::kernels::conv3x3_bf16::supported() => {
                modes.push(Mode { kernels: KernelMode::Fast, compute: Compute::Bf16, winograd: m == "bf16" })
            }
            "bf16" | "bf16-direct" => eprintln!("--modes {m} left out: this CPU has no AVX512-BF16"),
            other => bail!("--modes: `{other}` is not fast, direct, bf16, bf16-direct or reference"),
        }
    }
    if modes.is_empty() {
        bail!("--modes: nothing to run");
    }
    let mut peers_wanted = vec!["torch-f32".to_string()];
    peers_wanted.extend(a.peers.iter().filter(|p| p.as_str() != "torch-f32" && p.as_str() != "none").cloned());
    std::fs::create_dir_all(&a.work).with_context(|| format!("creating {}", a.work.display()))?;
    let threads = candle_core::utils::get_num_threads();
    let peak = brume::kernels::peak::peak_f32_gflops(Duration::from_millis(500));
    // On a CPU with AMX, bf16 rows (brume's and the peers') run on the tiles: quote them against the tiles' ceiling.
    let peak_amx = brume::kernels::peak::peak_amx_gflops(Duration::from_millis(500));
    let peak_bf16 = peak_amx.or_else(|| brume::kernels::peak::peak_bf16_gflops(Duration::from_millis(500)));
    let script = a.script.clone().unwrap_or_else(|| tool_script("tools/bench/speed.py"));
    let mut peers = Peers::start(&a.python, &script, &a.work, threads)?;
    println!(
        "brume bench speed: isa {}, {threads} threads, measured peak f32 {peak:.0} GFLOP/s{}; peers: {}; {} alternated runs per variant",
        brume::kernels::isa().name(),
        peak_bf16.map(|b| format!(", bf16 {b:.0} GFLOP/s ({})", if peak_amx.is_some() { "AMX tiles" } else { "vdpbf16ps" })).unwrap_or_default(),
        peers.version,
        a.runs
    );
    let dev = Device::Cpu;
    let mut summary = Vec::new();
    for c in &components {
        let folder = model_folder(&a, c.model)?;
        let model = SdModel::open(&folder, &OpenOptions::default()).with_context(|| format!("opening {}", folder.display()))?;
        eprintln!("{}: loading ...", c.name);
        let (loaded, inputs) = load(&model, c, &dev, &a.work)?;
        let kind = match c.kind {
            Kind::Unet => "unet",
            Kind::VaeDecoder => "vae_decoder",
            Kind::TinyDecoder => "tiny_decoder",
            Kind::TextEncoder => "text_encoder",
            Kind::Image => "image",
        };
        let (steps, guidance) = c.image_recipe();
        let ans = peers.ask(json!({"cmd": "load", "name": c.name, "kind": kind, "model": folder, "subfolder": c.subfolder(),
            "inputs": inputs, "variants": peers_wanted, "steps": steps, "guidance": guidance}))?;
        let flops = ans["flops"].as_f64().unwrap_or(0.0);
        let ready: Vec<String> = ans["variants"].as_array().map(|v| v.iter().filter_map(|x| x.as_str().map(str::to_owned)).collect()).unwrap_or_default();
        if !ready.iter().any(|v| v == "torch-f32") {
            bail!("{}: PyTorch f32 (the error reference) did not load: {}", c.name, ans["skipped"]);
        }
        let mut rows: Vec<Row> = modes
            .iter()
            .map(|m| Row { variant: format!("brume {}", m.name()), precision: m.compute.name().into(), times: Vec::new(), err: None })
            .collect();
        rows.extend(ready.iter().map(|v| Row {
            variant: v.clone(),
            precision: ans["precision"][v].as_str().unwrap_or("").to_owned(),
            times: Vec::new(),
            err: None,
        }));
        let brume_run = |m: Mode| -> anyhow::Result<(f64, Tensor)> {
            brume::kernels::set_mode(m.kernels);
            brume::kernels::winograd::set_mode(if m.winograd { winograd_default } else { brume::kernels::winograd::Mode::Off });
            brume::kernels::set_compute(m.compute).map_err(anyhow::Error::msg)?;
            let t = Instant::now();
            let y = loaded.run(&model)?;
            Ok((t.elapsed().as_secs_f64(), y))
        };
        // Warm-up round: one run of each, which also gives the outputs for the errors.
        let mut outs = Vec::new();
        for m in &modes {
            outs.push(brume_run(*m)?.1);
        }
        for v in &ready {
            peers.ask(json!({"cmd": "run", "name": c.name, "variant": v}))?;
        }
        let want = read_f32(&a.work.join(format!("{}.torch-f32.f32", c.name)), &outs[0])?;
        for (i, y) in outs.iter().enumerate() {
            rows[i].err = Some(rel_err(y, &want)?);
        }
        for (j, v) in ready.iter().enumerate() {
            // A peer that cannot start from brume's inputs has no comparable output.
            if ans["no_output"].get(v).is_some() {
                continue;
            }
            let got = read_f32(&a.work.join(format!("{}.{v}.f32", c.name)), &outs[0])?;
            rows[modes.len() + j].err = Some(rel_err(&got, &want)?);
        }
        for r in 0..a.runs {
            eprint!("\r{}: run {}/{}", c.name, r + 1, a.runs);
            for (i, m) in modes.iter().enumerate() {
                rows[i].times.push(brume_run(*m)?.0);
            }
            for (j, v) in ready.iter().enumerate() {
                let s = peers.ask(json!({"cmd": "run", "name": c.name, "variant": v}))?["s"].as_f64().context("no time in the answer")?;
                rows[modes.len() + j].times.push(s);
            }
        }
        eprintln!();
        brume::kernels::set_mode(KernelMode::Fast);
        brume::kernels::winograd::set_mode(winograd_default);
        brume::kernels::set_compute(Compute::F32).map_err(anyhow::Error::msg)?;
        peers.ask(json!({"cmd": "unload", "name": c.name}))?;
        drop(loaded);
        for &seg in c.segments() {
            model.release(seg);
        }

        println!();
        println!("{} ({:.1} GFLOP)", c.label(), flops / 1e9);
        println!("{:<18} {:<10} {:>9} {:>9} {:>9} {:>8} {:>6} {:>9}", "variant", "precision", "median s", "min s", "max s", "GFLOP/s", "%peak", "err");
        for r in &rows {
            let (med, min, max) = spread(&r.times).context("no timed runs")?;
            let g = flops / med / 1e9;
            // bf16 rows against the bf16 ceiling where there is one.
            let ceiling = if r.precision.starts_with("bf16") { peak_bf16.unwrap_or(peak) } else { peak };
            println!(
                "{:<18} {:<10} {:>9.4} {:>9.4} {:>9.4} {:>8.1} {:>5.0}% {:>9}",
                r.variant,
                r.precision,
                med,
                min,
                max,
                g,
                100.0 * g / ceiling,
                r.err.map_or_else(|| "n/a".to_string(), |e| format!("{e:.2e}"))
            );
        }
        // brume's fastest mode within the error bar, against every peer.
        let med = |r: &Row| spread(&r.times).map(|s| s.0).unwrap_or(f64::NAN);
        let best = rows[..modes.len()].iter().filter(|r| r.err.is_some_and(|e| e <= 1e-2)).min_by(|x, y| med(x).total_cmp(&med(y)));
        if let Some(b) = best {
            let ratios: Vec<String> = rows[modes.len()..].iter().map(|p| format!("{} {:.2}", p.variant, med(b) / med(p))).collect();
            println!("{} / peer: {}", b.variant, ratios.join(", "));
            let fastest_peer = rows[modes.len()..].iter().min_by(|x, y| med(x).total_cmp(&med(y)));
            if let Some(p) = fastest_peer {
                summary.push(format!("{:<40} {} {:.3} s vs fastest peer {} {:.3} s: ratio {:.2}", c.label(), b.variant, med(b), p.variant, med(p), med(b) / med(p)));
            }
        }
        for (v, why) in ans["skipped"].as_object().into_iter().flatten() {
            println!("skipped {v}: {}", why.as_str().unwrap_or(""));
        }
        for (v, why) in ans["no_output"].as_object().into_iter().flatten() {
            println!("{v}: error n/a ({})", why.as_str().unwrap_or(""));
        }
    }
    println!();
    println!("summary (ratio < 1: brume faster):");
    for s in summary {
        println!("  {s}");
    }
    println!("err: max|out - torch f32| / max|torch f32|. GFLOP: conv + matmul + attention as torch's FlopCounterMode counts them; %peak of the f32 ceiling, bf16 rows of the bf16 one.");
    Ok(())
}
