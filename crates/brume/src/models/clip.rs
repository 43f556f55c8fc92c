//! CLIP text encoder, as transformers' `CLIPTextModel` (SD 1.x ViT-L/14 with
//! quick_gelu; SD 2.x OpenCLIP ViT-H/14 text tower with gelu).

use std::path::Path;

use candle_core::{DType, Device, Tensor};

use super::config::ConfigReader;
use crate::error::LoadError;
use crate::layers::{attention, Activation, AttentionMask, Embedding, LayerNorm, Linear};
use crate::loading::{Loader, WeightStore, Weights};

/// The fields of transformers' `CLIPTextConfig` that shape the computation.
#[derive(Debug, Clone, PartialEq)]
pub struct ClipTextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub max_position_embeddings: usize,
    pub hidden_act: Activation,
    pub layer_norm_eps: f64,
    /// transformers' legacy rule: with `eos_token_id == 2` the pooled token is the
    /// argmax of the ids (the EOS id 49407 is the largest); otherwise the first EOS.
    pub eos_token_id: u32,
}

impl ClipTextConfig {
    pub fn from_file(path: &Path) -> Result<Self, LoadError> {
        Self::from_reader(&ConfigReader::open(path)?)
    }

    pub fn from_reader(c: &ConfigReader) -> Result<Self, LoadError> {
        if let Some(arch) = c.get("architectures").and_then(|a| a.as_array()) {
            for a in arch {
                if a.as_str() != Some("CLIPTextModel") {
                    return Err(c.error("architectures", format!("{a} is not supported (expected CLIPTextModel)")));
                }
            }
        }
        let act_name = c.string("hidden_act")?.unwrap_or_else(|| "quick_gelu".into());
        let hidden_act = match Activation::parse(&act_name) {
            Some(a @ (Activation::QuickGelu | Activation::Gelu)) => a,
            _ => return Err(c.error("hidden_act", format!("`{act_name}` is not supported (quick_gelu, gelu)"))),
        };
        let cfg = Self {
            vocab_size: c.usize("vocab_size", Some(49408))?,
            hidden_size: c.usize("hidden_size", Some(512))?,
            intermediate_size: c.usize("intermediate_size", Some(2048))?,
            num_hidden_layers: c.usize("num_hidden_layers", Some(12))?,
            num_attention_heads: c.usize("num_attention_heads", Some(8))?,
            max_position_embeddings: c.usize("max_position_embeddings", Some(77))?,
            hidden_act,
            layer_norm_eps: c.f64("layer_norm_eps", 1e-5)?,
            eos_token_id: c.usize("eos_token_id", Some(2))? as u32,
        };
        if cfg.num_attention_heads == 0 || cfg.hidden_size % cfg.num_attention_heads != 0 {
            return Err(c.error(
                "num_attention_heads",
                format!("{} does not divide hidden_size {}", cfg.num_attention_heads, cfg.hidden_size),
            ));
        }
        Ok(cfg)
    }
}

struct ClipAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    out_proj: Linear,
    heads: usize,
    head_dim: usize,
}

