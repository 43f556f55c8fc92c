//! Weights kept compressed in the memory map and expanded at forward time.
//!
//! A converted model's int8, palettized and ternary weights, and any fp16 or
//! bf16 weight when computing in f32 on the CPU, stay as the file's clean,
//! evictable pages. A layer expands its weight into a per-thread scratch buffer
//! just before its GEMM and reuses that buffer for the next layer, so private
//! memory holds at most one layer's f32 weight (the largest SD 1.5 kernel,
//! 1280 x 2560 x 3 x 3, is 118 MB) instead of the whole model, and the resident
//! size follows the compressed size. Expansion is a table lookup per value,
//! spread over the rayon pool; next to the GEMM it is a few percent of a step.

use std::cell::RefCell;

use candle_core::{Device, Result, Tensor};
use rayon::prelude::*;

use crate::error::LoadError;
use crate::loading::StoredTensor;
use crate::quantization::codec::Decoder;
use crate::quantization::Scheme;

/// Values expanded per parallel task.
const CHUNK_VALUES: usize = 1 << 16;

thread_local! {
    /// The reused expansion buffer of this thread.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// A weight stored in a non-f32 scheme, read in place.
#[derive(Debug, Clone)]
pub struct PackedWeight {
    stored: StoredTensor,
    shape: Vec<usize>,
    scheme: Scheme,
}

fn candle_err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

impl PackedWeight {
    /// `Some` when `t` is stored compressed or as f16 / bf16; the parts' sizes
    /// are checked here, so expansion never reads outside them.
    pub fn from_stored(
        t: &StoredTensor,
        name: &str,
    ) -> Option<std::result::Result<Self, LoadError>> {
        let scheme = t.scheme()?;
        if scheme == Scheme::F32 {
            return None;
        }
        let shape = t.shape();
        Some(match t.decoder()? {
            Ok(_) => Ok(Self {
                stored: t.clone(),
                shape,
                scheme,
            }),
            Err(source) => Err(LoadError::Quantized {
                path: t.file.path().to_path_buf(),
                tensor: name.to_string(),
                source: Box::new(source),
            }),
        })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// Bytes stored (main part plus lookup tables / scales).
    pub fn stored_bytes(&self) -> usize {
        self.stored.nbytes()
    }

    fn decoder(&self) -> Result<Decoder<'_>> {
        match self.stored.decoder() {
            Some(d) => d.map_err(candle_err),
            None => candle_core::bail!("{}: not a weight dtype", self.stored.source),
        }
    }

    /// Expands the whole weight into `out` (its numel long), in parallel.
    fn expand_into(&self, out: &mut [f32]) -> Result<()> {
        let d = self.decoder()?;
        let (_, row) = d.rows();
        if row == 0 {
            return Ok(());
        }
        let rows_per_task = (CHUNK_VALUES / row).max(1);
        out.par_chunks_mut(rows_per_task * row)
            .enumerate()
            .try_for_each(|(i, chunk)| d.decode_rows(i * rows_per_task, chunk))
            .map_err(|e| candle_err(format!("{}: {e}", self.stored.source)))
    }

    /// Runs `f` on the weight expanded to f32 (row-major, `shape`), in this
    /// thread's reused scratch buffer.
    pub fn with_expanded<R>(&self, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
        let n: usize = self.shape.iter().product();
        SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut buf) => {
                if buf.len() < n {
                    buf.resize(n, 0.0);
                }
                self.expand_into(&mut buf[..n])?;
                Ok(f(&buf[..n]))
            }
            // Re-entered on this thread (not expected): use a private buffer.
            Err(_) => {
                let mut buf = vec![0f32; n];
                self.expand_into(&mut buf)?;
                Ok(f(&buf))
            }
        })
    }

    /// A fresh f32 tensor (for devices and dtypes our kernels do not cover).
    pub fn to_tensor(&self, device: &Device) -> Result<Tensor> {
        let mut v = vec![0f32; self.shape.iter().product()];
        self.expand_into(&mut v)?;
        Tensor::from_vec(v, self.shape.as_slice(), device)
    }

    /// Rows `ids` of a [rows, dim] table, expanding only those rows.
    pub fn gather_rows(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        let (rows, dim) = (self.shape[0], self.shape.get(1).copied().unwrap_or(1));
        let d = self.decoder()?;
        let mut out = vec![0f32; ids.len() * dim];
        for (&id, o) in ids.iter().zip(out.chunks_exact_mut(dim.max(1))) {
            if id as usize >= rows {
                candle_core::bail!(
                    "token id {id} is out of range for an embedding table of {rows} rows"
                );
            }
            d.decode_rows(id as usize, o).map_err(candle_err)?;
        }
        Tensor::from_vec(out, (ids.len(), dim), device)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use candle_core::{DType, Device, Tensor};

    use crate::layers::{Conv2d, Conv2dConfig, Linear, Param};
    use crate::loading::diffusers::open_component;
    use crate::loading::safetensors::write_safetensors;
    use crate::quantization::codec::encode;
    use crate::quantization::format::{PrecisionTable, TensorScheme, PRECISION_KEY};
    use crate::quantization::Scheme;

    /// Writes `lin.weight` [24, 40] and `conv.weight` [12, 5, 3, 3] under `scheme`
    /// as a component folder; returns it with the decoded weights.
    fn folder(scheme: Scheme) -> (tempfile::TempDir, Tensor, Tensor) {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = crate::samplers::Rng::new(3);
        let mut tensors = Vec::new();
        let mut table = PrecisionTable::new();
        let mut decoded = Vec::new();
        for (name, shape) in [("lin.weight", vec![24, 40]), ("conv.weight", vec![12, 5, 3, 3])] {
            let v = rng.randn(&shape, &Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let parts = encode(scheme, &v, &shape, 1).unwrap();
            for (part, bytes) in scheme.parts(&shape).into_iter().zip(parts) {
                tensors.push((format!("{name}{}", part.suffix), part.dtype, part.shape, bytes));
            }
            table.tensors.insert(name.into(), TensorScheme { scheme: scheme.to_string(), shape: shape.clone() });
            decoded.push(shape);
        }
        let meta: BTreeMap<String, String> = [(PRECISION_KEY.to_string(), table.to_json())].into();
        write_safetensors(&dir.path().join("diffusion_pytorch_model.safetensors"), &tensors, &meta).unwrap();
        let store = open_component(dir.path(), None).unwrap();
        let dec = |n: &str, shape: &[usize]| {
            let d = store.get(n).unwrap().decoder().unwrap().unwrap();
            Tensor::from_vec(d.decode_all().unwrap(), shape, &Device::Cpu).unwrap()
        };
        let (l, c) = (dec("lin.weight", &decoded[0]), dec("conv.weight", &decoded[1]));
        (dir, l, c)
    }

    #[test]
    fn packed_layers_compute_with_the_decoded_weights() {
        for s in ["int8", "palettize4-g16", "palettize6", "ternary", "fp16", "bf16"] {
            let scheme = Scheme::parse(s).unwrap();
            let (dir, lw, cw) = folder(scheme);
            let store = open_component(dir.path(), None).unwrap();
            let loader = store.loader("test", &Device::Cpu, DType::F32);
            let root = loader.root();
            let p = Param::load(&root.pp("lin"), "weight", &[24, 40]).unwrap();
            assert!(p.is_packed(), "{s}");
            let lin = Linear::load(&root.pp("lin"), 40, 24, false).unwrap();
            let conv = Conv2d::load(&root.pp("conv"), 5, 12, Conv2dConfig::K3, false).unwrap();
            let mut rng = crate::samplers::Rng::new(4);
            let x = rng.randn(&[3, 7, 40], &Device::Cpu).unwrap();
            let want = x.broadcast_matmul(&lw.t().unwrap()).unwrap();
            let d = (lin.forward(&x).unwrap() - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-4, "{s}: linear differs by {d}");
            let xi = rng.randn(&[2, 5, 9, 6], &Device::Cpu).unwrap();
            let want = xi.conv2d(&cw, 1, 1, 1, 1).unwrap();
            let d = (conv.forward(&xi).unwrap() - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-4, "{s}: conv differs by {d}");
            // Computing in f16 (other devices' path) decodes once at load instead.
            let loader16 = store.loader("test", &Device::Cpu, DType::F16);
            assert!(!Param::load(&loader16.root().pp("lin"), "weight", &[24, 40]).unwrap().is_packed());
        }
    }
}
