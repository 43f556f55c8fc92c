//! Stable Diffusion 1.x / 2.x single-file checkpoints in the original LDM layout.
//!
//! A CompVis/Stability "single file" checkpoint stores the three networks under
//! their training-code names: the UNet under `model.diffusion_model.*`, the VAE
//! under `first_stage_model.*`, and the text tower under
//! `cond_stage_model.transformer.*` (SD1, OpenAI CLIP ViT-L in the transformers
//! layout) or `cond_stage_model.model.*` (SD2, OpenCLIP ViT-H in the open_clip
//! layout). brume's modules use the diffusers names (`UNet2DConditionModel`,
//! `AutoencoderKL`) and the transformers `CLIPTextModel` names as stored on disk
//! (`text_model.*`).
//!
//! This module is pure name and shape logic, with no tensor data:
//!
//! * [`infer`] reads the model's architecture off the stored names and shapes;
//! * [`map_keys`] lists, for every tensor the three diffusers components need,
//!   the stored tensor it comes from and the [`Transform`] that turns it into the
//!   tensor the module wants, and rejects any stored tensor it cannot place.
//!
//! The facts were checked against diffusers' single-file conversion
//! (`diffusers.loaders.single_file_utils`, 0.42) with the fixtures under
//! `fixtures/ldm/` (see `tools/ldm/README.md`). In brief:
//!
//! UNet (`model.diffusion_model.` stripped; `per = layers_per_block + 1`):
//! * `input_blocks.0.0` -> `conv_in`; `time_embed.{0,2}` -> `time_embedding.linear_{1,2}`;
//!   `out.{0,2}` -> `conv_norm_out` / `conv_out`.
//! * `input_blocks.{1 + b*per + j}.0` -> `down_blocks.b.resnets.j`, `.1` ->
//!   `down_blocks.b.attentions.j` (j < layers_per_block);
//!   `input_blocks.{(b+1)*per}.0.op` -> `down_blocks.b.downsamplers.0.conv`.
//! * `middle_block.{0,1,2}` -> `mid_block.resnets.0`, `mid_block.attentions.0`,
//!   `mid_block.resnets.1`.
//! * `output_blocks.{i*per + j}.0` -> `up_blocks.i.resnets.j`, `.1` ->
//!   `up_blocks.i.attentions.j` (j <= layers_per_block); the upsampler of up
//!   block i sits on its last slot as `.2.conv` after an attention, else `.1.conv`.
//! * ResBlock parts: `in_layers.0/2` -> `norm1`/`conv1`, `emb_layers.1` ->
//!   `time_emb_proj`, `out_layers.0/3` -> `norm2`/`conv2`, `skip_connection` ->
//!   `conv_shortcut`. SpatialTransformer parts keep their names.
//!
//! VAE (`first_stage_model.` stripped): `encoder.down.l.block.j` ->
//! `encoder.down_blocks.l.resnets.j`, `encoder.down.l.downsample` ->
//! `encoder.down_blocks.l.downsamplers.0`; the decoder runs reversed,
//! `decoder.up.l` -> `decoder.up_blocks.{n-1-l}`; `mid.block_{1,2}` ->
//! `mid_block.resnets.{0,1}`; `mid.attn_1.{norm,q,k,v,proj_out}` ->
//! `mid_block.attentions.0.{group_norm,to_q,to_k,to_v,to_out.0}` with the 1x1
//! conv weights `[C, C, 1, 1]` reshaped to linear `[C, C]`; `nin_shortcut` ->
//! `conv_shortcut`; `norm_out` -> `conv_norm_out`; `quant_conv` and
//! `post_quant_conv` keep their names.
//!
//! Text: SD1 strips `cond_stage_model.transformer.` (older files lack the
//! `text_model.` level, which is then added). SD2 maps open_clip names onto
//! CLIP ones, splits `attn.in_proj_weight` `[3d, d]` / `in_proj_bias` `[3d]`
//! into q, k, v by rows, and drops the final resblock: SD2 conditions on the
//! penultimate layer, so diffusers' text encoder has one layer fewer (23 of 24).

use std::collections::{BTreeSet, HashSet};
use std::fmt;

use super::segment::Component;
use super::transform::Transform;

const UNET: &str = "model.diffusion_model.";
const VAE: &str = "first_stage_model.";
const SD1_TEXT: &str = "cond_stage_model.transformer.";
const SD2_TEXT: &str = "cond_stage_model.model.";
/// Target prefix of every text-encoder tensor (transformers' on-disk names).
const TEXT: &str = "text_model.";

/// Top-level training buffers of the LDM `DDPM` wrapper: never model weights.
const IGNORED_NAMES: &[&str] = &[
    "betas",
    "alphas_cumprod",
    "alphas_cumprod_prev",
    "sqrt_alphas_cumprod",
    "sqrt_one_minus_alphas_cumprod",
    "log_one_minus_alphas_cumprod",
    "sqrt_recip_alphas_cumprod",
    "sqrt_recipm1_alphas_cumprod",
    "posterior_variance",
    "posterior_log_variance_clipped",
    "posterior_mean_coef1",
    "posterior_mean_coef2",
    "logvar",
    "lvlb_weights",
    // OpenCLIP parts the SD2 text encoder does not use.
    "cond_stage_model.model.text_projection",
    "cond_stage_model.model.logit_scale",
];

/// Which text tower the checkpoint carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LdmFamily {
    /// Stable Diffusion 1.x: OpenAI CLIP ViT-L (`cond_stage_model.transformer.*`).
    Sd1,
    /// Stable Diffusion 2.x: OpenCLIP ViT-H (`cond_stage_model.model.*`).
    Sd2,
}

/// What can be read off the checkpoint's keys and shapes alone.
///
/// Not readable from the file, so not here: attention head counts (SD1 uses 8
/// heads everywhere; SD2 uses 64-wide heads, i.e. `[5, 10, 20, 20]` heads), the
/// UNet's `upcast_attention`, the VAE scaling factor and the sample sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LdmInferred {
    pub family: LdmFamily,
    pub unet_in_channels: usize,
    pub unet_out_channels: usize,
    pub unet_block_out_channels: Vec<usize>,
    pub unet_layers_per_block: usize,
    /// Per down block: `CrossAttnDownBlock2D` (true) or `DownBlock2D`.
    pub unet_down_attention: Vec<bool>,
    /// Per up block (diffusers order): `CrossAttnUpBlock2D` (true) or `UpBlock2D`.
    pub unet_up_attention: Vec<bool>,
    pub unet_has_mid_attention: bool,
    pub unet_cross_attention_dim: usize,
    /// Transformer `proj_in`/`proj_out` are linear (SD2) rather than 1x1 convs (SD1).
    pub unet_use_linear_projection: bool,
    /// diffusers' `transformer_layers_per_block`, per down block. A block without
    /// attention reads as the middle block's depth (diffusers builds the middle
    /// block with the last entry), up blocks use the list reversed.
    pub unet_transformer_layers: Vec<usize>,
    pub vae_block_out_channels: Vec<usize>,
    pub vae_layers_per_block: usize,
    pub vae_latent_channels: usize,
    pub text_hidden_size: usize,
    /// Layers of the text encoder as diffusers builds it: for SD2 one fewer than
    /// the stored OpenCLIP resblocks (23 of 24).
    pub text_layers: usize,
    pub text_intermediate_size: usize,
    pub text_vocab_size: usize,
    pub text_max_positions: usize,
}

