//! `TorchRng` against draws made by torch itself (`tools/torch_rng/make_fixtures.py`):
//! every value compared by its f32 bits, sequences from one generator included.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use brume::loading::safetensors::{SafetensorsFile, StoredDType};
use brume::samplers::{noise_source, NoiseSource, RngKind, TorchRng};
use candle_core::Device;

fn fixture() -> Arc<SafetensorsFile> {
    let path = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/torch_rng/randn.safetensors"));
    SafetensorsFile::open(&path).unwrap_or_else(|e| panic!("{e}"))
}

fn words<const N: usize>(f: &SafetensorsFile, name: &str, dtype: StoredDType) -> Vec<[u8; N]> {
    let e = f.entry(name).unwrap_or_else(|| panic!("fixture lacks {name}"));
    assert_eq!(e.dtype, dtype, "{name}");
    f.bytes(e).chunks_exact(N).map(|c| c.try_into().unwrap()).collect()
}

fn f32_bits(f: &SafetensorsFile, name: &str) -> Vec<u32> {
    words::<4>(f, name, StoredDType::F32).into_iter().map(u32::from_le_bytes).collect()
}

/// Checks one draw against the entries under `prefix`; returns how many values were compared bitwise.
fn check(f: &SafetensorsFile, prefix: &str, got: &[f32]) -> usize {
    let bits: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
    let mut compared = 0;
    if f.entry(&format!("{prefix}/full")).is_some() {
        let want = f32_bits(f, &format!("{prefix}/full"));
        assert_eq!(want.len(), bits.len(), "{prefix}: length");
        if let Some(i) = (0..want.len()).find(|&i| want[i] != bits[i]) {
            panic!("{prefix}: first difference at {i}: {} vs torch {}", got[i], f32::from_bits(want[i]));
        }
        compared = want.len();
    } else {
        let head = f32_bits(f, &format!("{prefix}/head"));
        let tail = f32_bits(f, &format!("{prefix}/tail"));
        assert_eq!(&bits[..head.len()], &head[..], "{prefix}: head");
        assert_eq!(&bits[bits.len() - tail.len()..], &tail[..], "{prefix}: tail");
    }
    // Exact checksums of the whole draw (over the f32 bit patterns, wrapping).
    let want: Vec<u64> = words::<8>(f, &format!("{prefix}/bits"), StoredDType::I64).into_iter().map(u64::from_le_bytes).collect();
    let s1 = bits.iter().fold(0u64, |a, &b| a.wrapping_add(b as u64));
    let s2 = bits.iter().enumerate().fold(0u64, |a, (i, &b)| a.wrapping_add((i as u64 + 1).wrapping_mul(b as u64)));
    assert_eq!([s1, s2], want[..], "{prefix}: bit checksums");
    let sums: Vec<f64> = words::<8>(f, &format!("{prefix}/sums"), StoredDType::F64).into_iter().map(f64::from_le_bytes).collect();
    let sum: f64 = got.iter().map(|&v| v as f64).sum();
    let sq: f64 = got.iter().map(|&v| (v as f64) * (v as f64)).sum();
    assert!((sum - sums[0]).abs() <= 1e-9 * sums[1].max(1.0), "{prefix}: sum {sum} vs {}", sums[0]);
    assert!((sq - sums[1]).abs() <= 1e-12 * sums[1].max(1.0), "{prefix}: sum of squares {sq} vs {}", sums[1]);
    compared.max(bits.len())
}

fn numel(shape: &str) -> usize {
    shape.split('x').map(|d| d.parse::<usize>().unwrap()).product()
}

#[test]
fn single_draws_match_torch_bitwise() {
    let f = fixture();
    let mut draws = 0;
    for name in f.entries().keys().filter(|n| n.starts_with("single/") && n.ends_with("/bits")) {
        let parts: Vec<&str> = name.split('/').collect();
        let (seed, shape) = (parts[1].parse::<u64>().unwrap(), parts[2]);
        let got = TorchRng::new(seed).randn_f32(numel(shape));
        check(&f, &format!("single/{seed}/{shape}"), &got);
        draws += 1;
    }
    assert_eq!(draws, 6 * 10, "every seed x shape of the fixture script");
    // The bitwise-in-full latent-sized draw is present.
    assert!(f.entry("single/42/1x4x64x64/full").is_some());
}

#[test]
fn sequences_from_one_generator_match_torch_bitwise() {
    let f = fixture();
    // seq<k> -> (seed, [(step, shape)])
    let mut seqs: BTreeMap<String, (u64, Vec<(usize, String)>)> = BTreeMap::new();
    for name in f.entries().keys().filter(|n| n.starts_with("seq") && n.ends_with("/bits")) {
        let parts: Vec<&str> = name.split('/').collect();
        let e = seqs.entry(parts[0].to_string()).or_insert((parts[1].parse().unwrap(), Vec::new()));
        e.1.push((parts[2].parse().unwrap(), parts[3].to_string()));
    }
    assert_eq!(seqs.len(), 4);
    for (k, (seed, mut steps)) in seqs {
        steps.sort();
        assert!(steps.len() >= 3);
        let mut rng = TorchRng::new(seed);
        for (i, (step, shape)) in steps.iter().enumerate() {
            assert_eq!(i, *step, "{k}: steps must be consecutive");
            let got = rng.randn_f32(numel(shape));
            check(&f, &format!("{k}/{seed}/{step}/{shape}"), &got);
        }
    }
}

#[test]
fn noise_source_gives_the_torch_tensor() {
    let f = fixture();
    let mut src = noise_source(RngKind::Torch, 42);
    let t = src.randn(&[1, 4, 64, 64], &Device::Cpu).unwrap();
    assert_eq!(t.dims(), [1, 4, 64, 64]);
    let got = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    check(&f, "single/42/1x4x64x64", &got);
    // Also through the trait on the struct itself, continuing the same generator.
    let mut rng = TorchRng::new(42);
    let _ = NoiseSource::randn(&mut rng, &[1, 4, 64, 64], &Device::Cpu).unwrap();
    let second = NoiseSource::randn(&mut rng, &[1, 4, 64, 64], &Device::Cpu).unwrap();
    check(&f, "seq0/42/1/1x4x64x64", &second.flatten_all().unwrap().to_vec1::<f32>().unwrap());
}

#[test]
fn rng_kind_parses_cli_names() {
    assert_eq!(RngKind::parse("torch").unwrap(), RngKind::Torch);
    assert_eq!(RngKind::parse("brume").unwrap(), RngKind::Brume);
    let err = RngKind::parse("numpy").unwrap_err().to_string();
    assert!(err.contains("numpy") && err.contains("brume") && err.contains("torch"), "{err}");
}
