//! Which scheme each tensor gets: named presets and user policy files.
//!
//! A policy is an ordered list of `glob -> scheme` rules over tensor names
//! written `component/name` (e.g. `unet/down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight`);
//! the first matching rule wins. By default a rule only applies to the weights
//! of convolutions and linear layers (tensors of two or more dimensions that are
//! not embedding tables): norms, biases and embeddings keep the policy's float
//! default unless a rule says `any`.
//!
//! Policy file syntax, one rule per line, `#` starts a comment:
//! ```text
//! default fp16                      # float scheme for everything no rule takes
//! *.to_q.weight          fp16       # glob, scheme
//! unet/*                 palettize4-g16
//! *norm*                 fp32 any   # `any`: also norms, biases, embeddings
//! ```
//! In a glob, `*` matches any run of characters (dots and slashes included) and
//! `?` any one character.

use std::fmt;

use super::error::QuantError;
use super::scheme::Scheme;

/// Output channels sharing one lookup table in the 4-bit presets: one table per
/// channel. Measured on the built-in model (README, precision tiers), a table per 16
/// channels cost int4-attn-fp16 16 (run 5), 24.5 (run 8) and 5.5 (run 13) points of
/// background-texture accuracy against fp32; one per channel kept every attribute within
/// 3 (run 8) and 4.5 (run 13) points, for 13% more UNet bytes at that tiny width and ~2% at
/// SD 1.5's (32 bytes of table per channel of 320+ x 9 weights). `palettize4-g16` in a
/// policy file still gives the coarser one.
pub const PRESET_LUT_GROUP: usize = 1;

/// The projections the `-attn-fp16` presets keep at fp16: diffusers' attention
/// (UNet transformer blocks, VAE mid-block) and CLIP's self-attention.
pub const ATTENTION_PROJECTIONS: &[&str] = &[
    "*.to_q.weight",
    "*.to_k.weight",
    "*.to_v.weight",
    "*.to_out.0.weight",
    "*.self_attn.q_proj.weight",
    "*.self_attn.k_proj.weight",
    "*.self_attn.v_proj.weight",
    "*.self_attn.out_proj.weight",
];

/// The preset names `--precision` accepts.
pub const PRESETS: &[(&str, &str)] = &[
    ("fp32", "everything fp32"),
    ("fp16", "everything fp16"),
    ("bf16", "everything bf16"),
    ("int8", "conv and linear weights int8 (symmetric, per output channel), the rest fp16"),
    ("int4", "conv and linear weights palettized to 4 bits (a k-means table per output channel), the rest fp16"),
    ("int4-attn-fp16", "as int4, but attention q/k/v/out projections fp16"),
    ("ternary-attn-fp16", "conv and linear weights ternary (-1/0/+1 x a scale per channel), attention projections fp16"),
];

/// Which tensors a rule may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applies {
    /// Conv and linear weights only.
    Weights,
    /// Any tensor.
    Any,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub glob: String,
    pub scheme: Scheme,
    pub applies: Applies,
}

/// An ordered rule list and the scheme of everything no rule takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// The preset name or the policy file's path, for the record in converted files.
    pub name: String,
    pub rules: Vec<Rule>,
    pub default: Scheme,
}

/// Whether `name` (`component/tensor`) of `shape` is a conv or linear weight.
pub fn is_layer_weight(name: &str, shape: &[usize]) -> bool {
    if shape.len() < 2 {
        return false;
    }
    // Embedding tables: CLIP's token / position embeddings, OpenCLIP's positional_embedding.
    let module = name.rsplit_once('.').map(|(m, _)| m).unwrap_or(name);
    let last = module.rsplit(['.', '/']).next().unwrap_or(module);
    !(last.ends_with("_embedding") || last.ends_with("embeddings") || name.ends_with("_embedding"))
}

