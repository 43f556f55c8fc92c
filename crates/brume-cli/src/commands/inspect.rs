use std::collections::BTreeMap;
use std::time::Instant;

use brume::loading::Segment;
use brume::pipelines::{SdModel, VaeConfig};
use brume::runtime::memory::{self, mib};
use candle_core::DType;

use super::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The model to inspect (a diffusers folder or an LDM .safetensors; default: built-in).
    #[arg(value_name = "MODEL")]
    model_pos: Option<std::path::PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
    /// Also load each segment in turn (and drop it), reporting time and memory.
    #[arg(long)]
    load: bool,
}

pub fn run(mut a: Args) -> anyhow::Result<()> {
    if a.model_pos.is_some() {
        a.model.model = a.model_pos.take();
    }
    let model = a.model.open()?;
    print_architecture(&model);
    println!();
    println!("{:<13} {:>14} {:>12}  dtypes", "segment", "parameters", "bytes");
    let mut total = (0usize, 0usize);
    for s in Segment::ALL {
        let (c, prefixes) = s.weights();
        let mut params = 0usize;
        let mut by_dtype: BTreeMap<String, usize> = BTreeMap::new();
        for (name, t) in model.store(c).iter() {
            if !prefixes.is_empty() && !prefixes.iter().any(|p| name.starts_with(p)) {
                continue;
            }
            params += t.shape().iter().product::<usize>();
            *by_dtype.entry(t.dtype().to_string()).or_default() += t.nbytes();
        }
        let bytes = model.segment_bytes(s);
        total.0 += params;
        total.1 += bytes;
        let dtypes: Vec<String> = by_dtype.iter().map(|(d, b)| format!("{d} {}", mib(*b as u64))).collect();
        println!("{:<13} {:>14} {:>12}  {}", s.name(), params, mib(bytes as u64), dtypes.join(", "));
    }
    println!("{:<13} {:>14} {:>12}", "total", total.0, mib(total.1 as u64));
    if a.load {
        println!();
        let device = brume::runtime::default_device();
        for s in Segment::ALL {
            let before = memory::read();
            let start = Instant::now();
            match s {
                Segment::TextEncoder => drop(model.text_encoder(&device, DType::F32)?),
                Segment::Unet => drop(model.unet(&device, DType::F32)?),
                Segment::VaeEncoder => drop(model.vae_encoder(&device, DType::F32)?),
                Segment::VaeDecoder => drop(model.vae_decoder(&device, DType::F32)?),
            }
            let after = memory::read();
            println!(
                "loaded and dropped {:<12} in {:.2} s; RSS {} -> peak {}",
                s.name(),
                start.elapsed().as_secs_f64(),
                before.rss.map(mib).unwrap_or_default(),
                after.peak_rss.map(mib).unwrap_or_default()
            );
        }
    }
    Ok(())
}

fn print_architecture(m: &SdModel) {
    let t = &m.text_config;
    let u = &m.unet_config;
    println!("model        {} ({})", m.name, m.root.display());
    if let Some(p) = &m.pipeline_class {
        println!("pipeline     {p}");
    }
    println!(
        "text encoder CLIPTextModel: {} layers, width {}, {} heads, mlp {}, {:?}, vocab {}",
        t.num_hidden_layers, t.hidden_size, t.num_attention_heads, t.intermediate_size, t.hidden_act, t.vocab_size
    );
    println!(
        "unet         UNet2DConditionModel: in {} out {}, channels {:?}, layers/block {:?}, heads {:?}, \
         cross-attn {:?}, linear proj {}, mid {:?}{}",
        u.in_channels,
        u.out_channels,
        u.block_out_channels,
        u.layers_per_block,
        u.num_heads,
        u.cross_attention_dim,
        u.use_linear_projection,
        u.mid_block_type,
        u.time_cond_proj_dim.map(|d| format!(", time_cond_proj_dim {d}")).unwrap_or_default()
    );
    match &m.vae_config {
        VaeConfig::Kl(c) => println!(
            "vae          AutoencoderKL: channels {:?}, {} latent channels, scaling {}",
            c.block_out_channels, c.latent_channels, c.scaling_factor
        ),
        VaeConfig::Tiny(c) => println!(
            "vae          AutoencoderTiny: channels {:?}, {} latent channels, scaling {}",
            c.decoder_block_out_channels, c.latent_channels, c.scaling_factor
        ),
    }
    println!(
        "schedule     {} steps, {:?}, prediction {:?}, spacing {:?} (from {})",
        m.schedule.num_train_timesteps,
        m.schedule.beta_schedule,
        m.schedule.prediction_type,
        m.schedule.timestep_spacing,
        m.schedule.class_name.as_deref().unwrap_or("defaults")
    );
    println!("native size  {0}x{0}", m.default_size());
}
