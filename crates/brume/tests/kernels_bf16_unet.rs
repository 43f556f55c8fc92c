//! A whole UNet under `--compute bf16`, on AMX tiles where the CPU has them, else on
//! AVX512-BF16 vectors: in-place f32 weights are rounded and packed for the kernel on
//! first use and kept, so the second step must give exactly the first step's answer,
//! and both stay within bf16's error of diffusers' f32 output. The conditioning
//! projections and a network's first and last convolution keep f32 products under
//! bf16 compute. Its own binary, because the compute switch is process-wide.

mod common;

use brume::kernels::{set_compute, Compute};
use common::rel_err;

#[test]
fn bf16_unet_matches_diffusers_and_reuses_its_packed_weights() {
    if !brume::kernels::conv3x3_bf16::supported() {
        eprintln!("no AVX512-BF16 on this CPU: bf16 UNet not run");
        return;
    }
    let kernel = if brume::kernels::amx::supported() { "AMX" } else { "AVX512-BF16" };
    let (unet, io) = common::unet_fixture("unet_sd1");
    let run = || common::unet_forward(&unet, &io);
    let f32_out = run();
    set_compute(Compute::Bf16).unwrap();
    let first = run();
    let second = run();
    set_compute(Compute::F32).unwrap();
    let want = io.f32("out.sample");
    let flat = |t: &candle_core::Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(flat(&first), flat(&second), "{kernel}: the cached packed weights changed the answer");
    let e = rel_err(&first, &want);
    assert!(e > 1e-6 && e <= 3e-2, "bf16 on {kernel} vs diffusers f32: {e:.2e}");
    assert!(rel_err(&f32_out, &want) <= 1e-4, "f32 after bf16 must be unchanged");
    exact_layers_keep_f32_products_under_bf16();
}

/// The same weights under four names, run in f32 and under bf16 compute: the
/// timestep projection and `conv_out` give the f32 answer to the bit, the
/// feed-forward layer and an inner convolution are rounded.
fn exact_layers_keep_f32_products_under_bf16() {
    use brume::layers::{Conv2d, Conv2dConfig, Linear};
    use brume::loading::safetensors::{write_safetensors, SafetensorsFile, StoredDType};
    use brume::loading::WeightStore;
    use candle_core::{DType, Device, Tensor};
    let dev = Device::Cpu;
    let mut rng = brume::samplers::Rng::new(7);
    let lin = rng.randn(&[64, 96], &dev).unwrap();
    let conv = rng.randn(&[32, 16, 3, 3], &dev).unwrap();
    let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let mut tensors = Vec::new();
    for name in ["down_blocks.0.resnets.0.time_emb_proj", "mid_block.attentions.0.transformer_blocks.0.ff.net.2"] {
        tensors.push((format!("{name}.weight"), StoredDType::F32, vec![64, 96], bytes(&lin)));
    }
    for name in ["conv_out", "down_blocks.0.resnets.0.conv1"] {
        tensors.push((format!("{name}.weight"), StoredDType::F32, vec![32, 16, 3, 3], bytes(&conv)));
    }
    write_safetensors(&path, &tensors, &Default::default()).unwrap();
    let mut store = WeightStore::new(&path);
    store.add_file(&SafetensorsFile::open(&path).unwrap()).unwrap();
    let loader = store.loader("unet", &dev, DType::F32);
    let w = loader.root();
    let linear = |name: &str| {
        let mut ws = w.clone();
        for part in name.split('.') {
            ws = ws.pp(part);
        }
        Linear::load(&ws, 96, 64, false).unwrap()
    };
    let conv2d = |name: &str| Conv2d::load(&w.pp(name), 16, 32, Conv2dConfig::K3, false).unwrap();
    let (t_proj, ff) = (linear("down_blocks.0.resnets.0.time_emb_proj"), linear("mid_block.attentions.0.transformer_blocks.0.ff.net.2"));
    let (c_out, c_in) = (conv2d("conv_out"), conv2d("down_blocks.0.resnets.0.conv1"));
    let x = rng.randn(&[300, 96], &dev).unwrap();
    let img = rng.randn(&[1, 16, 20, 20], &dev).unwrap();
    let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let f32_lin = flat(t_proj.forward(&x).unwrap());
    let f32_conv = flat(c_out.forward(&img).unwrap());
    assert_eq!(f32_lin, flat(ff.forward(&x).unwrap()));
    assert_eq!(f32_conv, flat(c_in.forward(&img).unwrap()));
    set_compute(Compute::Bf16).unwrap();
    let outs = [t_proj.forward(&x), ff.forward(&x), c_out.forward(&img), c_in.forward(&img)].map(|t| flat(t.unwrap()));
    set_compute(Compute::F32).unwrap();
    assert_eq!(outs[0], f32_lin, "time_emb_proj must keep f32 products under bf16");
    assert_ne!(outs[1], f32_lin, "an ordinary linear layer is rounded under bf16");
    assert_eq!(outs[2], f32_conv, "conv_out must keep f32 products under bf16");
    assert_ne!(outs[3], f32_conv, "an inner convolution is rounded under bf16");
}
