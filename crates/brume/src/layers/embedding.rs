use candle_core::{Result, Tensor};

use crate::error::LoadError;
use crate::loading::Weights;

/// A lookup table of `rows` vectors of size `dim`.
#[derive(Debug, Clone)]
pub struct Embedding {
    table: Tensor,
    rows: usize,
}

impl Embedding {
    /// Loads `leaf` ([rows, dim]); `leaf` differs between checkpoints (`weight`, or
    /// OpenCLIP's bare `positional_embedding` once mapped).
    pub fn load(w: &Weights, leaf: &str, rows: usize, dim: usize) -> std::result::Result<Self, LoadError> {
        Ok(Self {
            table: w.tensor(leaf, &[rows, dim])?,
            rows,
        })
    }

    /// Looks up `ids` (any shape of u32/i64); ids out of range are an error, not a panic.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let ids_u32 = ids.to_dtype(candle_core::DType::U32)?;
        let flat = ids_u32.flatten_all()?;
        let max = flat.max(0)?.to_scalar::<u32>()? as usize;
        if max >= self.rows {
            candle_core::bail!("token id {max} is out of range for an embedding table of {} rows", self.rows);
        }
        let out = self.table.index_select(&flat, 0)?;
        let mut shape = ids.dims().to_vec();
        shape.push(self.table.dim(1)?);
        out.reshape(shape)
    }
}
