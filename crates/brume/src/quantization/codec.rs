//! Encoding f32 weights under a scheme, and decoding them back, a run of output
//! channels at a time (the runtime expands one layer into a scratch buffer).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

use super::error::QuantError;
use super::kmeans::{kmeans_1d, nearest};
use super::pack::{pack, unpack_lookup};
use super::scheme::{Bits, LutGranularity, Scheme};

/// Ternary codes: 0 = -1, 1 = 0, 2 = +1 (3 is invalid).
const TERNARY_ZERO: u8 = 1;
/// TWN's threshold: values under 0.7 x mean |w| of their channel become 0.
const TERNARY_THRESHOLD: f32 = 0.7;

/// `(out channels, values per channel)` of a shape; a 0-d tensor is one channel.
pub fn channels(shape: &[usize]) -> (usize, usize) {
    let out = shape.first().copied().unwrap_or(1);
    let numel: usize = shape.iter().product();
    (out, numel.checked_div(out).unwrap_or(0))
}

fn f32_bytes(v: impl IntoIterator<Item = f32>) -> Vec<u8> {
    v.into_iter().flat_map(f32::to_le_bytes).collect()
}

fn f16_bytes(v: impl IntoIterator<Item = f32>) -> Vec<u8> {
    v.into_iter().flat_map(|x| f16::from_f32(x).to_le_bytes()).collect()
}

/// Encodes `values` (row-major, `shape`) into the bytes of each of
/// `scheme.parts(shape)`, in that order. `seed` makes k-means reproducible.
pub fn encode(scheme: Scheme, values: &[f32], shape: &[usize], seed: u64) -> Result<Vec<Vec<u8>>, QuantError> {
    let numel: usize = shape.iter().product();
    if values.len() != numel {
        return Err(QuantError::Values {
            reason: format!("{} values for shape {shape:?}", values.len()),
        });
    }
    if !scheme.is_float() {
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(QuantError::Values {
                reason: format!("value {} at flat index {i} is not finite", values[i]),
            });
        }
    }
    let (out, row) = channels(shape);
    Ok(match scheme {
        Scheme::F32 => vec![f32_bytes(values.iter().copied())],
        Scheme::F16 => vec![f16_bytes(values.iter().copied())],
        Scheme::BF16 => vec![values.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect()],
        Scheme::Int8 => {
            let mut q = Vec::with_capacity(numel);
            let mut scales = Vec::with_capacity(out);
            for r in values.chunks(row.max(1)).take(out) {
                let max = r.iter().fold(0f32, |m, v| m.max(v.abs()));
                let s = max / 127.0;
                scales.push(s);
                q.extend(r.iter().map(|&v| if s > 0.0 { (v / s).round().clamp(-127.0, 127.0) as i8 as u8 } else { 0 }));
            }
            vec![q, f32_bytes(scales)]
        }
        Scheme::Ternary => {
            let mut codes = Vec::with_capacity(numel);
            let mut scales = Vec::with_capacity(out);
            for r in values.chunks(row.max(1)).take(out) {
                let mean = r.iter().map(|v| v.abs() as f64).sum::<f64>() / r.len().max(1) as f64;
                let delta = TERNARY_THRESHOLD * mean as f32;
                let kept: Vec<f32> = r.iter().map(|v| v.abs()).filter(|&a| a > delta).collect();
                let s = if kept.is_empty() { 0.0 } else { kept.iter().map(|&a| a as f64).sum::<f64>() / kept.len() as f64 };
                let s16 = f16::from_f64(s).to_f32();
                scales.push(s16);
                codes.extend(r.iter().map(|&v| if v.abs() <= delta || s16 == 0.0 { TERNARY_ZERO } else if v > 0.0 { 2 } else { 0 }));
            }
            vec![pack(&codes, Bits::B2), f16_bytes(scales)]
        }
        Scheme::Palettize { bits, lut } => {
            let g = lut.group_size(out);
            // Groups are independent: cluster them in parallel, in a fixed order.
            let per_group: Vec<(Vec<u8>, Vec<f32>)> = values
                .par_chunks((g * row).max(1))
                .enumerate()
                .map(|(gi, chunk)| {
                    let centres = kmeans_1d(chunk, bits.levels(), seed ^ (gi as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                    // The table is stored in fp16: assign against the rounded entries.
                    let mut table: Vec<f32> = centres.iter().map(|&c| f16::from_f32(c).to_f32()).collect();
                    table.sort_by(f32::total_cmp);
                    (chunk.iter().map(|&v| nearest(&table, v) as u8).collect(), table)
                })
                .collect();
            let mut indices = Vec::with_capacity(numel);
            let mut tables = Vec::with_capacity(lut.groups(out) * bits.levels());
            for (i, t) in per_group {
                indices.extend(i);
                tables.extend(t);
            }
            // A tensor with no values still stores its (zero) tables.
            tables.resize(lut.groups(out) * bits.levels(), 0.0);
            vec![pack(&indices, bits), f16_bytes(tables)]
        }
    })
}

/// A compressed tensor's parts, borrowed (from a memory map), ready to decode.
/// Byte counts are validated by [`Decoder::new`], so decoding cannot read out of range.
#[derive(Debug, Clone, Copy)]
pub struct Decoder<'a> {
    scheme: Scheme,
    out: usize,
    row: usize,
    main: &'a [u8],
    aux: &'a [u8],
}

