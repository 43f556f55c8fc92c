//! The knobs a memory plan turns, each a way to trade speed or quality for memory.

use std::num::NonZeroUsize;

pub use crate::layers::AttentionMode;

/// Which segments are in memory at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    /// Every segment the request needs is loaded up front and kept until the end.
    AllResident,
    /// Each segment is loaded, run and dropped before the next (Apple's
    /// `reduceMemory`); its mapped pages are handed back to the OS as it goes.
    Sequential,
}

/// How the VAE decoder turns latents into pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VaeDecode {
    Full,
    /// Overlapping latent tiles, decoded one at a time and blended at the seams.
    Tiled(TileSpec),
}

/// A latent tile size and the overlap between neighbouring tiles, in latent pixels.
/// Built only through [`TileSpec::new`], so the overlap is always smaller than the tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileSpec {
    tile: NonZeroUsize,
    overlap: usize,
}

impl TileSpec {
    /// `None` when the overlap would leave no stride (overlap >= tile).
    pub fn new(tile: usize, overlap: usize) -> Option<Self> {
        let tile = NonZeroUsize::new(tile)?;
        (overlap < tile.get()).then_some(Self { tile, overlap })
    }

    pub fn tile(&self) -> usize {
        self.tile.get()
    }

    pub fn overlap(&self) -> usize {
        self.overlap
    }

    /// Distance between tile origins.
    pub fn stride(&self) -> usize {
        self.tile.get() - self.overlap
    }
}

/// How classifier-free guidance's two branches (unconditional and prompted) go
/// through the UNet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Branches {
    /// As one batch of twice the images: the fastest.
    Batched,
    /// One branch after the other: the UNet's activations halve, the picture is
    /// the same (each image's arithmetic does not depend on its batch), a step
    /// is slower (1.7x for int4-attn-fp16 at 512 px: each pass streams and
    /// expands every weight).
    OneAtATime,
}

/// Everything the estimator needs to know about how a request will run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strategy {
    pub residency: Residency,
    pub branches: Branches,
    pub attention: AttentionMode,
    pub vae: VaeDecode,
}

impl Strategy {
    /// The plain path: nothing traded away.
    pub const PLAIN: Strategy = Strategy {
        residency: Residency::AllResident,
        branches: Branches::Batched,
        attention: AttentionMode::Full,
        vae: VaeDecode::Full,
    };

    /// A short name for tables and recipes, e.g. `sequential+split+chunk256+tile32`.
    pub fn label(&self) -> String {
        let mut s = match self.residency {
            Residency::AllResident => "resident".to_string(),
            Residency::Sequential => "sequential".to_string(),
        };
        if self.branches == Branches::OneAtATime {
            s.push_str("+split");
        }
        if let AttentionMode::Chunked(c) = self.attention {
            s.push_str(&format!("+chunk{c}"));
        }
        if let VaeDecode::Tiled(t) = self.vae {
            s.push_str(&format!("+tile{}", t.tile()));
        }
        s
    }
}
