//! The UNet half of the LDM layout: `model.diffusion_model.*` read as diffusers'
//! `UNet2DConditionModel`. LDM numbers blocks by flat slot, so the block layout
//! (levels, resnets per level, where attention sits) is recovered from which
//! slots exist; see the parent module for the slot arithmetic.

use super::{bad_shape, Keys, LdmError, LdmInferred, Plan, UNET};
use crate::loading::segment::Component;
use crate::loading::transform::Transform;

pub(super) struct UnetFacts {
    pub(super) in_channels: usize,
    pub(super) out_channels: usize,
    pub(super) block_out_channels: Vec<usize>,
    pub(super) layers_per_block: usize,
    pub(super) down_attention: Vec<bool>,
    pub(super) up_attention: Vec<bool>,
    pub(super) has_mid_attention: bool,
    pub(super) cross_attention_dim: usize,
    pub(super) use_linear_projection: bool,
    pub(super) transformer_layers: Vec<usize>,
}

pub(super) fn infer_unet(keys: &Keys) -> Result<UnetFacts, LdmError> {
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

pub(super) fn plan_unet(p: &mut Plan, inf: &LdmInferred) -> Result<(), LdmError> {
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
