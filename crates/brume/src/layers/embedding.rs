use candle_core::{Result, Tensor};

use super::mapped;
use super::Param;
use crate::error::LoadError;
use crate::loading::Weights;

/// A lookup table of `rows` vectors of size `dim`.
#[derive(Debug, Clone)]
pub struct Embedding {
    table: Param,
    dim: usize,
    rows: usize,
}

impl Embedding {
    /// Loads `leaf` ([rows, dim]); `leaf` differs between checkpoints (`weight`, or
    /// OpenCLIP's bare `positional_embedding` once mapped).
    pub fn load(w: &Weights, leaf: &str, rows: usize, dim: usize) -> std::result::Result<Self, LoadError> {
        Ok(Self {
            table: Param::load(w, leaf, &[rows, dim])?,
            rows,
            dim,
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
        let out = match &self.table {
            Param::Mapped(m) => mapped::gather_rows(m, &flat.to_vec1::<u32>()?, ids.device())?,
            Param::Packed(p) => p.gather_rows(&flat.to_vec1::<u32>()?, ids.device())?,
            Param::Dense(t) => t.index_select(&flat, 0)?,
        };
        let mut shape = ids.dims().to_vec();
        shape.push(self.dim);
        out.reshape(shape)
    }
}
