//! Weights kept compressed in the memory map and expanded at forward time.
//!
//! A converted model's int8, palettized and ternary weights, and any fp16 or
//! bf16 weight when computing in f32 on the CPU, stay as the file's clean,
//! evictable pages. A layer expands its weight into a per-thread scratch buffer
//! just before its GEMM, a block of output channels at a time, and reuses that
//! buffer for the next block and layer. Expanding whole layers made the buffer as
//! large as the largest kernel (SD 1.5's 1280 x 2560 x 3 x 3 is 112.5 MiB of f32),
//! which cost every packed tier more private memory than fp32's in-place weights;
//! blocks of at most [`EXPAND_BLOCK_VALUES`] cap it at 8 MiB, so the resident size
//! follows the compressed size. Only kernels larger than a block are split, and
//! those run on the UNet's small inner maps, where re-reading the input per block
//! is cheap. Expansion is a table lookup per value, spread over the rayon pool;
//! next to the GEMM it is a few percent of a step.

use std::cell::RefCell;

use candle_core::{Device, Result, Tensor};
use rayon::prelude::*;

use crate::error::LoadError;
use crate::loading::StoredTensor;
use crate::quantization::codec::Decoder;
use crate::quantization::Scheme;

/// Values expanded per parallel task.
const CHUNK_VALUES: usize = 1 << 16;

/// Most f32 values expanded at once (8 MiB): the expansion scratch's size. At SD 1.5
/// size 32 MiB blocks cost packed tiers 31 MiB more private memory than fp32 and
/// 8 MiB blocks 12 MiB (with one-image blocks written in place), with no measurable change in step time (the split kernels
/// run on the 8x8 to 32x32 maps, whose inputs stay in cache); the smallest block
/// of the largest kernel is 48 x 2560 x 3 x 3 values anyway (4.2 MiB).
pub const EXPAND_BLOCK_VALUES: usize = 2 << 20;

/// Output channels per block are a multiple of this, so the conv kernels' 6-channel
/// and the GEMM's 8- and 16-row register blocks all stay full.
pub const BLOCK_ALIGN: usize = 48;