/// One target tensor: the diffusers component and name, where its data comes
/// from, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LdmMapping {
    pub component: Component,
    /// The tensor name inside the component (e.g. `down_blocks.0.resnets.0.conv1.weight`).
    pub target: String,
    /// The stored LDM tensor name.
    pub source: String,
    pub transform: Transform,
}

/// Why an LDM checkpoint cannot be read. Messages name the tensor and the problem.
#[derive(Debug, thiserror::Error)]
pub enum LdmError {
    #[error("not an LDM single-file checkpoint: no `model.diffusion_model.*` tensors")]
    NotLdm,
    #[error(
        "LDM checkpoint has no text encoder: expected `cond_stage_model.transformer.*` (SD1) \
         or `cond_stage_model.model.*` (SD2) tensors"
    )]
    NoTextEncoder,
    #[error(
        "LDM checkpoint has both an SD1 (`cond_stage_model.transformer.*`) and an SD2 \
         (`cond_stage_model.model.*`) text encoder"
    )]
    AmbiguousTextEncoder,
    #[error("LDM checkpoint is missing tensor `{name}` (needed for {needed_for})")]
    Missing { name: String, needed_for: String },
    #[error("LDM tensor `{name}` has shape {shape:?}: {problem}")]
    BadShape {
        name: String,
        shape: Vec<usize>,
        problem: String,
    },
    #[error("LDM checkpoint has {} tensor(s) brume does not know: {}", names.len(), NameList(names))]
    Unknown { names: Vec<String> },
    #[error("unsupported LDM checkpoint layout: {0}")]
    Unsupported(String),
}

/// Shows at most ten names, then how many more.
struct NameList<'a>(&'a [String]);

impl fmt::Display for NameList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 10;
        for (i, name) in self.0.iter().take(SHOWN).enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "`{name}`")?;
        }
        if self.0.len() > SHOWN {
            write!(f, " and {} more", self.0.len() - SHOWN)?;
        }
        Ok(())
    }
}

/// True when the keys look like an LDM single-file checkpoint
/// (`model.diffusion_model.*` present).
pub fn is_ldm(keys: &[(String, Vec<usize>)]) -> bool {
    keys.iter().any(|(name, _)| name.starts_with(UNET))
}

/// True for stored tensors an LDM checkpoint may carry that no diffusers
/// component uses: EMA copies, the diffusion schedule buffers, the CLIP
/// `position_ids` buffer, OpenCLIP's `text_projection` and `logit_scale`. (The
/// unused final SD2 resblock depends on the layer count; [`map_keys`] handles it.)
pub fn is_ignorable(name: &str) -> bool {
    IGNORED_NAMES.contains(&name)
        || name.starts_with("model_ema.")
        || (name.starts_with(SD1_TEXT) && name.ends_with(".position_ids"))
}

// ------------------------------------------------------------------ key index

/// Sorted view of the stored names and shapes, for prefix queries.
struct Keys<'a> {
    sorted: Vec<(&'a str, &'a [usize])>,
}

impl<'a> Keys<'a> {
    fn new(tensors: &'a [(String, Vec<usize>)]) -> Self {
        let mut sorted: Vec<(&str, &[usize])> = tensors
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_slice()))
            .collect();
        sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
        Keys { sorted }
    }

    fn get(&self, name: &str) -> Option<&'a [usize]> {
        self.sorted
            .binary_search_by(|(n, _)| (*n).cmp(name))
            .ok()
            .map(|i| self.sorted[i].1)
    }

    fn need(&self, name: &str, needed_for: &str) -> Result<&'a [usize], LdmError> {
        self.get(name).ok_or_else(|| LdmError::Missing {
            name: name.to_string(),
            needed_for: needed_for.to_string(),
        })
    }

    fn need_rank(
        &self,
        name: &str,
        rank: usize,
        needed_for: &str,
    ) -> Result<&'a [usize], LdmError> {
        let shape = self.need(name, needed_for)?;
        if shape.len() != rank {
            return Err(bad_shape(
                name,
                shape,
                format!("expected {rank} dimensions"),
            ));
        }
        Ok(shape)
    }

    /// Names starting with `prefix`.
    fn with_prefix(&self, prefix: &str) -> impl Iterator<Item = &'a str> + '_ {
        let start = self.sorted.partition_point(|(n, _)| *n < prefix);
        let prefix = prefix.to_string();
        self.sorted[start..]
            .iter()
            .map(|(n, _)| *n)
            .take_while(move |n| n.starts_with(prefix.as_str()))
    }

    fn has_prefix(&self, prefix: &str) -> bool {
        self.with_prefix(prefix).next().is_some()
    }

    /// The distinct `N` in names of the form `{prefix}N.…`.
    fn indices(&self, prefix: &str) -> BTreeSet<usize> {
        self.with_prefix(prefix)
            .filter_map(|n| n[prefix.len()..].split('.').next()?.parse().ok())
            .collect()
    }

    /// Like [`Keys::indices`], but requires them to be `0..n` and returns `n`.
    fn count(&self, prefix: &str) -> Result<usize, LdmError> {
        let found = self.indices(prefix);
        let n = found.len();
        if found.iter().copied().ne(0..n) {
            return Err(LdmError::Unsupported(format!(
                "`{prefix}N` indices are not 0..{n}: {found:?}"
            )));
        }
        Ok(n)
    }
}

fn bad_shape(name: &str, shape: &[usize], problem: String) -> LdmError {
    LdmError::BadShape {
        name: name.to_string(),
        shape: shape.to_vec(),
        problem,
    }
}

// ------------------------------------------------------------------ inference

/// Reads the architecture off the checkpoint's keys and shapes.
pub fn infer(tensors: &[(String, Vec<usize>)]) -> Result<LdmInferred, LdmError> {
    let keys = Keys::new(tensors);
    if !keys.has_prefix(UNET) {
        return Err(LdmError::NotLdm);
    }
    let family = match (keys.has_prefix(SD1_TEXT), keys.has_prefix(SD2_TEXT)) {
        (true, false) => LdmFamily::Sd1,
        (false, true) => LdmFamily::Sd2,
        (true, true) => return Err(LdmError::AmbiguousTextEncoder),
        (false, false) => return Err(LdmError::NoTextEncoder),
    };
    let unet = infer_unet(&keys)?;
    let vae = infer_vae(&keys)?;
    let text = match family {
        LdmFamily::Sd1 => infer_clip(&keys)?,
        LdmFamily::Sd2 => infer_open_clip(&keys)?,
    };
    Ok(LdmInferred {
        family,
        unet_in_channels: unet.in_channels,
        unet_out_channels: unet.out_channels,
        unet_block_out_channels: unet.block_out_channels,
        unet_layers_per_block: unet.layers_per_block,
        unet_down_attention: unet.down_attention,
        unet_up_attention: unet.up_attention,
        unet_has_mid_attention: unet.has_mid_attention,
        unet_cross_attention_dim: unet.cross_attention_dim,
        unet_use_linear_projection: unet.use_linear_projection,
        unet_transformer_layers: unet.transformer_layers,
        vae_block_out_channels: vae.block_out_channels,
        vae_layers_per_block: vae.layers_per_block,
        vae_latent_channels: vae.latent_channels,
        text_hidden_size: text.hidden,
        text_layers: text.layers,
        text_intermediate_size: text.intermediate,
        text_vocab_size: text.vocab,
        text_max_positions: text.positions,
    })
}

