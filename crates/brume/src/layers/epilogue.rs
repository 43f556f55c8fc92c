//! What a convolution's output goes through before anyone reads it: its bias, a
//! per-image channel offset (a resnet's timestep embedding), a residual and an
//! activation, applied in place by the conv op itself.
//!
//! As separate tensor ops each of these allocates a fresh output and walks the whole
//! map once more: the tiny VAE decoder's blocks ran conv, bias, ReLU, conv, bias,
//! ReLU, conv, bias, skip add, ReLU, so at 512x512 x 64 channels seven 64 MB maps
//! were faulted in, written and read again for every three convolutions. Fused, the
//! conv's own output is rewritten once, with no new allocation. The sums are taken in
//! the order of the unfused ops (`((y + bias) + offset) + residual`, then the
//! activation), so the result is the same to the bit.

use candle_core::{CpuStorage, Layout, Storage, StorageRef, Tensor};
use rayon::prelude::*;

use super::Activation;

/// An activation the epilogue computes itself: exactly as candle's op of that name
/// does per f32 value (the others stay separate ops).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FusedAct {
    Relu,
    Silu,
}

impl FusedAct {
    pub(crate) fn of(act: Activation) -> Option<Self> {
        match act {
            Activation::Relu => Some(Self::Relu),
            Activation::Silu => Some(Self::Silu),
            Activation::Gelu | Activation::QuickGelu => None,
        }
    }
}

/// The in-place tail of one conv call over a [b, o, h, w] output. Slices are
/// checked against the output's sizes by [`Epilogue::apply`].
#[derive(Default, Clone, Copy)]
pub(crate) struct Epilogue<'a> {
    /// [o]
    pub bias: Option<&'a [f32]>,
    /// [b, o]: one value per image and channel.
    pub offset: Option<&'a [f32]>,
    /// [b, o, h, w]
    pub residual: Option<&'a [f32]>,
    pub act: Option<FusedAct>,
}

impl Epilogue<'_> {
    pub(crate) fn is_empty(&self) -> bool {
        self.bias.is_none() && self.offset.is_none() && self.residual.is_none() && self.act.is_none()
    }

    /// Rewrites `out` ([b, `channels`, `plane`] values) in place.
    pub(crate) fn apply(&self, out: &mut [f32], channels: usize, plane: usize) -> candle_core::Result<()> {
        if self.is_empty() || out.is_empty() {
            return Ok(());
        }
        let planes = out.len() / plane.max(1);
        let fits = |s: Option<&[f32]>, n: usize| s.is_none_or(|s| s.len() == n);
        if planes * plane != out.len()
            || !planes.is_multiple_of(channels.max(1))
            || !fits(self.bias, channels)
            || !fits(self.offset, planes)
            || !fits(self.residual, out.len())
        {
            candle_core::bail!("conv epilogue: bias, offset or residual does not fit an output of {planes} planes of {plane}");
        }
        // Small planes (SD's 8x8 levels) go several to a task.
        let min_planes = (16 << 10) / plane.max(1);
        out.par_chunks_mut(plane).with_min_len(min_planes.max(1)).enumerate().for_each(|(p, dst)| {
            let bias = self.bias.map(|b| b[p % channels]);
            let offset = self.offset.map(|o| o[p]);
            let residual = self.residual.map(|r| &r[p * plane..(p + 1) * plane]);
            match self.act {
                None => tail(dst, bias, offset, residual, |v| v),
                Some(FusedAct::Relu) => tail(dst, bias, offset, residual, |v: f32| v.max(0.0)),
                Some(FusedAct::Silu) => tail(dst, bias, offset, residual, |v: f32| v / (1.0 + (-v).exp())),
            }
        });
        Ok(())
    }
}

