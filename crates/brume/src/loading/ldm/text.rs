//! The text tower of the LDM layout, read as transformers' `CLIPTextModel`:
//! SD1's OpenAI CLIP is already in that layout (give or take the `text_model.`
//! level); SD2's OpenCLIP needs renaming, its fused q/k/v split, and its final
//! resblock left out.

use super::{bad_shape, Keys, LdmError, LdmInferred, Plan, SD1_TEXT, SD2_TEXT, TEXT};
use crate::loading::segment::Component;
use crate::loading::transform::Transform;

pub(super) struct TextFacts {
    pub(super) hidden: usize,
    pub(super) layers: usize,
    pub(super) intermediate: usize,
    pub(super) vocab: usize,
    pub(super) positions: usize,
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

pub(super) fn infer_clip(keys: &Keys) -> Result<TextFacts, LdmError> {
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

pub(super) fn infer_open_clip(keys: &Keys) -> Result<TextFacts, LdmError> {
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

pub(super) fn plan_clip(p: &mut Plan, inf: &LdmInferred) -> Result<(), LdmError> {
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

pub(super) fn plan_open_clip(p: &mut Plan, inf: &LdmInferred) -> Result<(), LdmError> {
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