/// Output channels per block of a split weight, for a weight of `rows` output
/// channels of `row` values each: all of them when the weight fits in
/// `max_values`, else the most that fit, rounded down to a multiple of `align`
/// (the kernels' register blocks), and never fewer than `align`.
pub fn block_rows(rows: usize, row: usize, max_values: usize, align: usize) -> usize {
    let align = align.max(1);
    if rows * row <= max_values || row == 0 {
        return rows;
    }
    ((max_values / row) / align * align).max(align).min(rows)
}

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

    /// Expands output channels `first..` into `out` (a whole number of them), in parallel.
    fn expand_rows_into(&self, d: &Decoder<'_>, first: usize, out: &mut [f32]) -> Result<()> {
        let (_, row) = d.rows();
        if row == 0 {
            return Ok(());
        }
        let rows_per_task = (CHUNK_VALUES / row).max(1);
        out.par_chunks_mut(rows_per_task * row)
            .enumerate()
            .try_for_each(|(i, chunk)| d.decode_rows(first + i * rows_per_task, chunk))
            .map_err(|e| candle_err(format!("{}: {e}", self.stored.source)))
    }

    /// Runs `f(first, rows, weights)` on the weight expanded to f32 a block of
    /// output channels at a time (channels `first..first + rows`, row-major), each
    /// block at most `max_values` values (see [`block_rows`]), in this thread's
    /// reused scratch buffer. A weight that fits is one call with every channel.
    pub fn for_row_blocks(
        &self,
        max_values: usize,
        align: usize,
        mut f: impl FnMut(usize, usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        let d = self.decoder()?;
        let (rows, row) = d.rows();
        let per = block_rows(rows, row, max_values, align);
        let mut run = |buf: &mut Vec<f32>| -> Result<()> {
            if buf.len() < per * row {
                buf.resize(per * row, 0.0);
            }
            let mut first = 0;
            loop {
                let n = per.min(rows - first);
                let block = &mut buf[..n * row];
                self.expand_rows_into(&d, first, block)?;
                f(first, n, block)?;
                first += n;
                if first >= rows || n == 0 {
                    return Ok(());
                }
            }
        };
        SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut buf) => run(&mut buf),
            // Re-entered on this thread (not expected): use a private buffer.
            Err(_) => run(&mut Vec::new()),
        })
    }

    /// A fresh f32 tensor (for devices and dtypes our kernels do not cover).
    pub fn to_tensor(&self, device: &Device) -> Result<Tensor> {
        let mut v = vec![0f32; self.shape.iter().product()];
        self.expand_rows_into(&self.decoder()?, 0, &mut v)?;
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
        folder_with(scheme, &[24, 40], &[12, 5, 3, 3])
    }

    /// As [`folder`], with the two weights' shapes given.
    fn folder_with(scheme: Scheme, lin: &[usize], conv: &[usize]) -> (tempfile::TempDir, Tensor, Tensor) {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = crate::samplers::Rng::new(3);
        let mut tensors = Vec::new();
        let mut table = PrecisionTable::new();
        let mut decoded = Vec::new();
        for (name, shape) in [("lin.weight", lin.to_vec()), ("conv.weight", conv.to_vec())] {
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

    #[test]
    fn blocks_are_aligned_and_cover_every_channel() {
        use super::block_rows;
        assert_eq!(block_rows(100, 10, 1000, 48), 100, "fits: one block");
        assert_eq!(block_rows(1280, 23040, 8 << 20, 48), 336);
        assert_eq!(block_rows(1280, 23040, 1000, 48), 48, "never fewer than the alignment");
        assert_eq!(block_rows(30, 100, 1000, 48), 30, "nor more than there are");
        let (dir, lw, _) = folder_with(Scheme::parse("palettize4").unwrap(), &[200, 40], &[12, 5, 3, 3]);
        let store = open_component(dir.path(), None).unwrap();
        let loader = store.loader("test", &Device::Cpu, DType::F32);
        let Param::Packed(p) = Param::load(&loader.root().pp("lin"), "weight", &[200, 40]).unwrap() else {
            panic!("not packed")
        };
        let want = lw.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (mut seen, mut blocks) = (Vec::new(), Vec::new());
        p.for_row_blocks(48 * 40 + 39, 48, |first, rows, w| {
            assert_eq!(first * 40, seen.len());
            assert_eq!(w.len(), rows * 40);
            seen.extend_from_slice(w);
            blocks.push(rows);
            Ok(())
        })
        .unwrap();
        assert_eq!(blocks, [48, 48, 48, 48, 8]);
        assert_eq!(seen, want);
    }

    /// Kernels split into blocks of output channels give the whole kernel's result,
    /// for the linear, 3x3 (row and flat layouts), strided and 1x1 convolution paths.
    #[test]
    fn layers_split_into_blocks_match_the_whole_weight() {
        use crate::layers::mapped::{conv2d_packed_in_blocks, linear_packed_in_blocks};
        for (s, k, stride, pad, hw) in [
            ("int8", 3, 1, 1, (9, 40)),
            ("palettize4", 3, 1, 1, (6, 6)),
            ("ternary", 3, 2, 1, (9, 7)),
            ("fp16", 1, 1, 0, (5, 6)),
        ] {
            let scheme = Scheme::parse(s).unwrap();
            let (dir, lw, cw) = folder_with(scheme, &[130, 24], &[110, 7, k, k]);
            let store = open_component(dir.path(), None).unwrap();
            let loader = store.loader("test", &Device::Cpu, DType::F32);
            let root = loader.root();
            let (Param::Packed(lp), Param::Packed(cp)) = (
                Param::load(&root.pp("lin"), "weight", &[130, 24]).unwrap(),
                Param::load(&root.pp("conv"), "weight", &[110, 7, k, k]).unwrap(),
            ) else {
                panic!("{s}: not packed")
            };
            let mut rng = crate::samplers::Rng::new(9);
            // Several rows / images (blocks staged and scattered) and one (written in place).
            for rows in [37, 1] {
                let x = rng.randn(&[rows, 24], &Device::Cpu).unwrap();
                let want = x.matmul(&lw.t().unwrap()).unwrap();
                // 48 output channels per block: 3 blocks of the linear's 130, 3 of the conv's 110.
                let got = linear_packed_in_blocks(&x, &lp, 48 * 24).unwrap();
                let d = (got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(d < 1e-4, "{s}: split linear ({rows} rows) differs by {d}");
            }
            for batch in [2, 1] {
                let xi = rng.randn(&[batch, 7, hw.0, hw.1], &Device::Cpu).unwrap();
                let want = xi.conv2d(&cw, pad, stride, 1, 1).unwrap();
                let got = conv2d_packed_in_blocks(&xi, &cp, stride, pad, 48 * 7 * k * k).unwrap();
                assert_eq!(got.dims(), want.dims());
                let d = (got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(d < 1e-4, "{s}: split conv {k}x{k}/{stride}, batch {batch}, differs by {d}");
            }
        }
    }
}
