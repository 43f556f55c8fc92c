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

mod text;
mod unet;
mod vae;

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
    let unet = unet::infer_unet(&keys)?;
    let vae = vae::infer_vae(&keys)?;
    let text = match family {
        LdmFamily::Sd1 => text::infer_clip(&keys)?,
        LdmFamily::Sd2 => text::infer_open_clip(&keys)?,
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
    unet::plan_unet(&mut plan, inferred)?;
    vae::plan_vae(&mut plan, inferred)?;
    match inferred.family {
        LdmFamily::Sd1 => text::plan_clip(&mut plan, inferred)?,
        LdmFamily::Sd2 => text::plan_open_clip(&mut plan, inferred)?,
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

#[cfg(test)]
mod tests;