/// One plane: monomorphised per activation so the adds and ReLU vectorise.
#[inline(always)]
fn tail(dst: &mut [f32], bias: Option<f32>, offset: Option<f32>, residual: Option<&[f32]>, act: impl Fn(f32) -> f32) {
    // Branch once per plane, not per value.
    match residual {
        Some(r) => {
            for (v, &r) in dst.iter_mut().zip(r) {
                let mut y = *v;
                if let Some(b) = bias {
                    y += b;
                }
                if let Some(o) = offset {
                    y += o;
                }
                *v = act(y + r);
            }
        }
        None => {
            for v in dst.iter_mut() {
                let mut y = *v;
                if let Some(b) = bias {
                    y += b;
                }
                if let Some(o) = offset {
                    y += o;
                }
                *v = act(y);
            }
        }
    }
}

/// What a layer asks to fuse into its conv (tensors, read in place when they are
/// contiguous f32 CPU tensors).
#[derive(Default, Clone, Copy)]
pub struct Fuse<'t> {
    /// [b, o]: added per image and channel after the bias.
    pub offset: Option<&'t Tensor>,
    /// The output's shape: added after the offset.
    pub residual: Option<&'t Tensor>,
    pub act: Option<Activation>,
}

impl<'t> Fuse<'t> {
    pub fn act(act: Activation) -> Self {
        Self { act: Some(act), ..Self::default() }
    }

    pub fn residual(residual: &'t Tensor) -> Self {
        Self { residual: Some(residual), ..Self::default() }
    }

    /// The unfused ops, in the epilogue's order: for the paths without an in-place op.
    pub(crate) fn apply_unfused(&self, y: Tensor) -> candle_core::Result<Tensor> {
        let mut y = y;
        if let Some(o) = self.offset {
            y = y.broadcast_add(&o.unsqueeze(2)?.unsqueeze(3)?)?;
        }
        if let Some(r) = self.residual {
            y = (y + r)?;
        }
        match self.act {
            Some(a) => a.forward(&y),
            None => Ok(y),
        }
    }
}

/// A tensor's storage held for reading, so its f32 values can be borrowed.
pub(crate) struct Held<'t>(Option<(StorageRef<'t>, &'t Layout)>);

impl<'t> Held<'t> {
    pub(crate) fn new(t: Option<&'t Tensor>) -> Self {
        Self(t.map(|t| t.storage_and_layout()))
    }

