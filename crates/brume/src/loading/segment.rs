//! The four independently loadable parts of a Stable Diffusion model.

use std::fmt;

/// A model segment: the unit of loading, unloading and memory planning.
///
/// The VAE is split in two because img2img needs the encoder only at the start
/// and txt2img never needs it; on a phone that is ~35 MB (fp16) not kept resident.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Segment {
    TextEncoder,
    VaeEncoder,
    Unet,
    VaeDecoder,
}

impl Segment {
    pub const ALL: [Segment; 4] = [
        Segment::TextEncoder,
        Segment::VaeEncoder,
        Segment::Unet,
        Segment::VaeDecoder,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Segment::TextEncoder => "text_encoder",
            Segment::VaeEncoder => "vae_encoder",
            Segment::Unet => "unet",
            Segment::VaeDecoder => "vae_decoder",
        }
    }

    /// Where the segment's weights live: its component folder, and the tensor-name
    /// prefixes that pick them out of it (empty: the whole component).
    pub fn weights(self) -> (Component, &'static [&'static str]) {
        match self {
            Segment::TextEncoder => (Component::TextEncoder, &[]),
            Segment::Unet => (Component::Unet, &[]),
            Segment::VaeEncoder => (Component::Vae, &["encoder.", "quant_conv."]),
            Segment::VaeDecoder => (Component::Vae, &["decoder.", "post_quant_conv."]),
        }
    }

    /// Whether the tensor `name` of the segment's component belongs to it.
    pub fn owns(self, name: &str) -> bool {
        let (_, prefixes) = self.weights();
        prefixes.is_empty() || prefixes.iter().any(|p| name.starts_with(p))
    }
}

impl fmt::Display for Segment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The diffusers component folder a tensor belongs to. The VAE encoder and
/// decoder share one `vae/` component on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Component {
    TextEncoder,
    Unet,
    Vae,
}

impl Component {
    pub fn folder(self) -> &'static str {
        match self {
            Component::TextEncoder => "text_encoder",
            Component::Unet => "unet",
            Component::Vae => "vae",
        }
    }
}