impl ClipAttention {
    fn load(w: &Weights, cfg: &ClipTextConfig) -> Result<Self, LoadError> {
        let d = cfg.hidden_size;
        Ok(Self {
            q_proj: Linear::load(&w.pp("q_proj"), d, d, true)?,
            k_proj: Linear::load(&w.pp("k_proj"), d, d, true)?,
            v_proj: Linear::load(&w.pp("v_proj"), d, d, true)?,
            out_proj: Linear::load(&w.pp("out_proj"), d, d, true)?,
            heads: cfg.num_attention_heads,
            head_dim: d / cfg.num_attention_heads,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        let split = |t: Tensor| t.reshape((b, n, self.heads, self.head_dim))?.transpose(1, 2);
        let q = split(self.q_proj.forward(x)?)?;
        let k = split(self.k_proj.forward(x)?)?;
        let v = split(self.v_proj.forward(x)?)?;
        let scale = (self.head_dim as f64).powf(-0.5);
        let o = attention(&q, &k, &v, scale, AttentionMask::Causal)?;
        let o = o.transpose(1, 2)?.reshape((b, n, self.heads * self.head_dim))?;
        self.out_proj.forward(&o)
    }
}

struct ClipEncoderLayer {
    layer_norm1: LayerNorm,
    self_attn: ClipAttention,
    layer_norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    act: Activation,
}

impl ClipEncoderLayer {
    fn load(w: &Weights, cfg: &ClipTextConfig) -> Result<Self, LoadError> {
        let d = cfg.hidden_size;
        Ok(Self {
            layer_norm1: LayerNorm::load(&w.pp("layer_norm1"), d, cfg.layer_norm_eps)?,
            self_attn: ClipAttention::load(&w.pp("self_attn"), cfg)?,
            layer_norm2: LayerNorm::load(&w.pp("layer_norm2"), d, cfg.layer_norm_eps)?,
            fc1: Linear::load(&w.pp("mlp").pp("fc1"), d, cfg.intermediate_size, true)?,
            fc2: Linear::load(&w.pp("mlp").pp("fc2"), cfg.intermediate_size, d, true)?,
            act: cfg.hidden_act,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = (x + self.self_attn.forward(&self.layer_norm1.forward(x)?)?)?;
        let m = self.fc2.forward(&self.act.forward(&self.fc1.forward(&self.layer_norm2.forward(&h)?)?)?)?;
        h + m
    }
}

/// Output of one text-encoder run.
pub struct ClipOutput {
    /// `final_layer_norm` applied to the output of the last layer that ran:
    /// transformers' `last_hidden_state` with skip 0, diffusers' `clip_skip` prompt embeds otherwise.
    pub hidden: Tensor,
    /// The hidden state at the EOS position (transformers' `pooler_output`); only
    /// meaningful with skip 0.
    pub pooled: Tensor,
}

/// transformers' `CLIPTextModel`.
pub struct ClipTextModel {
    token_embedding: Embedding,
    position_embedding: Embedding,
    layers: Vec<ClipEncoderLayer>,
    final_layer_norm: LayerNorm,
    cfg: ClipTextConfig,
    device: Device,
}

impl ClipTextModel {
    pub fn load(store: &WeightStore, cfg: &ClipTextConfig, device: &Device, dtype: DType) -> Result<Self, LoadError> {
        let loader = store.loader("text_encoder (CLIPTextModel)", device, dtype);
        let model = Self::from_loader(&loader, cfg)?;
        loader.finish(&[])?;
        Ok(model)
    }

    /// Builds the module from any loader (a file-backed one, or a recorder).
    pub fn from_loader(loader: &Loader, cfg: &ClipTextConfig) -> Result<Self, LoadError> {
        let root = loader.root();
        // transformers < 5 and every SD checkpoint prefix the keys with `text_model.`;
        // transformers 5 saves them without it. Both describe the same module.
        let tm = if root.pp("text_model").contains("final_layer_norm.weight") || !root.contains("final_layer_norm.weight") {
            root.pp("text_model")
        } else {
            root.clone()
        };
        let emb = tm.pp("embeddings");
        let d = cfg.hidden_size;
        let token_embedding = Embedding::load(&emb.pp("token_embedding"), "weight", cfg.vocab_size, d)?;
        let position_embedding = Embedding::load(&emb.pp("position_embedding"), "weight", cfg.max_position_embeddings, d)?;
        // Older transformers saved the position_ids buffer; it carries nothing we need.
        emb.ignore("position_ids");
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| ClipEncoderLayer::load(&tm.pp("encoder").pp("layers").pp(i), cfg))
            .collect::<Result<Vec<_>, _>>()?;
        let final_layer_norm = LayerNorm::load(&tm.pp("final_layer_norm"), d, cfg.layer_norm_eps)?;
        Ok(Self {
            token_embedding,
            position_embedding,
            layers,
            final_layer_norm,
            cfg: cfg.clone(),
            device: loader.device().clone(),
        })
    }

    pub fn config(&self) -> &ClipTextConfig {
        &self.cfg
    }

    /// Encodes token ids [batch, seq]. `skip` layers at the end are not run
    /// (diffusers' `clip_skip`); `final_layer_norm` is applied either way.
    pub fn forward(&self, ids: &Tensor, skip: usize) -> candle_core::Result<ClipOutput> {
        let (_, n) = ids.dims2()?;
        if n > self.cfg.max_position_embeddings {
            candle_core::bail!(
                "{n} tokens exceed the text encoder's {} positions",
                self.cfg.max_position_embeddings
            );
        }
        if skip >= self.layers.len() {
            candle_core::bail!("clip skip {skip} leaves no layer of {} to run", self.layers.len());
        }
        let positions = Tensor::arange(0u32, n as u32, &self.device)?;
        let mut h = self
            .token_embedding
            .forward(ids)?
            .broadcast_add(&self.position_embedding.forward(&positions)?.unsqueeze(0)?)?;
        for layer in &self.layers[..self.layers.len() - skip] {
            h = layer.forward(&h)?;
        }
        let hidden = self.final_layer_norm.forward(&h)?;
        let ids_rows = ids.to_dtype(DType::U32)?.to_vec2::<u32>()?;
        let rows = ids_rows
            .iter()
            .enumerate()
            .map(|(i, row)| hidden.get(i)?.get(self.eos_position(row)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let pooled = Tensor::stack(&rows, 0)?;
        Ok(ClipOutput { hidden, pooled })
    }

    fn eos_position(&self, row: &[u32]) -> usize {
        if self.cfg.eos_token_id == 2 {
            // torch.argmax returns the first maximum.
            let max = row.iter().copied().max().unwrap_or(0);
            row.iter().position(|&t| t == max).unwrap_or(0)
        } else {
            row.iter().position(|&t| t == self.cfg.eos_token_id).unwrap_or(0)
        }
    }
}