/// Glob match with `*` (any run) and `?` (any one character).
pub fn glob_match(glob: &str, text: &str) -> bool {
    let (g, t): (Vec<char>, Vec<char>) = (glob.chars().collect(), text.chars().collect());
    let (mut gi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if gi < g.len() && (g[gi] == '?' || g[gi] == t[ti]) {
            gi += 1;
            ti += 1;
        } else if gi < g.len() && g[gi] == '*' {
            star = Some((gi, ti));
            gi += 1;
        } else if let Some((sg, st)) = star {
            gi = sg + 1;
            ti = st + 1;
            star = Some((sg, st + 1));
        } else {
            return false;
        }
    }
    g[gi..].iter().all(|&c| c == '*')
}

impl Policy {
    /// A named preset (see [`PRESETS`]).
    pub fn preset(name: &str) -> Option<Self> {
        let p4 = Scheme::parse(&format!("palettize4-g{PRESET_LUT_GROUP}")).ok()?;
        let attention_fp16 = || ATTENTION_PROJECTIONS.iter().map(|g| rule(g, Scheme::F16));
        let rules: Vec<Rule> = match name {
            "fp32" | "fp16" | "bf16" => vec![],
            "int8" => vec![rule("*", Scheme::Int8)],
            "int4" => vec![rule("*", p4)],
            "int4-attn-fp16" => attention_fp16().chain([rule("*", p4)]).collect(),
            "ternary-attn-fp16" => attention_fp16().chain([rule("*", Scheme::Ternary)]).collect(),
            _ => return None,
        };
        let default = match name {
            "fp32" => Scheme::F32,
            "bf16" => Scheme::BF16,
            _ => Scheme::F16,
        };
        Some(Self { name: name.to_string(), rules, default })
    }

    /// Parses a policy file's text; `origin` names it in errors.
    pub fn parse(origin: &str, text: &str) -> Result<Self, QuantError> {
        let mut rules = Vec::new();
        let mut default = Scheme::F16;
        for (i, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let err = |reason: String| QuantError::Policy { origin: origin.to_string(), line: i + 1, reason };
            let words: Vec<&str> = line.split_whitespace().collect();
            let scheme = |s: &str| Scheme::parse(s).map_err(|e| err(e.to_string()));
            match words.as_slice() {
                ["default", s] => {
                    let s = scheme(s)?;
                    if !s.is_float() {
                        return Err(err(format!("the default must be fp32, fp16 or bf16, not {s}")));
                    }
                    default = s;
                }
                [glob, s] => rules.push(Rule { glob: glob.to_string(), scheme: scheme(s)?, applies: Applies::Weights }),
                [glob, s, "any"] => rules.push(Rule { glob: glob.to_string(), scheme: scheme(s)?, applies: Applies::Any }),
                _ => return Err(err(format!("expected `GLOB SCHEME [any]` or `default SCHEME`, got `{line}`"))),
            }
        }
        Ok(Self { name: origin.to_string(), rules, default })
    }

    /// The scheme of tensor `name` (`component/tensor`) of `shape`.
    pub fn scheme_for(&self, name: &str, shape: &[usize]) -> Scheme {
        let weight = is_layer_weight(name, shape);
        self.rules
            .iter()
            .find(|r| (r.applies == Applies::Any || weight) && glob_match(&r.glob, name))
            .map(|r| r.scheme)
            .unwrap_or(self.default)
    }

    /// The policy as a policy file (recorded in converted models).
    pub fn to_text(&self) -> String {
        let mut s = format!("default {}\n", self.default);
        for r in &self.rules {
            s.push_str(&format!("{} {}{}\n", r.glob, r.scheme, if r.applies == Applies::Any { " any" } else { "" }));
        }
        s
    }
}

