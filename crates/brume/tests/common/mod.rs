//! Shared helpers for the parity tests: fixture paths, reading reference
//! tensors, and the relative-error check.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use brume::loading::safetensors::{SafetensorsFile, StoredDType};
use brume::loading::store::{materialize, StoredTensor};
use brume::loading::Transform;
use candle_core::{DType, Device, Tensor};

pub fn fixtures() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures"))
}

/// A UNet parity fixture (`fixtures/parity/CASE`): the model, f32 on the CPU, and its io.
pub fn unet_fixture(case: &str) -> (brume::models::UNet2DConditionModel, Io) {
    use brume::models::{UNet2DConditionModel, UNetConfig};
    let dir = fixtures().join("parity").join(case);
    let model_dir = dir.join("model");
    let cfg = UNetConfig::from_file(&model_dir.join("config.json")).unwrap();
    let store = brume::loading::diffusers::open_component(&model_dir, None).unwrap();
    let unet = UNet2DConditionModel::load(&store, &cfg, &Device::Cpu, DType::F32).unwrap();
    (unet, Io::open(dir.join("io.safetensors")))
}

/// The fixture's inputs through `unet` (with its timestep condition when it has one).
pub fn unet_forward(unet: &brume::models::UNet2DConditionModel, io: &Io) -> Tensor {
    let ts: Vec<f32> = io.f32("in.timestep").to_vec1().unwrap();
    let cond = io.has("in.timestep_cond").then(|| io.f32("in.timestep_cond"));
    unet.forward(&io.f32("in.sample"), &ts, &io.f32("in.encoder_hidden_states"), cond.as_ref()).unwrap()
}

/// A fixture's `io.safetensors`: inputs `in.*`, references `out.*`.
pub struct Io(Arc<SafetensorsFile>);

impl Io {
    pub fn open(path: PathBuf) -> Self {
        Io(SafetensorsFile::open(&path).unwrap_or_else(|e| panic!("{e}")))
    }

    pub fn f32(&self, name: &str) -> Tensor {
        let entry = self.0.entry(name).unwrap_or_else(|| panic!("fixture lacks {name}")).clone();
        let shape = entry.shape.clone();
        let t = StoredTensor {
            file: self.0.clone(),
            source: name.into(),
            entry,
            transform: Transform::Identity,
            quant: None,
        };
        materialize(&t, &shape, &Device::Cpu, DType::F32).unwrap()
    }

    pub fn i64(&self, name: &str) -> (Vec<i64>, Vec<usize>) {
        let entry = self.0.entry(name).unwrap_or_else(|| panic!("fixture lacks {name}"));
        assert_eq!(entry.dtype, StoredDType::I64);
        let v = self.0.bytes(entry).chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
        (v, entry.shape.clone())
    }

    pub fn ids(&self, name: &str) -> Tensor {
        let (v, shape) = self.i64(name);
        let v: Vec<u32> = v.into_iter().map(|x| x as u32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    pub fn has(&self, name: &str) -> bool {
        self.0.entry(name).is_some()
    }
}

/// max |got - want| / max |want|.
pub fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.dims(), want.dims(), "shape mismatch");
    let g = got.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let w = want.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let max_diff = g.iter().zip(&w).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    let max_ref = w.iter().map(|b| b.abs()).fold(0.0, f64::max);
    assert!(g.iter().all(|x| x.is_finite()), "non-finite output");
    max_diff / max_ref.max(1e-12)
}

pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    let e = rel_err(got, want);
    eprintln!("{what}: relative error {e:.3e}");
    assert!(e <= tol, "{what}: relative error {e:.3e} > {tol:.0e}");
}

/// Replays recorded noise tensors in order, as diffusers drew them.
pub struct ReplayNoise {
    pub draws: std::collections::VecDeque<Tensor>,
}

impl ReplayNoise {
    pub fn new(draws: Vec<Tensor>) -> Self {
        Self { draws: draws.into() }
    }
}

impl brume::samplers::NoiseSource for ReplayNoise {
    fn randn(&mut self, shape: &[usize], _device: &Device) -> candle_core::Result<Tensor> {
        let t = self.draws.pop_front().ok_or_else(|| candle_core::Error::Msg("no recorded noise left".into()))?;
        if t.dims() != shape {
            candle_core::bail!("recorded noise has shape {:?}, asked for {:?}", t.dims(), shape);
        }
        Ok(t)
    }
}