    /// `Ok(None)` when nothing is held; `Err(())` when the tensor is not a contiguous
    /// f32 CPU tensor (the caller then runs the unfused ops).
    #[allow(clippy::result_unit_err)]
    pub(crate) fn f32(&self) -> Result<Option<&[f32]>, ()> {
        let Some((storage, layout)) = &self.0 else { return Ok(None) };
        let Storage::Cpu(CpuStorage::F32(data)) = &**storage else { return Err(()) };
        let (a, b) = layout.contiguous_offsets().ok_or(())?;
        Ok(Some(&data[a..b]))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::Fuse;
    use crate::layers::{Activation, Conv2d, Conv2dConfig};
    use crate::loading::safetensors::{write_safetensors, SafetensorsFile, StoredDType};
    use crate::loading::WeightStore;

    fn flat(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// A weight file with, per (in, out, kernel), conv `c{i}` (f32, used in place) and
    /// `h{i}` (the same weights in f16, expanded per call), each with an f32 bias.
    fn store_of(kernels: &[(usize, usize, usize)], rng: &mut crate::samplers::Rng) -> (tempfile::TempDir, WeightStore) {
        let dev = Device::Cpu;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let mut tensors = Vec::new();
        for (i, &(c, o, k)) in kernels.iter().enumerate() {
            let w = (rng.randn(&[o, c, k, k], &dev).unwrap() * 0.3).unwrap();
            let b = rng.randn(&[o], &dev).unwrap();
            let f32s = |t: &Tensor| flat(t).iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
            let f16s = |t: &Tensor| flat(t).iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect::<Vec<u8>>();
            tensors.push((format!("c{i}.weight"), StoredDType::F32, vec![o, c, k, k], f32s(&w)));
            tensors.push((format!("c{i}.bias"), StoredDType::F32, vec![o], f32s(&b)));
            tensors.push((format!("h{i}.weight"), StoredDType::F16, vec![o, c, k, k], f16s(&w)));
            tensors.push((format!("h{i}.bias"), StoredDType::F32, vec![o], f32s(&b)));
        }
        write_safetensors(&path, &tensors, &Default::default()).unwrap();
        let mut store = WeightStore::new(&path);
        store.add_file(&SafetensorsFile::open(&path).unwrap()).unwrap();
        (dir, store)
    }

    /// The fused conv gives the unfused ops' values to the bit, for every kernel
    /// path (3x3 on wide rows and on the flat layout, strided, 1x1; weights in place
    /// and expanded from f16), every fused activation and one it leaves separate.
    #[test]
    fn fused_conv_equals_the_separate_ops_bit_for_bit() {
        let dev = Device::Cpu;
        let mut rng = crate::samplers::Rng::new(11);
        // (in, out, kernel, stride, padding, batch, h, w)
        let cases = [(5, 7, 3, 1, 1, 2, 64, 64), (16, 13, 3, 1, 1, 2, 9, 11), (6, 8, 3, 2, 1, 1, 13, 10), (12, 9, 1, 1, 0, 2, 7, 5)];
        let kernels: Vec<_> = cases.iter().map(|&(c, o, k, ..)| (c, o, k)).collect();
        let (_dir, store) = store_of(&kernels, &mut rng);
        let loader = store.loader("test", &dev, DType::F32);
        for (i, &(c, o, k, s, p, b, h, w)) in cases.iter().enumerate() {
            let cfg = Conv2dConfig { kernel: k, stride: s, padding: p };
            for prefix in ["c", "h"] {
                let conv = Conv2d::load(&loader.root().pp(format!("{prefix}{i}")), c, o, cfg, true).unwrap();
                let x = rng.randn(&[b, c, h, w], &dev).unwrap();
                let y = conv.forward(&x).unwrap();
                let offset = rng.randn(&[b, o], &dev).unwrap();
                let residual = rng.randn(y.dims(), &dev).unwrap();
                for act in [None, Some(Activation::Relu), Some(Activation::Silu), Some(Activation::Gelu)] {
                    let fuse = Fuse { offset: Some(&offset), residual: Some(&residual), act };
                    let got = conv.forward_with(&x, fuse).unwrap();
                    let mut want = y.broadcast_add(&offset.unsqueeze(2).unwrap().unsqueeze(3).unwrap()).unwrap();
                    want = (want + &residual).unwrap();
                    if let Some(a) = act {
                        want = a.forward(&want).unwrap();
                    }
                    assert_eq!(flat(&got), flat(&want), "{prefix}{i} {act:?}");
                    let only_act = conv.forward_with(&x, Fuse { act, ..Fuse::default() }).unwrap();
                    let want = act.map_or(y.clone(), |a| a.forward(&y).unwrap());
                    assert_eq!(flat(&only_act), flat(&want), "{prefix}{i} {act:?} alone");
                }
                // An offset of one image for a batch broadcasts, as the separate op does.
                let one = offset.narrow(0, 0, 1).unwrap();
                let got = conv.forward_with(&x, Fuse { offset: Some(&one), ..Fuse::default() }).unwrap();
                assert_eq!(flat(&got), flat(&y.broadcast_add(&one.unsqueeze(2).unwrap().unsqueeze(3).unwrap()).unwrap()));
                // A residual of the wrong shape is candle's shape error, not a panic.
                let wrong = rng.randn(&[b, o + 1, 1, 1], &dev).unwrap();
                assert!(conv.forward_with(&x, Fuse::residual(&wrong)).is_err());
            }
        }
    }

    /// A linear layer's bias, added in place by the product's op, gives the separate
    /// add's values to the bit (weights in place and f16-expanded; 3-D input).
    #[test]
    fn linear_bias_in_place_equals_the_separate_add() {
        use crate::layers::Linear;
        let dev = Device::Cpu;
        let mut rng = crate::samplers::Rng::new(13);
        let (k, n) = (40, 24);
        let w = rng.randn(&[n, k], &dev).unwrap();
        let b = rng.randn(&[n], &dev).unwrap();
        let f32s = |t: &Tensor| flat(t).iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let f16s = |t: &Tensor| flat(t).iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect::<Vec<u8>>();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let tensors = vec![
            ("l.weight".to_string(), StoredDType::F32, vec![n, k], f32s(&w)),
            ("l.bias".to_string(), StoredDType::F32, vec![n], f32s(&b)),
            ("h.weight".to_string(), StoredDType::F16, vec![n, k], f16s(&w)),
            ("h.bias".to_string(), StoredDType::F32, vec![n], f32s(&b)),
        ];
        write_safetensors(&path, &tensors, &Default::default()).unwrap();
        let mut store = WeightStore::new(&path);
        store.add_file(&SafetensorsFile::open(&path).unwrap()).unwrap();
        let loader = store.loader("test", &dev, DType::F32);
        let x = rng.randn(&[3, 7, k], &dev).unwrap();
        for name in ["l", "h"] {
            let with = Linear::load(&loader.root().pp(name), k, n, true).unwrap();
            let without = Linear::load(&loader.root().pp(name), k, n, false).unwrap();
            let want = without.forward(&x).unwrap().broadcast_add(&b).unwrap();
            let got = with.forward(&x).unwrap();
            assert_eq!(got.dims(), &[3, 7, n]);
            assert_eq!(flat(&got), flat(&want), "{name}");
        }
    }

    /// A conv over the nearest 2x upsampling of its input, read in place, gives what
    /// the conv of the formed upsampled map gives, up to f32 rounding (the direct
    /// kernel sums by output phases there: kernels::conv3x3_upsampled): rows a multiple of 64
    /// wide (4-vector blocks), other widths, maps that take the flat layout (formed
    /// there), two that take Winograd F(4x4, 3x3) (256 channels at 64x64; on AVX2, 64
    /// channels at 128x144 in strips), batches,
    /// f16-expanded weights, and with a fused residual and ReLU.
    #[test]
    fn upsampled_conv_equals_the_conv_of_the_upsampled_map() {
        let dev = Device::Cpu;
        let mut rng = crate::samplers::Rng::new(12);
        // (in, out, batch, h, w) of the half-size input.
        let cases = [(6, 8, 1, 32, 32), (5, 7, 2, 12, 24), (16, 13, 2, 4, 5), (3, 4, 1, 9, 40), (256, 256, 1, 32, 32), (64, 64, 2, 64, 72)];
        let kernels: Vec<_> = cases.iter().map(|&(c, o, ..)| (c, o, 3)).collect();
        let (_dir, store) = store_of(&kernels, &mut rng);
        let loader = store.loader("test", &dev, DType::F32);
        for (i, &(c, o, b, h, w)) in cases.iter().enumerate() {
            for prefix in ["c", "h"] {
                let conv = Conv2d::load(&loader.root().pp(format!("{prefix}{i}")), c, o, Conv2dConfig::K3, true).unwrap();
                let x = rng.randn(&[b, c, h, w], &dev).unwrap();
                let up = x.upsample_nearest2d(2 * h, 2 * w).unwrap();
                let want = conv.forward(&up).unwrap();
                // The direct kernel's upsampled convs sum the taps by output phases
                // (kernels::conv3x3_upsampled): equal up to f32 rounding.
                let close = |got: &Tensor, want: &Tensor, what: &str| {
                    let (g, w) = (flat(got), flat(want));
                    let scale = w.iter().fold(1f32, |m, v| m.max(v.abs()));
                    let err = g.iter().zip(&w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(g.len() == w.len() && err <= 1e-5 * scale, "{what}: max error {err} of {scale}");
                };
                close(&conv.forward_upsampled(&x, Fuse::default()).unwrap(), &want, &format!("{prefix}{i}"));
                let residual = rng.randn(want.dims(), &dev).unwrap();
                let fuse = Fuse { residual: Some(&residual), act: Some(Activation::Relu), ..Fuse::default() };
                close(&conv.forward_upsampled(&x, fuse).unwrap(), &conv.forward_with(&up, fuse).unwrap(), &format!("{prefix}{i} fused"));
            }
        }
    }
}
