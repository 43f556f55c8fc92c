//! The VAE half of the LDM layout: `first_stage_model.*` read as diffusers'
//! `AutoencoderKL`. The decoder's levels run in the opposite order, and the mid
//! block's attention is stored as 1x1 convolutions that diffusers keeps as linears.

use super::{bad_shape, Keys, LdmError, LdmInferred, Plan, VAE};
use crate::loading::segment::Component;
use crate::loading::transform::Transform;

pub(super) struct VaeFacts {
    pub(super) block_out_channels: Vec<usize>,
    pub(super) layers_per_block: usize,
    pub(super) latent_channels: usize,
}

pub(super) fn infer_vae(keys: &Keys) -> Result<VaeFacts, LdmError> {
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

pub(super) fn plan_vae(p: &mut Plan, inf: &LdmInferred) -> Result<(), LdmError> {
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
