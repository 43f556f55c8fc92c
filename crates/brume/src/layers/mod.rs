//! The hot operations every model calls: linear, convolution, normalisation,
//! attention, embedding and activations.
//!
//! Models never call candle's ops for these directly. Keeping them behind our own
//! types is what lets faster CPU kernels and compressed weights replace the
//! plain path later without touching a line of model code.

mod activation;
mod attention;
mod conv;
mod embedding;
mod epilogue;
mod linear;
pub mod mapped;
mod norm;
pub mod packed;
mod param;

pub use activation::Activation;
pub use attention::{attention, attention_reference, attention_reference_with, attention_with, AttentionMask, AttentionMode};
pub use conv::{Conv2d, Conv2dConfig};
pub use embedding::Embedding;
pub use epilogue::Fuse;
pub use linear::Linear;
pub use norm::{GroupNorm, LayerNorm};
pub use packed::PackedWeight;
pub use param::Param;

/// Whether the linear or convolution layer whose weight is `name` multiplies in f32
/// even under `--compute bf16`. Two kinds, both a negligible share of the products:
/// - the projections of the conditioning: the timestep embedding (`time_embedding.*`,
///   `add_embedding.*`, each resnet's `time_emb_proj`) and cross-attention's keys and
///   values of the text (`attn2.to_k`, `attn2.to_v`). Their rounding is not noise
///   spread over a map: one time-embedding row shifts a channel at every pixel, one
///   key or value row reaches every query. They run a few rows per step (the
///   timestep) or once per prompt (the K/V cache).
/// - each network's first and last convolution (`conv_in`, `conv_out`): rounding the
///   first one's factors rounds the model's input itself, and the last one writes
///   the output; both have few channels on one side.
///
/// On SD 1.5 at 512 px (bench speed, bf16 attention) the step's error against f32
/// went 1.02e-2 -> 1.00e-2 -> 8.7e-3 as each kind moved to f32, back inside the 1e-2
/// that makes a mode count as accurate. One rule for the layers and the memory
/// estimator, which must not count bf16 copies for them.
pub fn f32_products(name: &str) -> bool {
    let leaf = name.rsplit_once('.').map_or(name, |(module, _)| module);
    let last = leaf.rsplit('.').next().unwrap_or(leaf);
    ["time_embedding.", "add_embedding.", "time_emb_proj.", "attn2.to_k.", "attn2.to_v."].iter().any(|p| name.contains(p))
        || last == "conv_in"
        || last == "conv_out"
}

#[cfg(test)]
mod tests {
    use super::f32_products;

    #[test]
    fn conditioning_projections_and_outer_convolutions_keep_f32_products() {
        for name in [
            "time_embedding.linear_1.weight",
            "time_embedding.cond_proj.weight",
            "add_embedding.linear_2.weight",
            "down_blocks.1.resnets.0.time_emb_proj.weight",
            "up_blocks.2.attentions.1.transformer_blocks.0.attn2.to_k.weight",
            "mid_block.attentions.0.transformer_blocks.0.attn2.to_v.weight",
            "conv_in.weight",
            "conv_out.weight",
            "decoder.conv_in.weight",
            "encoder.conv_out.weight",
        ] {
            assert!(f32_products(name), "{name}");
        }
        for name in [
            "up_blocks.2.attentions.1.transformer_blocks.0.attn2.to_q.weight",
            "up_blocks.2.attentions.1.transformer_blocks.0.attn2.to_out.0.weight",
            "up_blocks.2.attentions.1.transformer_blocks.0.attn1.to_k.weight",
            "down_blocks.0.resnets.0.conv1.weight",
            "down_blocks.0.resnets.0.conv_shortcut.weight",
            "decoder.up_blocks.0.upsamplers.0.conv.weight",
            "text_model.encoder.layers.0.self_attn.k_proj.weight",
            "conv_norm_out.weight",
        ] {
            assert!(!f32_products(name), "{name}");
        }
    }
}
