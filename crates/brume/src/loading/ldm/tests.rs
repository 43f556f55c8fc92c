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

/// The stored tensors less the one named `gone`.
fn without(tensors: &Tensors, gone: &str) -> Tensors {
    tensors.iter().filter(|(n, _)| n != gone).cloned().collect()
}

/// With `gone` removed from fixture `name`, map_keys (given the full file's
/// inferred layout) fails with `Missing` naming it and what needed it, and the
/// message names it too.
fn assert_map_missing(name: &str, gone: &str, needed_for: &str) {
    let f = fixture(name);
    let inf = infer(&f.tensors).unwrap();
    let tensors = without(&f.tensors, gone);
    match map_keys(&tensors, &inf) {
        Err(e @ LdmError::Missing { .. }) => {
            let LdmError::Missing {
                name: missing,
                needed_for: why,
            } = &e
            else {
                unreachable!()
            };
            assert_eq!(missing, gone, "{name}");
            assert_eq!(why, needed_for, "{name}");
            let msg = e.to_string();
            assert!(msg.contains(gone), "{name}: {msg}");
        }
        other => panic!("{name}: expected Missing, got {other:?}"),
    }
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
    assert_map_missing(
        "sd1_tiny",
        "model.diffusion_model.output_blocks.4.0.skip_connection.weight",
        "unet `up_blocks.1.resnets.1.conv_shortcut.weight`",
    );
    assert_map_missing(
        "sd2_tiny",
        "first_stage_model.decoder.mid.attn_1.k.weight",
        "vae `decoder.mid_block.attentions.0.to_k.weight`",
    );
    // A tensor infer itself needs.
    let gone = "first_stage_model.decoder.conv_in.weight";
    let tensors = without(&fixture("sd2_tiny").tensors, gone);
    assert!(matches!(infer(&tensors), Err(LdmError::Missing { name, .. }) if name == gone));
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
