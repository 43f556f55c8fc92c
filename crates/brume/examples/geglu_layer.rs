//! Times a feed-forward's GEGLU projection as the layers run it
//! (`Linear::forward_geglu`, in-place f32 weight with a bias) against the two ops it
//! replaces (the projection, then the GEGLU op), alternated in one process: SD 1.5's
//! 64x64 level by default (4096 tokens, 320 -> 2560).
//!
//! `cargo run --release -p brume --example geglu_layer -- [ROWS K N REPS]`

use brume::layers::Linear;
use brume::loading::safetensors::{write_safetensors, SafetensorsFile, StoredDType};
use brume::loading::WeightStore;
use candle_core::{DType, Device, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args().skip(1).map(|s| s.parse()).collect::<Result<_, _>>()?;
    let [rows, k, n, reps] = match args[..] {
        [] => [4096, 320, 2560, 15],
        [a, b, c, d] => [a, b, c, d],
        _ => return Err("usage: geglu_layer [ROWS K N REPS]".into()),
    };
    if n % 2 != 0 || reps == 0 {
        return Err("N must be even and REPS at least 1".into());
    }
    let dev = Device::Cpu;
    let w = (Tensor::randn(0f32, 1.0, (n, k), &dev)? * (1.0 / (k as f64).sqrt()))?;
    let b = Tensor::randn(0f32, 1.0, n, &dev)?;
    let bytes = |t: &Tensor| -> candle_core::Result<Vec<u8>> { Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().flat_map(|v| v.to_le_bytes()).collect()) };
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("ff.safetensors");
    let name = "ff.net.0.proj";
    let tensors = vec![
        (format!("{name}.weight"), StoredDType::F32, vec![n, k], bytes(&w)?),
        (format!("{name}.bias"), StoredDType::F32, vec![n], bytes(&b)?),
    ];
    write_safetensors(&path, &tensors, &Default::default())?;
    let mut store = WeightStore::new(&path);
    store.add_file(&SafetensorsFile::open(&path)?)?;
    let loader = store.loader("unet", &dev, DType::F32);
    let mut ws = loader.root();
    for part in name.split('.') {
        ws = ws.pp(part);
    }
    let proj = Linear::load(&ws, k, n, true)?;
    let x = Tensor::randn(0f32, 1.0, (1, rows, k), &dev)?;
    let (mut fused, mut two) = (Vec::new(), Vec::new());
    let mut same = true;
    for _ in 0..reps {
        let t = std::time::Instant::now();
        let a = proj.forward_geglu(&x)?;
        fused.push(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        let c = brume::kernels::geglu::geglu(&proj.forward(&x)?)?;
        two.push(t.elapsed().as_secs_f64());
        same &= a.flatten_all()?.to_vec1::<f32>()? == c.flatten_all()?.to_vec1::<f32>()?;
    }
    for v in [&mut fused, &mut two] {
        v.sort_by(f64::total_cmp);
    }
    let med = |v: &[f64]| v[v.len() / 2];
    println!(
        "{rows} x {k} -> {n} with GEGLU: forward_geglu median {:.4} s (min {:.4}), two ops median {:.4} s (min {:.4}); same values: {same}",
        med(&fused),
        fused[0],
        med(&two),
        two[0]
    );
    Ok(())
}