struct UnetFacts {
    in_channels: usize,
    out_channels: usize,
    block_out_channels: Vec<usize>,
    layers_per_block: usize,
    down_attention: Vec<bool>,
    up_attention: Vec<bool>,
    has_mid_attention: bool,
    cross_attention_dim: usize,
    use_linear_projection: bool,
    transformer_layers: Vec<usize>,
}

fn infer_unet(keys: &Keys) -> Result<UnetFacts, LdmError> {
    const WHY: &str = "reading the UNet layout";
    let u = |rest: &str| format!("{UNET}{rest}");
    let conv_in = keys.need_rank(&u("input_blocks.0.0.weight"), 4, WHY)?;
    let conv_out = keys.need_rank(&u("out.2.weight"), 4, WHY)?;

    // LDM numbers its input blocks 0 (conv_in), then per level `layers_per_block`
    // resnet slots and, except on the last level, one downsampler slot; so the
    // first downsampler's index is `layers_per_block + 1` and there are
    // `levels * (layers_per_block + 1)` input and output slots.
    let n_in = keys.count(&u("input_blocks."))?;
    let n_out = keys.count(&u("output_blocks."))?;
    let ops: Vec<usize> = (0..n_in)
        .filter(|i| {
            keys.get(&u(&format!("input_blocks.{i}.0.op.weight")))
                .is_some()
        })
        .collect();
    let (levels, per) = match ops.first() {
        Some(&first) => (ops.len() + 1, first),
        None => (1, n_in),
    };
    let expected_ops: Vec<usize> = (1..levels).map(|l| l * per).collect();
    if per < 2 || n_in != levels * per || n_out != n_in || ops != expected_ops {
        return Err(LdmError::Unsupported(format!(
            "UNet block numbering: {n_in} input blocks, {n_out} output blocks, \
             downsamplers at {ops:?}"
        )));
    }
    let layers_per_block = per - 1;

    // Attention sits at `.1` of a resnet slot (`.1.conv` is an upsampler).
    let attn_at = |slot: &str| keys.has_prefix(&u(&format!("{slot}.1.transformer_blocks.")));
    let mut block_out_channels = Vec::with_capacity(levels);
    let mut down_attention = Vec::with_capacity(levels);
    for l in 0..levels {
        let first = 1 + l * per;
        let w = keys.need_rank(
            &u(&format!("input_blocks.{first}.0.out_layers.3.weight")),
            4,
            WHY,
        )?;
        block_out_channels.push(w[0]);
        let attn = attn_at(&format!("input_blocks.{first}"));
        if (1..layers_per_block).any(|j| attn_at(&format!("input_blocks.{}", first + j)) != attn) {
            return Err(LdmError::Unsupported(format!(
                "UNet level {l} has attention on some resnets only"
            )));
        }
        down_attention.push(attn);
    }
    let mut up_attention = Vec::with_capacity(levels);
    for i in 0..levels {
        let attn = attn_at(&format!("output_blocks.{}", i * per));
        if (1..per).any(|j| attn_at(&format!("output_blocks.{}", i * per + j)) != attn) {
            return Err(LdmError::Unsupported(format!(
                "UNet up block {i} has attention on some resnets only"
            )));
        }
        up_attention.push(attn);
    }
    if conv_in[0] != block_out_channels[0] {
        return Err(LdmError::Unsupported(format!(
            "UNet conv_in has {} channels but the first level {}",
            conv_in[0], block_out_channels[0]
        )));
    }

    let has_mid_attention = attn_at("middle_block");
    let depth = |slot: String| keys.count(&u(&format!("{slot}.1.transformer_blocks.")));
    let mid_depth = if has_mid_attention {
        depth("middle_block".into())?
    } else {
        1
    };
    let transformer_layers = down_attention
        .iter()
        .enumerate()
        .map(|(l, &attn)| {
            if attn {
                depth(format!("input_blocks.{}", 1 + l * per))
            } else {
                Ok(mid_depth)
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    if has_mid_attention && transformer_layers[levels - 1] != mid_depth {
        return Err(LdmError::Unsupported(format!(
            "UNet middle block has {mid_depth} transformer layers but the last level {}",
            transformer_layers[levels - 1]
        )));
    }

    // Any transformer tells the cross-attention width and projection kind.
    let first_attn = (0..levels)
        .filter(|&l| down_attention[l])
        .map(|l| format!("input_blocks.{}", 1 + l * per))
        .chain(has_mid_attention.then(|| "middle_block".to_string()))
        .next()
        .ok_or_else(|| LdmError::Unsupported("UNet has no cross-attention".into()))?;
    let to_k = u(&format!(
        "{first_attn}.1.transformer_blocks.0.attn2.to_k.weight"
    ));
    let cross_attention_dim = keys.need_rank(&to_k, 2, WHY)?[1];
    let proj_in = u(&format!("{first_attn}.1.proj_in.weight"));
    let use_linear_projection = match keys.need(&proj_in, WHY)?.len() {
        2 => true,
        4 => false,
        _ => {
            let shape = keys.need(&proj_in, WHY)?;
            return Err(bad_shape(
                &proj_in,
                shape,
                "expected a linear or 1x1 conv weight".into(),
            ));
        }
    };

    Ok(UnetFacts {
        in_channels: conv_in[1],
        out_channels: conv_out[0],
        block_out_channels,
        layers_per_block,
        down_attention,
        up_attention,
        has_mid_attention,
        cross_attention_dim,
        use_linear_projection,
        transformer_layers,
    })
}

struct VaeFacts {
    block_out_channels: Vec<usize>,
    layers_per_block: usize,
    latent_channels: usize,
}

fn infer_vae(keys: &Keys) -> Result<VaeFacts, LdmError> {
    const WHY: &str = "reading the VAE layout";
    let v = |rest: &str| format!("{VAE}{rest}");
    let conv_in = keys.need_rank(&v("encoder.conv_in.weight"), 4, WHY)?;
    let levels = keys.count(&v("encoder.down."))?;
    if levels == 0 {
        return Err(LdmError::Missing {
            name: v("encoder.down.0.block.0.conv1.weight"),
            needed_for: WHY.into(),
        });
    }
    let block_out_channels = (0..levels)
        .map(|l| {
            Ok(keys.need_rank(
                &v(&format!("encoder.down.{l}.block.0.conv1.weight")),
                4,
                WHY,
            )?[0])
        })
        .collect::<Result<Vec<_>, LdmError>>()?;
    let layers_per_block = keys.count(&v("encoder.down.0.block."))?;
    let latent_channels = keys.need_rank(&v("decoder.conv_in.weight"), 4, WHY)?[1];
    if conv_in[0] != block_out_channels[0] {
        return Err(LdmError::Unsupported(format!(
            "VAE conv_in has {} channels but the first level {}",
            conv_in[0], block_out_channels[0]
        )));
    }
    Ok(VaeFacts {
        block_out_channels,
        layers_per_block,
        latent_channels,
    })
}

struct TextFacts {
    hidden: usize,
    layers: usize,
    intermediate: usize,
    vocab: usize,
    positions: usize,
}

/// Where an SD1 checkpoint keeps its CLIP: with or without the `text_model.` level.
fn sd1_text_prefix(keys: &Keys) -> String {
    let nested = format!("{SD1_TEXT}{TEXT}");
    if keys.has_prefix(&nested) {
        nested
    } else {
        SD1_TEXT.to_string()
    }
}

fn infer_clip(keys: &Keys) -> Result<TextFacts, LdmError> {
    const WHY: &str = "reading the SD1 text encoder layout";
    let p = sd1_text_prefix(keys);
    let tok = keys.need_rank(&format!("{p}embeddings.token_embedding.weight"), 2, WHY)?;
    let pos = keys.need_rank(&format!("{p}embeddings.position_embedding.weight"), 2, WHY)?;
    let layers = keys.count(&format!("{p}encoder.layers."))?;
    let fc1 = keys.need_rank(&format!("{p}encoder.layers.0.mlp.fc1.weight"), 2, WHY)?;
    Ok(TextFacts {
        hidden: tok[1],
        layers,
        intermediate: fc1[0],
        vocab: tok[0],
        positions: pos[0],
    })
}

fn infer_open_clip(keys: &Keys) -> Result<TextFacts, LdmError> {
    const WHY: &str = "reading the SD2 text encoder layout";
    let p = SD2_TEXT;
    let tok = keys.need_rank(&format!("{p}token_embedding.weight"), 2, WHY)?;
    let pos = keys.need_rank(&format!("{p}positional_embedding"), 2, WHY)?;
    let resblocks = keys.count(&format!("{p}transformer.resblocks."))?;
    if resblocks < 2 {
        return Err(LdmError::Unsupported(format!(
            "SD2 text encoder has {resblocks} resblocks; need at least 2 (the last is unused)"
        )));
    }
    let c_fc = keys.need_rank(
        &format!("{p}transformer.resblocks.0.mlp.c_fc.weight"),
        2,
        WHY,
    )?;
    Ok(TextFacts {
        hidden: tok[1],
        layers: resblocks - 1,
        intermediate: c_fc[0],
        vocab: tok[0],
        positions: pos[0],
    })
}

// ------------------------------------------------------------------ mapping

/// Maps every tensor the three diffusers components need. Unknown keys that are
/// not known-ignorable are an error naming them.
pub fn map_keys(
    tensors: &[(String, Vec<usize>)],
    inferred: &LdmInferred,
) -> Result<Vec<LdmMapping>, LdmError> {
    let keys = Keys::new(tensors);
    let mut plan = Plan {
        keys: &keys,
        out: Vec::new(),
        used: HashSet::new(),
        unused_prefixes: Vec::new(),
    };
    plan_unet(&mut plan, inferred)?;
    plan_vae(&mut plan, inferred)?;
    match inferred.family {
        LdmFamily::Sd1 => plan_clip(&mut plan, inferred)?,
        LdmFamily::Sd2 => plan_open_clip(&mut plan, inferred)?,
    }
    let mut unknown: Vec<String> = tensors
        .iter()
        .map(|(name, _)| name)
        .filter(|name| {
            !plan.used.contains(name.as_str())
                && !is_ignorable(name)
                && !plan
                    .unused_prefixes
                    .iter()
                    .any(|p| name.starts_with(p.as_str()))
        })
        .cloned()
        .collect();
    if !unknown.is_empty() {
        unknown.sort();
        return Err(LdmError::Unknown { names: unknown });
    }
    Ok(plan.out)
}

struct Plan<'k, 'a> {
    keys: &'k Keys<'a>,
    out: Vec<LdmMapping>,
    /// Stored names some mapping reads.
    used: HashSet<String>,
    /// Stored names under these prefixes are expected and deliberately unused.
    unused_prefixes: Vec<String>,
}

impl Plan<'_, '_> {
    /// The stored shape of `source`, which `target` of `component` needs.
    fn shape(
        &self,
        component: Component,
        target: &str,
        source: &str,
    ) -> Result<Vec<usize>, LdmError> {
        self.keys
            .need(source, &format!("{} `{target}`", component.folder()))
            .map(<[usize]>::to_vec)
    }

    fn map(
        &mut self,
        component: Component,
        target: String,
        source: String,
        transform: Transform,
    ) -> Result<(), LdmError> {
        let shape = self.shape(component, &target, &source)?;
        if transform.output_shape(&shape).is_none() {
            return Err(bad_shape(
                &source,
                &shape,
                format!("cannot apply {transform:?} for `{target}`"),
            ));
        }
        self.used.insert(source.clone());
        self.out.push(LdmMapping {
            component,
            target,
            source,
            transform,
        });
        Ok(())
    }

    /// `{target}.weight` and `{target}.bias` from `{source}.weight` / `.bias`, as stored.
    fn weight_bias(
        &mut self,
        component: Component,
        target: &str,
        source: &str,
    ) -> Result<(), LdmError> {
        self.map(
            component,
            format!("{target}.weight"),
            format!("{source}.weight"),
            Transform::Identity,
        )?;
        self.map(
            component,
            format!("{target}.bias"),
            format!("{source}.bias"),
            Transform::Identity,
        )
    }
}

// UNet --------------------------------------------------------------------

fn plan_unet(p: &mut Plan, inf: &LdmInferred) -> Result<(), LdmError> {
    let boc = &inf.unet_block_out_channels;
    let levels = boc.len();
    let nrb = inf.unet_layers_per_block;
    let per = nrb + 1;
    let depth = &inf.unet_transformer_layers;
    if levels == 0
        || inf.unet_down_attention.len() != levels
        || inf.unet_up_attention.len() != levels
        || depth.len() != levels
    {
        return Err(LdmError::Unsupported(
            "UNet description has inconsistent block counts".into(),
        ));
    }
    if !inf.unet_has_mid_attention {
        return Err(LdmError::Unsupported(
            "UNet middle block without attention (diffusers' UNet2DConditionModel has none)".into(),
        ));
    }
    let c = Component::Unet;
    let u = |rest: String| format!("{UNET}{rest}");

    p.weight_bias(c, "conv_in", &u("input_blocks.0.0".into()))?;
    p.weight_bias(c, "time_embedding.linear_1", &u("time_embed.0".into()))?;
    p.weight_bias(c, "time_embedding.linear_2", &u("time_embed.2".into()))?;

    for b in 0..levels {
        for j in 0..nrb {
            let slot = 1 + b * per + j;
            let in_ch = match (b, j) {
                (0, 0) => boc[0],
                (_, 0) => boc[b - 1],
                _ => boc[b],
            };
            let src = u(format!("input_blocks.{slot}"));
            unet_resnet(
                p,
                &format!("down_blocks.{b}.resnets.{j}"),
                &format!("{src}.0"),
                in_ch != boc[b],
            )?;
            if inf.unet_down_attention[b] {
                unet_transformer(
                    p,
                    &format!("down_blocks.{b}.attentions.{j}"),
                    &format!("{src}.1"),
                    depth[b],
                )?;
            }
        }
        if b + 1 < levels {
            let src = u(format!("input_blocks.{}.0.op", (b + 1) * per));
            p.weight_bias(c, &format!("down_blocks.{b}.downsamplers.0.conv"), &src)?;
        }
    }

    // The middle block keeps the last level's width: no shortcut convolutions.
    unet_resnet(p, "mid_block.resnets.0", &u("middle_block.0".into()), false)?;
    unet_transformer(
        p,
        "mid_block.attentions.0",
        &u("middle_block.1".into()),
        depth[levels - 1],
    )?;
    unet_resnet(p, "mid_block.resnets.1", &u("middle_block.2".into()), false)?;

    // Up block i works at level `levels - 1 - i`. Each resnet takes the previous
    // output concatenated with a skip from the down path; its width changes, so
    // every one has a shortcut convolution (computed, not assumed).
    let rev: Vec<usize> = boc.iter().rev().copied().collect();
    for i in 0..levels {
        let level = levels - 1 - i;
        let out_ch = rev[i];
        let prev = if i == 0 { boc[levels - 1] } else { rev[i - 1] };
        for j in 0..per {
            let slot = i * per + j;
            let skip = if j == nrb {
                rev[(i + 1).min(levels - 1)]
            } else {
                out_ch
            };
            let in_ch = if j == 0 { prev } else { out_ch } + skip;
            let src = u(format!("output_blocks.{slot}"));
            unet_resnet(
                p,
                &format!("up_blocks.{i}.resnets.{j}"),
                &format!("{src}.0"),
                in_ch != out_ch,
            )?;
            if inf.unet_up_attention[i] {
                unet_transformer(
                    p,
                    &format!("up_blocks.{i}.attentions.{j}"),
                    &format!("{src}.1"),
                    depth[level],
                )?;
            }
        }
        if i + 1 < levels {
            let sub = if inf.unet_up_attention[i] { 2 } else { 1 };
            let src = u(format!("output_blocks.{}.{sub}.conv", i * per + nrb));
            p.weight_bias(c, &format!("up_blocks.{i}.upsamplers.0.conv"), &src)?;
        }
    }

    p.weight_bias(c, "conv_norm_out", &u("out.0".into()))?;
    p.weight_bias(c, "conv_out", &u("out.2".into()))
}

fn unet_resnet(p: &mut Plan, target: &str, source: &str, shortcut: bool) -> Result<(), LdmError> {
    const PARTS: [(&str, &str); 5] = [
        ("norm1", "in_layers.0"),
        ("conv1", "in_layers.2"),
        ("time_emb_proj", "emb_layers.1"),
        ("norm2", "out_layers.0"),
        ("conv2", "out_layers.3"),
    ];
    for (t, s) in PARTS {
        p.weight_bias(
            Component::Unet,
            &format!("{target}.{t}"),
            &format!("{source}.{s}"),
        )?;
    }
    if shortcut {
        p.weight_bias(
            Component::Unet,
            &format!("{target}.conv_shortcut"),
            &format!("{source}.skip_connection"),
        )?;
    }
    Ok(())
}

/// A SpatialTransformer: diffusers' Transformer2DModel uses the same names.
fn unet_transformer(
    p: &mut Plan,
    target: &str,
    source: &str,
    layers: usize,
) -> Result<(), LdmError> {
    let c = Component::Unet;
    let same = |p: &mut Plan, part: &str| {
        p.weight_bias(c, &format!("{target}.{part}"), &format!("{source}.{part}"))
    };
    same(p, "norm")?;
    same(p, "proj_in")?;
    for k in 0..layers {
        let block = format!("transformer_blocks.{k}");
        for part in [
            "norm1",
            "norm2",
            "norm3",
            "attn1.to_out.0",
            "attn2.to_out.0",
            "ff.net.0.proj",
            "ff.net.2",
        ] {
            same(p, &format!("{block}.{part}"))?;
        }
        for attn in ["attn1", "attn2"] {
            for proj in ["to_q", "to_k", "to_v"] {
                let name = format!("{block}.{attn}.{proj}.weight");
                p.map(
                    c,
                    format!("{target}.{name}"),
                    format!("{source}.{name}"),
                    Transform::Identity,
                )?;
            }
        }
    }
    same(p, "proj_out")
}

// VAE ---------------------------------------------------------------------

fn plan_vae(p: &mut Plan, inf: &LdmInferred) -> Result<(), LdmError> {
    let boc = &inf.vae_block_out_channels;
    let levels = boc.len();
    let nrb = inf.vae_layers_per_block;
    if levels == 0 {
        return Err(LdmError::Unsupported(
            "VAE description has no blocks".into(),
        ));
    }
    let c = Component::Vae;
    let v = |rest: &str| format!("{VAE}{rest}");

    p.weight_bias(c, "encoder.conv_in", &v("encoder.conv_in"))?;
    for l in 0..levels {
        for j in 0..nrb {
            let in_ch = match (l, j) {
                (0, 0) => boc[0],
                (_, 0) => boc[l - 1],
                _ => boc[l],
            };
            vae_resnet(
                p,
                &format!("encoder.down_blocks.{l}.resnets.{j}"),
                &v(&format!("encoder.down.{l}.block.{j}")),
                in_ch != boc[l],
            )?;
        }
        if l + 1 < levels {
            p.weight_bias(
                c,
                &format!("encoder.down_blocks.{l}.downsamplers.0.conv"),
                &v(&format!("encoder.down.{l}.downsample.conv")),
            )?;
        }
    }
    vae_mid(p, "encoder")?;
    p.weight_bias(c, "encoder.conv_norm_out", &v("encoder.norm_out"))?;
    p.weight_bias(c, "encoder.conv_out", &v("encoder.conv_out"))?;
    p.weight_bias(c, "quant_conv", &v("quant_conv"))?;
    p.weight_bias(c, "post_quant_conv", &v("post_quant_conv"))?;

    p.weight_bias(c, "decoder.conv_in", &v("decoder.conv_in"))?;
    vae_mid(p, "decoder")?;
    // LDM numbers decoder levels from the output side; diffusers from the latent.
    for k in 0..levels {
        let level = levels - 1 - k;
        let out_ch = boc[level];
        let prev = boc[(levels - k).min(levels - 1)];
        for j in 0..=nrb {
            let in_ch = if j == 0 { prev } else { out_ch };
            vae_resnet(
                p,
                &format!("decoder.up_blocks.{k}.resnets.{j}"),
                &v(&format!("decoder.up.{level}.block.{j}")),
                in_ch != out_ch,
            )?;
        }
        if k + 1 < levels {
            p.weight_bias(
                c,
                &format!("decoder.up_blocks.{k}.upsamplers.0.conv"),
                &v(&format!("decoder.up.{level}.upsample.conv")),
            )?;
        }
    }
    p.weight_bias(c, "decoder.conv_norm_out", &v("decoder.norm_out"))?;
    p.weight_bias(c, "decoder.conv_out", &v("decoder.conv_out"))
}

fn vae_resnet(p: &mut Plan, target: &str, source: &str, shortcut: bool) -> Result<(), LdmError> {
    for part in ["norm1", "conv1", "norm2", "conv2"] {
        p.weight_bias(
            Component::Vae,
            &format!("{target}.{part}"),
            &format!("{source}.{part}"),
        )?;
    }
    if shortcut {
        p.weight_bias(
            Component::Vae,
            &format!("{target}.conv_shortcut"),
            &format!("{source}.nin_shortcut"),
        )?;
    }
    Ok(())
}

fn vae_mid(p: &mut Plan, side: &str) -> Result<(), LdmError> {
    let c = Component::Vae;
    let target = format!("{side}.mid_block");
    let source = format!("{VAE}{side}.mid");
    vae_resnet(
        p,
        &format!("{target}.resnets.0"),
        &format!("{source}.block_1"),
        false,
    )?;
    vae_resnet(
        p,
        &format!("{target}.resnets.1"),
        &format!("{source}.block_2"),
        false,
    )?;

    let attn_t = format!("{target}.attentions.0");
    let attn_s = format!("{source}.attn_1");
    p.weight_bias(
        c,
        &format!("{attn_t}.group_norm"),
        &format!("{attn_s}.norm"),
    )?;
    for (t, s) in [
        ("to_q", "q"),
        ("to_k", "k"),
        ("to_v", "v"),
        ("to_out.0", "proj_out"),
    ] {
        let target = format!("{attn_t}.{t}.weight");
        let source = format!("{attn_s}.{s}.weight");
        // LDM stores these projections as 1x1 convolutions [C, C, 1, 1].
        let shape = p.shape(c, &target, &source)?;
        let transform = match shape.as_slice() {
            [_, _] => Transform::Identity,
            [o, i, rest @ ..] if !rest.is_empty() && rest.iter().all(|&d| d == 1) => {
                Transform::Reshape(vec![*o, *i])
            }
            _ => {
                return Err(bad_shape(
                    &source,
                    &shape,
                    format!("expected a 1x1 conv or linear weight for `{target}`"),
                ))
            }
        };
        p.map(c, target, source, transform)?;
        p.map(
            c,
            format!("{attn_t}.{t}.bias"),
            format!("{attn_s}.{s}.bias"),
            Transform::Identity,
        )?;
    }
    Ok(())
}

// Text encoders -----------------------------------------------------------

/// The CLIP encoder-layer parts, transformers names.
const CLIP_LAYER_PARTS: [&str; 8] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.out_proj",
    "layer_norm1",
    "mlp.fc1",
    "mlp.fc2",
    "layer_norm2",
];

fn plan_clip(p: &mut Plan, inf: &LdmInferred) -> Result<(), LdmError> {
    let c = Component::TextEncoder;
    let src = sd1_text_prefix(p.keys);
    for emb in [
        "embeddings.token_embedding.weight",
        "embeddings.position_embedding.weight",
    ] {
        p.map(
            c,
            format!("{TEXT}{emb}"),
            format!("{src}{emb}"),
            Transform::Identity,
        )?;
    }
    for i in 0..inf.text_layers {
        for part in CLIP_LAYER_PARTS {
            let name = format!("encoder.layers.{i}.{part}");
            p.weight_bias(c, &format!("{TEXT}{name}"), &format!("{src}{name}"))?;
        }
    }
    p.weight_bias(
        c,
        &format!("{TEXT}final_layer_norm"),
        &format!("{src}final_layer_norm"),
    )
}

fn plan_open_clip(p: &mut Plan, inf: &LdmInferred) -> Result<(), LdmError> {
    let c = Component::TextEncoder;
    let d = inf.text_hidden_size;
    p.map(
        c,
        format!("{TEXT}embeddings.token_embedding.weight"),
        format!("{SD2_TEXT}token_embedding.weight"),
        Transform::Identity,
    )?;
    p.map(
        c,
        format!("{TEXT}embeddings.position_embedding.weight"),
        format!("{SD2_TEXT}positional_embedding"),
        Transform::Identity,
    )?;
    for i in 0..inf.text_layers {
        let t = format!("{TEXT}encoder.layers.{i}");
        let s = format!("{SD2_TEXT}transformer.resblocks.{i}");
        // q, k, v are rows 0..d, d..2d, 2d..3d of the fused projection.
        for (leaf, want) in [("weight", vec![3 * d, d]), ("bias", vec![3 * d])] {
            let source = format!("{s}.attn.in_proj_{leaf}");
            let shape = p.shape(c, &format!("{t}.self_attn.q_proj.{leaf}"), &source)?;
            if shape != want {
                return Err(bad_shape(
                    &source,
                    &shape,
                    format!("expected {want:?} (fused q, k, v of width {d})"),
                ));
            }
            for (k, proj) in ["q_proj", "k_proj", "v_proj"].into_iter().enumerate() {
                let rows = Transform::Rows {
                    start: k * d,
                    len: d,
                };
                p.map(
                    c,
                    format!("{t}.self_attn.{proj}.{leaf}"),
                    source.clone(),
                    rows,
                )?;
            }
        }
        for (to, from) in [
            ("self_attn.out_proj", "attn.out_proj"),
            ("layer_norm1", "ln_1"),
            ("layer_norm2", "ln_2"),
            ("mlp.fc1", "mlp.c_fc"),
            ("mlp.fc2", "mlp.c_proj"),
        ] {
            p.weight_bias(c, &format!("{t}.{to}"), &format!("{s}.{from}"))?;
        }
    }
    p.weight_bias(
        c,
        &format!("{TEXT}final_layer_norm"),
        &format!("{SD2_TEXT}ln_final"),
    )?;
    // SD2 conditions on the penultimate layer: the final resblock is never run.
    p.unused_prefixes.push(format!(
        "{SD2_TEXT}transformer.resblocks.{}.",
        inf.text_layers
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/ldm");

    type Tensors = Vec<(String, Vec<usize>)>;

    /// Names and shapes from a safetensors header: 8-byte little-endian length, then JSON.
    fn read_header(path: &str) -> Tensors {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
        let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
        let mut out: Tensors = header
            .as_object()
            .unwrap()
            .iter()
            .filter(|(name, _)| name.as_str() != "__metadata__")
            .map(|(name, info)| {
                let shape = info["shape"].as_array().unwrap();
                (
                    name.clone(),
                    shape.iter().map(|d| d.as_u64().unwrap() as usize).collect(),
                )
            })
            .collect();
        out.sort();
        out
    }

    struct Fixture {
        tensors: Tensors,
        expected: serde_json::Value,
    }

    fn fixture(name: &str) -> Fixture {
        let dir = format!("{FIXTURES}/{name}");
        let tensors = read_header(&format!("{dir}/model.safetensors"));
        let text = std::fs::read_to_string(format!("{dir}/expected.json")).unwrap();
        Fixture {
            tensors,
            expected: serde_json::from_str(&text).unwrap(),
        }
    }

    fn component(name: &str) -> Component {
        match name {
            "unet" => Component::Unet,
            "vae" => Component::Vae,
            "text_encoder" => Component::TextEncoder,
            other => panic!("unknown component {other}"),
        }
    }

    fn expected_targets(f: &Fixture) -> BTreeMap<(Component, String), Vec<usize>> {
        let mut out = BTreeMap::new();
        for (comp, tensors) in f.expected["components"].as_object().unwrap() {
            for (name, shape) in tensors.as_object().unwrap() {
                let shape = shape
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap() as usize)
                    .collect();
                out.insert((component(comp), name.clone()), shape);
            }
        }
        out
    }

    fn check_inferred(inf: &LdmInferred, want: &serde_json::Value) {
        let n = |k: &str| want[k].as_u64().unwrap() as usize;
        let nv = |k: &str| -> Vec<usize> {
            want[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect()
        };
        let bv = |k: &str| -> Vec<bool> {
            want[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_bool().unwrap())
                .collect()
        };
        let family = match want["family"].as_str().unwrap() {
            "sd1" => LdmFamily::Sd1,
            "sd2" => LdmFamily::Sd2,
            other => panic!("family {other}"),
        };
        let expected = LdmInferred {
            family,
            unet_in_channels: n("unet_in_channels"),
            unet_out_channels: n("unet_out_channels"),
            unet_block_out_channels: nv("unet_block_out_channels"),
            unet_layers_per_block: n("unet_layers_per_block"),
            unet_down_attention: bv("unet_down_attention"),
            unet_up_attention: bv("unet_up_attention"),
            unet_has_mid_attention: want["unet_has_mid_attention"].as_bool().unwrap(),
            unet_cross_attention_dim: n("unet_cross_attention_dim"),
            unet_use_linear_projection: want["unet_use_linear_projection"].as_bool().unwrap(),
            unet_transformer_layers: nv("unet_transformer_layers"),
            vae_block_out_channels: nv("vae_block_out_channels"),
            vae_layers_per_block: n("vae_layers_per_block"),
            vae_latent_channels: n("vae_latent_channels"),
            text_hidden_size: n("text_hidden_size"),
            text_layers: n("text_layers"),
            text_intermediate_size: n("text_intermediate_size"),
            text_vocab_size: n("text_vocab_size"),
            text_max_positions: n("text_max_positions"),
        };
        assert_eq!(inf, &expected);
    }

    /// is_ldm, infer and map_keys reproduce expected.json exactly: the same
    /// (component, name) set, and every transform yields the expected shape.
    fn check_fixture(name: &str, tensors: &Tensors, f: &Fixture) -> Vec<LdmMapping> {
        assert!(is_ldm(tensors), "{name}: not recognised as LDM");
        let inf = infer(tensors).unwrap_or_else(|e| panic!("{name}: infer: {e}"));
        check_inferred(&inf, &f.expected["inferred"]);
        let maps = map_keys(tensors, &inf).unwrap_or_else(|e| panic!("{name}: map_keys: {e}"));

        let want = expected_targets(f);
        let stored: BTreeMap<&str, &Vec<usize>> =
            tensors.iter().map(|(n, s)| (n.as_str(), s)).collect();
        let mut got = BTreeMap::new();
        for m in &maps {
            let shape = m.transform.output_shape(stored[m.source.as_str()]).unwrap();
            let dup = got.insert((m.component, m.target.clone()), shape);
            assert!(dup.is_none(), "{name}: {} produced twice", m.target);
        }
        let want_keys: BTreeSet<_> = want.keys().collect();
        let got_keys: BTreeSet<_> = got.keys().collect();
        let missing: Vec<_> = want_keys.difference(&got_keys).collect();
        let extra: Vec<_> = got_keys.difference(&want_keys).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "{name}: missing {missing:?}, extra {extra:?}"
        );
        for (key, shape) in &want {
            assert_eq!(&got[key], shape, "{name}: shape of {key:?}");
        }
        maps
    }

    fn find<'m>(maps: &'m [LdmMapping], target: &str) -> &'m LdmMapping {
        maps.iter()
            .find(|m| m.target == target)
            .unwrap_or_else(|| panic!("no mapping for {target}"))
    }

    #[test]
    fn sd1_fixture_maps_exactly() {
        let f = fixture("sd1_tiny");
        let maps = check_fixture("sd1_tiny", &f.tensors, &f);
        assert_eq!(maps.len(), 494 + 244 + 36);
        let m = find(&maps, "up_blocks.0.upsamplers.0.conv.weight");
        assert_eq!(
            m.source,
            "model.diffusion_model.output_blocks.2.1.conv.weight"
        );
        let m = find(&maps, "up_blocks.1.upsamplers.0.conv.weight");
        assert_eq!(
            m.source,
            "model.diffusion_model.output_blocks.5.2.conv.weight"
        );
        let m = find(&maps, "down_blocks.1.downsamplers.0.conv.weight");
        assert_eq!(m.source, "model.diffusion_model.input_blocks.6.0.op.weight");
        let m = find(&maps, "decoder.up_blocks.0.resnets.2.conv1.weight");
        assert_eq!(
            m.source,
            "first_stage_model.decoder.up.3.block.2.conv1.weight"
        );
        let m = find(&maps, "encoder.mid_block.attentions.0.to_out.0.weight");
        assert_eq!(
            m.source,
            "first_stage_model.encoder.mid.attn_1.proj_out.weight"
        );
        assert_eq!(m.transform, Transform::Reshape(vec![16, 16]));
        let m = find(&maps, "text_model.encoder.layers.1.mlp.fc2.weight");
        assert_eq!(
            m.source,
            "cond_stage_model.transformer.text_model.encoder.layers.1.mlp.fc2.weight"
        );
    }

    #[test]
    fn sd2_fixture_maps_exactly() {
        let f = fixture("sd2_tiny");
        let maps = check_fixture("sd2_tiny", &f.tensors, &f);
        assert_eq!(maps.len(), 614 + 180 + 52);
        // The middle level has no attention: its upsampler is at `.1.conv`.
        let m = find(&maps, "up_blocks.1.upsamplers.0.conv.weight");
        assert_eq!(
            m.source,
            "model.diffusion_model.output_blocks.5.1.conv.weight"
        );
        let m = find(&maps, "up_blocks.0.upsamplers.0.conv.bias");
        assert_eq!(
            m.source,
            "model.diffusion_model.output_blocks.2.2.conv.bias"
        );
        let m = find(
            &maps,
            "mid_block.attentions.0.transformer_blocks.1.attn2.to_k.weight",
        );
        assert_eq!(
            m.source,
            "model.diffusion_model.middle_block.1.transformer_blocks.1.attn2.to_k.weight"
        );
        for (k, proj) in ["q_proj", "k_proj", "v_proj"].into_iter().enumerate() {
            let m = find(
                &maps,
                &format!("text_model.encoder.layers.2.self_attn.{proj}.weight"),
            );
            assert_eq!(
                m.source,
                "cond_stage_model.model.transformer.resblocks.2.attn.in_proj_weight"
            );
            assert_eq!(
                m.transform,
                Transform::Rows {
                    start: 32 * k,
                    len: 32
                }
            );
            let m = find(
                &maps,
                &format!("text_model.encoder.layers.0.self_attn.{proj}.bias"),
            );
            assert_eq!(
                m.source,
                "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_bias"
            );
            assert_eq!(
                m.transform,
                Transform::Rows {
                    start: 32 * k,
                    len: 32
                }
            );
        }
        let m = find(&maps, "text_model.embeddings.position_embedding.weight");
        assert_eq!(m.source, "cond_stage_model.model.positional_embedding");
        // The final resblock (3) is stored but never mapped.
        assert!(f
            .tensors
            .iter()
            .any(|(n, _)| n.starts_with("cond_stage_model.model.transformer.resblocks.3.")));
        assert!(!maps.iter().any(|m| m.source.contains("resblocks.3.")));
    }

    #[test]
    fn sd1_without_text_model_level() {
        // Older SD1 files store CLIP as `cond_stage_model.transformer.embeddings...`.
        let f = fixture("sd1_tiny");
        let nested = "cond_stage_model.transformer.text_model.";
        let tensors: Tensors = f
            .tensors
            .iter()
            .map(|(n, s)| {
                (
                    n.replace(nested, "cond_stage_model.transformer."),
                    s.clone(),
                )
            })
            .collect();
        let maps = check_fixture("sd1_tiny (flat CLIP)", &tensors, &f);
        let m = find(&maps, "text_model.final_layer_norm.weight");
        assert_eq!(
            m.source,
            "cond_stage_model.transformer.final_layer_norm.weight"
        );
    }

    #[test]
    fn ignorable_keys_are_skipped() {
        let f = fixture("sd1_tiny");
        for name in [
            "alphas_cumprod",
            "betas",
            "model_ema.decay",
            "cond_stage_model.transformer.text_model.embeddings.position_ids",
        ] {
            assert!(
                f.tensors.iter().any(|(n, _)| n == name),
                "fixture lacks {name}"
            );
        }
        let mut tensors = f.tensors.clone();
        for extra in [
            "sqrt_alphas_cumprod",
            "posterior_variance",
            "model_ema.diffusion_modelout2weight",
        ] {
            tensors.push((extra.to_string(), vec![4]));
        }
        check_fixture("sd1_tiny (+buffers)", &tensors, &f);
        let g = fixture("sd2_tiny");
        for name in [
            "cond_stage_model.model.text_projection",
            "cond_stage_model.model.logit_scale",
        ] {
            assert!(
                g.tensors.iter().any(|(n, _)| n == name),
                "fixture lacks {name}"
            );
        }
    }

    #[test]
    fn missing_tensor_is_named() {
        let f = fixture("sd1_tiny");
        let inf = infer(&f.tensors).unwrap();
        let gone = "model.diffusion_model.output_blocks.4.0.skip_connection.weight";
        let tensors: Tensors = f
            .tensors
            .iter()
            .filter(|(n, _)| n != gone)
            .cloned()
            .collect();
        match map_keys(&tensors, &inf) {
            Err(LdmError::Missing { name, needed_for }) => {
                assert_eq!(name, gone);
                assert_eq!(
                    needed_for,
                    "unet `up_blocks.1.resnets.1.conv_shortcut.weight`"
                );
            }
            other => panic!("expected Missing, got {other:?}"),
        }
        let err = map_keys(&tensors, &inf).unwrap_err().to_string();
        assert!(err.contains(gone), "{err}");

        let g = fixture("sd2_tiny");
        let inf = infer(&g.tensors).unwrap();
        let gone = "first_stage_model.decoder.mid.attn_1.k.weight";
        let tensors: Tensors = g
            .tensors
            .iter()
            .filter(|(n, _)| n != gone)
            .cloned()
            .collect();
        match map_keys(&tensors, &inf) {
            Err(LdmError::Missing { name, needed_for }) => {
                assert_eq!(name, gone);
                assert_eq!(
                    needed_for,
                    "vae `decoder.mid_block.attentions.0.to_k.weight`"
                );
            }
            other => panic!("expected Missing, got {other:?}"),
        }
        // A tensor infer itself needs.
        let tensors: Tensors = g
            .tensors
            .iter()
            .filter(|(n, _)| n != "first_stage_model.decoder.conv_in.weight")
            .cloned()
            .collect();
        assert!(
            matches!(infer(&tensors), Err(LdmError::Missing { name, .. }) if name == "first_stage_model.decoder.conv_in.weight")
        );
    }

    #[test]
    fn unknown_tensors_are_named() {
        let f = fixture("sd2_tiny");
        let inf = infer(&f.tensors).unwrap();
        let mut tensors = f.tensors.clone();
        tensors.push((
            "model.diffusion_model.label_emb.0.0.weight".into(),
            vec![16, 8],
        ));
        tensors.push((
            "cond_stage_model.model.transformer.resblocks.4.ln_1.weight".into(),
            vec![32],
        ));
        tensors.push(("something_else".into(), vec![]));
        match map_keys(&tensors, &inf) {
            Err(e @ LdmError::Unknown { .. }) => {
                let LdmError::Unknown { names } = &e else {
                    unreachable!()
                };
                assert_eq!(
                    names,
                    &[
                        "cond_stage_model.model.transformer.resblocks.4.ln_1.weight",
                        "model.diffusion_model.label_emb.0.0.weight",
                        "something_else",
                    ]
                );
                let msg = e.to_string();
                assert!(
                    msg.contains("`model.diffusion_model.label_emb.0.0.weight`"),
                    "{msg}"
                );
            }
            other => panic!("expected Unknown, got {other:?}"),
        }
    }

    #[test]
    fn bad_fused_projection_shape() {
        let f = fixture("sd2_tiny");
        let inf = infer(&f.tensors).unwrap();
        let name = "cond_stage_model.model.transformer.resblocks.1.attn.in_proj_weight";
        let tensors: Tensors = f
            .tensors
            .iter()
            .map(|(n, s)| {
                if n == name {
                    (n.clone(), vec![95, 32])
                } else {
                    (n.clone(), s.clone())
                }
            })
            .collect();
        match map_keys(&tensors, &inf) {
            Err(LdmError::BadShape { name: n, shape, .. }) => {
                assert_eq!(n, name);
                assert_eq!(shape, vec![95, 32]);
            }
            other => panic!("expected BadShape, got {other:?}"),
        }
    }

    #[test]
    fn not_ldm_and_text_tower_detection() {
        let diffusers_like: Tensors = vec![("conv_in.weight".into(), vec![8, 4, 3, 3])];
        assert!(!is_ldm(&diffusers_like));
        assert!(matches!(infer(&diffusers_like), Err(LdmError::NotLdm)));

        let f = fixture("sd1_tiny");
        let no_text: Tensors = f
            .tensors
            .iter()
            .filter(|(n, _)| !n.starts_with("cond_stage_model."))
            .cloned()
            .collect();
        assert!(matches!(infer(&no_text), Err(LdmError::NoTextEncoder)));
        let mut both = f.tensors.clone();
        both.push((
            "cond_stage_model.model.token_embedding.weight".into(),
            vec![64, 32],
        ));
        assert!(matches!(infer(&both), Err(LdmError::AmbiguousTextEncoder)));
    }

    #[test]
    fn unknown_list_is_abbreviated() {
        let names: Vec<String> = (0..12).map(|i| format!("x{i}")).collect();
        let msg = LdmError::Unknown { names }.to_string();
        assert!(
            msg.starts_with("LDM checkpoint has 12 tensor(s) brume does not know: `x0`, `x1`"),
            "{msg}"
        );
        assert!(msg.ends_with("`x9` and 2 more"), "{msg}");
    }
}