fn rule(glob: &str, scheme: Scheme) -> Rule {
    Rule { glob: glob.to_string(), scheme, applies: Applies::Weights }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("*.to_q.weight", "unet/mid_block.attentions.0.transformer_blocks.0.attn1.to_q.weight"));
        assert!(!glob_match("*.to_q.weight", "unet/x.to_q.bias"));
        assert!(glob_match("unet/*", "unet/conv_in.weight"));
        assert!(!glob_match("unet/*", "vae/conv_in.weight"));
        assert!(glob_match("a?c", "abc") && !glob_match("a?c", "abbc"));
        assert!(glob_match("*", "") && glob_match("**", "x") && !glob_match("", "x"));
        assert!(glob_match("*a*b*", "xxaxxbxx") && !glob_match("*a*b", "xxbxxa"));
    }

    #[test]
    fn int4_attn_fp16_keeps_attention_projections_and_small_tensors() {
        let p = Policy::preset("int4-attn-fp16").unwrap();
        let p4 = Scheme::parse("palettize4-g1").unwrap();
        let m = [320, 320];
        for name in [
            "unet/down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight",
            "unet/up_blocks.3.attentions.2.transformer_blocks.0.attn2.to_k.weight",
            "unet/mid_block.attentions.0.transformer_blocks.0.attn2.to_out.0.weight",
            "vae/decoder.mid_block.attentions.0.to_v.weight",
            "text_encoder/text_model.encoder.layers.3.self_attn.out_proj.weight",
        ] {
            assert_eq!(p.scheme_for(name, &m), Scheme::F16, "{name}");
        }
        for name in [
            "unet/down_blocks.0.attentions.0.transformer_blocks.0.ff.net.0.proj.weight",
            "unet/down_blocks.0.attentions.0.proj_in.weight",
            "unet/time_embedding.linear_1.weight",
            "text_encoder/text_model.encoder.layers.3.mlp.fc1.weight",
            "vae/decoder.up_blocks.0.resnets.0.conv1.weight",
        ] {
            assert_eq!(p.scheme_for(name, &m), p4, "{name}");
        }
        assert_eq!(p.scheme_for("unet/conv_in.weight", &[320, 4, 3, 3]), p4);
        // Biases, norms and embeddings keep the default.
        assert_eq!(p.scheme_for("unet/conv_in.bias", &[320]), Scheme::F16);
        assert_eq!(p.scheme_for("unet/down_blocks.0.resnets.0.norm1.weight", &[320]), Scheme::F16);
        assert_eq!(p.scheme_for("text_encoder/text_model.embeddings.token_embedding.weight", &[49408, 768]), Scheme::F16);
        assert_eq!(p.scheme_for("text_encoder/text_model.embeddings.position_embedding.weight", &[77, 768]), Scheme::F16);
        // Plain int4 palettizes the attention projections too.
        let plain = Policy::preset("int4").unwrap();
        assert_eq!(plain.scheme_for("unet/x.attn1.to_q.weight", &m), p4);
        assert!(Policy::preset("int3").is_none());
    }

    #[test]
    fn policy_files_first_match_wins() {
        let text = "# keep the first conv exact\ndefault fp32\nunet/conv_in.weight fp32\nunet/* int8\n*norm* bf16 any\n* palettize6-g4\n";
        let p = Policy::parse("my.policy", text).unwrap();
        assert_eq!(p.default, Scheme::F32);
        assert_eq!(p.scheme_for("unet/conv_in.weight", &[8, 4, 3, 3]), Scheme::F32);
        assert_eq!(p.scheme_for("unet/conv_out.weight", &[8, 4, 3, 3]), Scheme::Int8);
        assert_eq!(p.scheme_for("unet/norm.weight", &[8]), Scheme::BF16);
        assert_eq!(p.scheme_for("vae/conv_in.bias", &[8]), Scheme::F32);
        assert_eq!(p.scheme_for("vae/conv_in.weight", &[8, 3, 3, 3]), Scheme::parse("palettize6-g4").unwrap());
        assert_eq!(Policy::parse("again", &p.to_text()).unwrap().rules, p.rules);
        for (bad, line) in [("x int5", 1), ("\n\ndefault int8", 3), ("a b c d", 1), ("lonely", 1)] {
            match Policy::parse("f", bad) {
                Err(QuantError::Policy { line: l, .. }) => assert_eq!(l, line, "{bad}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
    }
}