impl<'a> Decoder<'a> {
    /// `parts` are the bytes of `scheme.parts(shape)` in order.
    pub fn new(scheme: Scheme, shape: &[usize], parts: &[&'a [u8]]) -> Result<Self, QuantError> {
        let want = scheme.parts(shape);
        if parts.len() != want.len() {
            return Err(QuantError::BadMetadata {
                reason: format!("{} parts given, scheme {scheme} has {}", parts.len(), want.len()),
            });
        }
        for (p, w) in parts.iter().zip(&want) {
            if p.len() != w.nbytes() {
                return Err(QuantError::PartMismatch {
                    part: if w.suffix.is_empty() { "data".into() } else { w.suffix.trim_start_matches('.').into() },
                    found: format!("{} bytes", p.len()),
                    found_shape: vec![],
                    expected: format!("{} bytes of {}", w.nbytes(), w.dtype),
                    expected_shape: w.shape.clone(),
                });
            }
        }
        let (out, row) = channels(shape);
        Ok(Self {
            scheme,
            out,
            row,
            main: parts[0],
            aux: parts.get(1).copied().unwrap_or(&[]),
        })
    }

    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// Output channels and values per channel.
    pub fn rows(&self) -> (usize, usize) {
        (self.out, self.row)
    }

    /// Decodes output channels `first..first + out.len() / row` into `out` (f32).
    pub fn decode_rows(&self, first: usize, out: &mut [f32]) -> Result<(), QuantError> {
        let row = self.row;
        if row == 0 {
            return Ok(());
        }
        let n_rows = out.len() / row;
        debug_assert!(first + n_rows <= self.out && out.len() == n_rows * row);
        let start = first * row;
        match self.scheme {
            Scheme::F32 => {
                for (o, c) in out.iter_mut().zip(self.main[start * 4..].chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Scheme::F16 => {
                let src = &self.main[start * 2..(start + out.len()) * 2];
                if cfg!(target_endian = "little") && src.as_ptr().align_offset(2) == 0 {
                    // SAFETY: the bytes are 2-aligned (checked), `out.len()` f16 long, and
                    // every bit pattern is a valid f16; on little-endian targets the file's
                    // layout is the in-memory layout.
                    let halves = unsafe { std::slice::from_raw_parts(src.as_ptr() as *const f16, out.len()) };
                    // Uses the CPU's conversion instructions (F16C) when present.
                    halves.convert_to_f32_slice(out);
                } else {
                    for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                        *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
                    }
                }
            }
            Scheme::BF16 => {
                for (o, c) in out.iter_mut().zip(self.main[start * 2..].chunks_exact(2)) {
                    *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            Scheme::Int8 => {
                for (r, o) in out.chunks_exact_mut(row).enumerate() {
                    let ch = first + r;
                    let s = f32::from_le_bytes(self.aux[ch * 4..ch * 4 + 4].try_into().unwrap_or([0; 4]));
                    for (v, &q) in o.iter_mut().zip(&self.main[ch * row..(ch + 1) * row]) {
                        *v = q as i8 as f32 * s;
                    }
                }
            }
            Scheme::Ternary => {
                // Any 2-bit code 3 in these channels' bytes makes the file invalid.
                let lo = (start * 2) / 8;
                let hi = ((start + out.len()) * 2).div_ceil(8);
                if self.main[lo..hi].iter().any(|&b| (b & (b >> 1) & 0x55) != 0) {
                    // Only codes inside the range count: recheck precisely.
                    let mut codes = vec![0u8; out.len()];
                    super::pack::unpack(self.main, Bits::B2, start, &mut codes);
                    if codes.contains(&3) {
                        return Err(QuantError::BadTernaryCode);
                    }
                }
                for (r, o) in out.chunks_exact_mut(row).enumerate() {
                    let ch = first + r;
                    let s = f16::from_le_bytes([self.aux[ch * 2], self.aux[ch * 2 + 1]]).to_f32();
                    unpack_lookup(self.main, Bits::B2, ch * row, &[-s, 0.0, s, 0.0], o);
                }
            }
            Scheme::Palettize { bits, lut } => {
                let g = lut.group_size(self.out);
                let levels = bits.levels();
                let mut table = vec![0f32; levels];
                let mut r = 0;
                while r < n_rows {
                    let ch = first + r;
                    let group = ch / g;
                    let run = ((group + 1) * g).min(first + n_rows) - ch;
                    for (t, c) in table.iter_mut().zip(self.aux[group * levels * 2..].chunks_exact(2)) {
                        *t = f16::from_le_bytes([c[0], c[1]]).to_f32();
                    }
                    unpack_lookup(self.main, bits, ch * row, &table, &mut out[r * row..(r + run) * row]);
                    r += run;
                }
            }
        }
        Ok(())
    }

    /// The whole tensor as f32.
    pub fn decode_all(&self) -> Result<Vec<f32>, QuantError> {
        let mut v = vec![0f32; self.out * self.row];
        self.decode_rows(0, &mut v)?;
        Ok(v)
    }
}

/// Checks a lookup-table shape against the scheme (used when opening files).
pub fn expected_lut(bits: Bits, lut: LutGranularity, out: usize) -> [usize; 2] {
    [lut.groups(out), bits.levels()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn randn(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::samplers::Rng::new(seed);
        rng.randn(&[n], &candle_core::Device::Cpu).unwrap().to_vec1::<f32>().unwrap()
    }

    fn round_trip(scheme: Scheme, values: &[f32], shape: &[usize]) -> Vec<f32> {
        let parts = encode(scheme, values, shape, 9).unwrap();
        let wanted = scheme.parts(shape);
        for (p, w) in parts.iter().zip(&wanted) {
            assert_eq!(p.len(), w.nbytes(), "{scheme} part {}", w.suffix);
        }
        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        Decoder::new(scheme, shape, &refs).unwrap().decode_all().unwrap()
    }

    /// sqrt(mean squared error) / sqrt(mean square of the values).
    fn rel_rmse(a: &[f32], b: &[f32]) -> f64 {
        let e: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let s: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        (e / s).sqrt()
    }

    #[test]
    fn error_bounds_per_scheme() {
        let shape = [48, 40, 3, 3];
        let n: usize = shape.iter().product();
        // Channels of different magnitudes, as real layers have.
        let v: Vec<f32> = randn(n, 1).iter().enumerate().map(|(i, x)| x * (1.0 + (i / 360) as f32 * 0.1)).collect();
        assert_eq!(round_trip(Scheme::F32, &v, &shape), v);
        let h = round_trip(Scheme::F16, &v, &shape);
        assert!(h.iter().zip(&v).all(|(a, b)| (a - b).abs() <= b.abs() * 4.9e-4 + 1e-7));
        let b = round_trip(Scheme::BF16, &v, &shape);
        assert!(b.iter().zip(&v).all(|(a, x)| (a - x).abs() <= x.abs() * 3.9e-3 + 1e-7));
        // int8: every value within half a step of its channel's scale.
        let q = round_trip(Scheme::Int8, &v, &shape);
        for (c, (qr, vr)) in q.chunks(360).zip(v.chunks(360)).enumerate() {
            let step = vr.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
            assert!(qr.iter().zip(vr).all(|(a, x)| (a - x).abs() <= step * 0.5 + 1e-6), "channel {c}");
        }
        // Palettized: near the Lloyd-Max distortion of a Gaussian (4 levels: 0.343 relative RMSE,
        // 16: 0.0975; these channels mix scales, so the tails are heavier), measured with ~10% margin.
        for (s, bound) in [("palettize2", 0.42), ("palettize4", 0.13), ("palettize4-g16", 0.11), ("palettize6", 0.033), ("palettize8-g8", 0.006)] {
            let scheme = Scheme::parse(s).unwrap();
            let e = rel_rmse(&round_trip(scheme, &v, &shape), &v);
            assert!(e < bound, "{s}: relative RMSE {e}");
        }
        // Ternary keeps the sign and the channel's scale: better than dropping the layer, worse than 2-bit k-means.
        let t = round_trip(Scheme::Ternary, &v, &shape);
        let e = rel_rmse(&t, &v);
        assert!(e < 0.48, "ternary relative RMSE {e}");
        assert!(t.iter().zip(&v).all(|(a, x)| *a == 0.0 || a.signum() == x.signum()));
    }

    #[test]
    fn exactly_representable_weights_come_back_exactly() {
        let shape = [4, 6];
        let levels = [-1.5f32, -0.25, 0.5, 2.0];
        let v: Vec<f32> = (0..24).map(|i| levels[(i * 7) % 4]).collect();
        assert_eq!(round_trip(Scheme::parse("palettize2").unwrap(), &v, &shape), v);
        let t: Vec<f32> = (0..24).map(|i| [-0.5f32, 0.0, 0.5][i % 3]).collect();
        assert_eq!(round_trip(Scheme::Ternary, &t, &shape), t);
        // Each channel holds 127, so its scale is exactly 1.
        let q: Vec<f32> = (0..24).map(|i| if i % 6 == 0 { 127.0 } else { i as f32 * 9.0 - 110.0 }).collect();
        assert_eq!(round_trip(Scheme::Int8, &q, &shape), q);
    }

    #[test]
    fn decoding_a_channel_range_matches_the_whole() {
        let shape = [37, 13];
        let v = randn(37 * 13, 5);
        for s in ["int8", "ternary", "fp16", "bf16", "palettize6-g5", "palettize4-g3", "palettize2"] {
            let scheme = Scheme::parse(s).unwrap();
            let parts = encode(scheme, &v, &shape, 1).unwrap();
            let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
            let d = Decoder::new(scheme, &shape, &refs).unwrap();
            let all = d.decode_all().unwrap();
            for (first, n) in [(0, 1), (4, 7), (11, 26), (36, 1)] {
                let mut part = vec![0f32; n * 13];
                d.decode_rows(first, &mut part).unwrap();
                assert_eq!(part, all[first * 13..(first + n) * 13], "{s} rows {first}+{n}");
            }
        }
    }

    #[test]
    fn encoding_is_deterministic_and_rejects_bad_values() {
        let v = randn(64 * 32, 2);
        let s = Scheme::parse("palettize4-g16").unwrap();
        assert_eq!(encode(s, &v, &[64, 32], 3).unwrap(), encode(s, &v, &[64, 32], 3).unwrap());
        let mut bad = v.clone();
        bad[5] = f32::NAN;
        assert!(matches!(encode(s, &bad, &[64, 32], 3), Err(QuantError::Values { .. })));
        assert!(matches!(encode(s, &v, &[64, 31], 3), Err(QuantError::Values { .. })));
    }

    #[test]
    fn invalid_ternary_codes_and_wrong_sizes_are_errors() {
        let shape = [2, 4];
        let mut parts = encode(Scheme::Ternary, &[1.0, -1.0, 0.0, 1.0, 1.0, 1.0, -1.0, 0.0], &shape, 0).unwrap();
        parts[0][1] = 0xff;
        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let d = Decoder::new(Scheme::Ternary, &shape, &refs).unwrap();
        assert!(d.decode_rows(0, &mut [0.0; 4]).is_ok());
        assert_eq!(d.decode_rows(1, &mut [0.0; 4]), Err(QuantError::BadTernaryCode));
        let short = [&refs[0][..1], refs[1]];
        assert!(matches!(Decoder::new(Scheme::Ternary, &shape, &short), Err(QuantError::PartMismatch { .. })));
    }
}
