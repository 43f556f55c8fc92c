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
    // Every check of this binary runs in this one test: they switch the process-wide
    // compute mode, which a test beside them would see.
    geglu_projection_by_blocks_matches_the_two_ops();
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
    a_kept_conv_form_serves_other_map_sizes();
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

/// A mapped 3x3 conv keeps one packed bf16 form: the direct kernel's or, on 16x16-32x32
/// maps of >= 256 channels (without AMX), Winograd's. Asked for the other at a new map
/// size, it runs the form it kept where that is the direct kernel, and rounds the
/// kernel per call for the direct kernel where it kept Winograd's: each answer is, to
/// the bit, one of the two kernels' own.
fn a_kept_conv_form_serves_other_map_sizes() {
    use brume::kernels::conv3x3_bf16::conv3x3_bf16;
    use brume::kernels::winograd_bf16::conv3x3_winograd_bf16;
    use brume::layers::{Conv2d, Conv2dConfig};
    use brume::loading::safetensors::{write_safetensors, SafetensorsFile, StoredDType};
    use brume::loading::WeightStore;
    use candle_core::{DType, Device, Tensor};
    if brume::kernels::amx::supported() {
        eprintln!("AMX: every bf16 3x3 conv runs on the tiles; kept-form switch not run");
        return;
    }
    let dev = Device::Cpu;
    let mut rng = brume::samplers::Rng::new(8);
    let c = 256;
    let kernel = (rng.randn(&[c, c, 3, 3], &dev).unwrap() * (1.0 / (9.0 * c as f64).sqrt())).unwrap();
    let bytes: Vec<u8> = kernel.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let names = ["down_blocks.1.resnets.0.conv1", "down_blocks.1.resnets.0.conv2"];
    let tensors: Vec<_> = names.iter().map(|n| (format!("{n}.weight"), StoredDType::F32, vec![c, c, 3, 3], bytes.clone())).collect();
    write_safetensors(&path, &tensors, &Default::default()).unwrap();
    let mut store = WeightStore::new(&path);
    store.add_file(&SafetensorsFile::open(&path).unwrap()).unwrap();
    let loader = store.loader("unet", &dev, DType::F32);
    let conv = |name: &str| Conv2d::load(&loader.root().pp(name), c, c, Conv2dConfig::K3, false).unwrap();
    let (direct_first, winograd_first) = (conv(names[0]), conv(names[1]));
    let (small, mid) = (rng.randn(&[1, c, 8, 8], &dev).unwrap(), rng.randn(&[1, c, 16, 16], &dev).unwrap());
    let flat = |t: candle_core::Result<Tensor>| t.unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    set_compute(Compute::Bf16).unwrap();
    let got = [
        flat(direct_first.forward(&small)),
        flat(direct_first.forward(&mid)),
        flat(winograd_first.forward(&mid)),
        flat(winograd_first.forward(&small)),
    ];
    set_compute(Compute::F32).unwrap();
    let (direct_small, direct_mid) = (flat(conv3x3_bf16(&small, &kernel)), flat(conv3x3_bf16(&mid, &kernel)));
    let winograd_mid = flat(conv3x3_winograd_bf16(&mid, &kernel));
    // `assert!` on the comparisons: a failure would otherwise print 65 536 values.
    assert!(direct_mid != winograd_mid, "the two kernels must differ for this check to tell them apart");
    assert!(got[0] == direct_small, "8x8: the direct kernel");
    assert!(got[1] == direct_mid, "16x16 after 8x8: the kept direct form");
    assert!(got[2] == winograd_mid, "16x16 first: Winograd");
    assert!(got[3] == direct_small, "8x8 after 16x16: the direct kernel, rounded per call");
}

/// Under bf16 compute (and on AVX2 under f32 compute, for a weight this small) a
/// feed-forward's GEGLU projection is made and consumed a block of rows at a time
/// (`Linear::forward_geglu`): over several blocks and a short last one, with a bias,
/// its values are those of the projection followed by the GEGLU op, to the bit, in
/// both; and the f32 one is the plain formula's.
fn geglu_projection_by_blocks_matches_the_two_ops() {
    use brume::layers::Linear;
    use brume::loading::safetensors::{write_safetensors, SafetensorsFile, StoredDType};
    use brume::loading::WeightStore;
    use candle_core::{DType, Device, Tensor};
    let dev = Device::Cpu;
    let mut rng = brume::samplers::Rng::new(11);
    // 2560 outputs: 1100 rows are five blocks of 192 and a tail under bf16, two
    // blocks of 512 and a tail under f32.
    let (k, n, rows) = (64, 2560, 1100);
    let w = (rng.randn(&[n, k], &dev).unwrap() * 0.2).unwrap();
    let b = rng.randn(&[n], &dev).unwrap();
    let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ff.safetensors");
    let name = "mid_block.attentions.0.transformer_blocks.0.ff.net.0.proj";
    let tensors = vec![
        (format!("{name}.weight"), StoredDType::F32, vec![n, k], bytes(&w)),
        (format!("{name}.bias"), StoredDType::F32, vec![n], bytes(&b)),
    ];
    write_safetensors(&path, &tensors, &Default::default()).unwrap();
    let mut store = WeightStore::new(&path);
    store.add_file(&SafetensorsFile::open(&path).unwrap()).unwrap();
    let loader = store.loader("unet", &dev, DType::F32);
    let mut ws = loader.root();
    for part in name.split('.') {
        ws = ws.pp(part);
    }
    let proj = Linear::load(&ws, k, n, true).unwrap();
    let x = rng.randn(&[2, rows / 2, k], &dev).unwrap();
    let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let plain = |h: Tensor| {
        let (a, g) = (h.narrow(2, 0, n / 2).unwrap(), h.narrow(2, n / 2, n / 2).unwrap());
        (a * g.gelu_erf().unwrap()).unwrap()
    };
    let f32_fused = proj.forward_geglu(&x).unwrap();
    assert_eq!(f32_fused.dims(), &[2, rows / 2, n / 2]);
    let e = rel_err(&f32_fused, &plain(proj.forward(&x).unwrap()));
    assert!(e <= 1e-6, "f32 GEGLU vs the plain formula: {e:.2e}");
    let f32_two_ops = brume::kernels::geglu::geglu(&proj.forward(&x).unwrap()).unwrap();
    assert_eq!(flat(f32_fused.clone()), flat(f32_two_ops), "f32 GEGLU by blocks must give the two ops' values");
    if !brume::kernels::conv3x3_bf16::supported() {
        return;
    }
    set_compute(Compute::Bf16).unwrap();
    let fused = proj.forward_geglu(&x).unwrap();
    let two_ops = brume::kernels::geglu::geglu(&proj.forward(&x).unwrap()).unwrap();
    set_compute(Compute::F32).unwrap();
    assert_eq!(fused.dims(), two_ops.dims());
    assert_eq!(flat(fused.clone()), flat(two_ops), "GEGLU by blocks must give the two ops' values");
    let e = rel_err(&fused, &f32_fused);
    assert!(e > 1e-6 && e <= 1e-2, "bf16 GEGLU projection vs f32: {e:.2e}");
}
