//! How one tensor is stored: the precision schemes of the precision tiers.
//!
//! A scheme fixes the on-disk parts of a tensor (the main data and its companion
//! tensors) and therefore its size, without looking at the numbers. That is what
//! lets a converter write a safetensors header before quantizing anything, and a
//! loader check a file's byte counts against the shape before trusting it.

use std::fmt;
use std::num::NonZeroUsize;

use super::error::QuantError;
use crate::loading::safetensors::StoredDType;

/// Bit widths of palettized indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bits {
    B2,
    B4,
    B6,
    B8,
}

impl Bits {
    pub const ALL: [Bits; 4] = [Bits::B2, Bits::B4, Bits::B6, Bits::B8];

    pub fn get(self) -> u32 {
        match self {
            Bits::B2 => 2,
            Bits::B4 => 4,
            Bits::B6 => 6,
            Bits::B8 => 8,
        }
    }

    pub fn from_u32(n: u32) -> Option<Self> {
        Some(match n {
            2 => Bits::B2,
            4 => Bits::B4,
            6 => Bits::B6,
            8 => Bits::B8,
            _ => return None,
        })
    }

    /// Lookup-table entries: 2^bits.
    pub fn levels(self) -> usize {
        1 << self.get()
    }

    /// Bytes holding `count` packed indices.
    pub fn packed_len(self, count: usize) -> usize {
        (count * self.get() as usize).div_ceil(8)
    }
}

/// How the output channels of a palettized tensor share lookup tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LutGranularity {
    /// One table for the whole tensor.
    PerTensor,
    /// One table per run of this many output channels (the last run may be shorter).
    PerGroup(NonZeroUsize),
}

impl LutGranularity {
    /// Output channels per table for a tensor with `out` channels.
    pub fn group_size(self, out: usize) -> usize {
        match self {
            LutGranularity::PerTensor => out.max(1),
            LutGranularity::PerGroup(g) => g.get(),
        }
    }

    pub fn groups(self, out: usize) -> usize {
        out.div_ceil(self.group_size(out)).max(1)
    }
}

/// A tensor's storage scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scheme {
    F32,
    F16,
    BF16,
    /// int8 values, symmetric, one f32 scale per output channel (dim 0).
    Int8,
    /// k-means palettization: n-bit indices into fp16 lookup tables.
    Palettize { bits: Bits, lut: LutGranularity },
    /// -1 / 0 / +1 (2-bit codes) times one fp16 scale per output channel.
    Ternary,
}

/// Suffix of the companion tensor holding lookup tables (`<name>.lut`).
pub const LUT_SUFFIX: &str = ".lut";
/// Suffix of the companion tensor holding per-channel scales (`<name>.scale`).
pub const SCALE_SUFFIX: &str = ".scale";

/// One stored part of an encoded tensor: the main data has an empty suffix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub suffix: &'static str,
    pub dtype: StoredDType,
    pub shape: Vec<usize>,
}

impl Part {
    pub fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

impl Scheme {
    /// Parses `fp32`, `fp16`, `bf16`, `int8`, `ternary`, `palettize4` (one table per
    /// tensor) or `palettize4-g16` (one per 16 output channels), for 2, 4, 6, 8 bits.
    pub fn parse(s: &str) -> Result<Self, QuantError> {
        let unknown = || QuantError::UnknownScheme { scheme: s.to_string() };
        Ok(match s {
            "fp32" | "f32" => Scheme::F32,
            "fp16" | "f16" => Scheme::F16,
            "bf16" => Scheme::BF16,
            "int8" => Scheme::Int8,
            "ternary" => Scheme::Ternary,
            _ => {
                let rest = s.strip_prefix("palettize").ok_or_else(unknown)?;
                let (bits, group) = match rest.split_once("-g") {
                    Some((b, g)) => (b, Some(g)),
                    None => (rest, None),
                };
                let bits = bits.parse::<u32>().ok().and_then(Bits::from_u32).ok_or_else(unknown)?;
                let lut = match group {
                    None => LutGranularity::PerTensor,
                    Some(g) => LutGranularity::PerGroup(g.parse::<NonZeroUsize>().map_err(|_| unknown())?),
                };
                Scheme::Palettize { bits, lut }
            }
        })
    }

    /// Whether the tensor is stored as plain floats (no companion tensors).
    pub fn is_float(self) -> bool {
        matches!(self, Scheme::F32 | Scheme::F16 | Scheme::BF16)
    }

    /// The stored dtype of a plain-float scheme.
    pub fn float_dtype(self) -> Option<StoredDType> {
        match self {
            Scheme::F32 => Some(StoredDType::F32),
            Scheme::F16 => Some(StoredDType::F16),
            Scheme::BF16 => Some(StoredDType::BF16),
            _ => None,
        }
    }

    /// What a tensor of `shape` is stored as under this scheme: the main part first.
    /// Output channels are dim 0 (a 0-d tensor counts as one channel of one value).
    pub fn parts(self, shape: &[usize]) -> Vec<Part> {
        let numel: usize = shape.iter().product();
        let out = shape.first().copied().unwrap_or(1);
        let main = |dtype, shape: Vec<usize>| Part { suffix: "", dtype, shape };
        match self {
            Scheme::F32 | Scheme::F16 | Scheme::BF16 => {
                vec![main(self.float_dtype().unwrap_or(StoredDType::F32), shape.to_vec())]
            }
            Scheme::Int8 => vec![
                main(StoredDType::I8, shape.to_vec()),
                Part { suffix: SCALE_SUFFIX, dtype: StoredDType::F32, shape: vec![out] },
            ],
            Scheme::Palettize { bits, lut } => vec![
                main(StoredDType::U8, vec![bits.packed_len(numel)]),
                Part { suffix: LUT_SUFFIX, dtype: StoredDType::F16, shape: vec![lut.groups(out), bits.levels()] },
            ],
            Scheme::Ternary => vec![
                main(StoredDType::U8, vec![Bits::B2.packed_len(numel)]),
                Part { suffix: SCALE_SUFFIX, dtype: StoredDType::F16, shape: vec![out] },
            ],
        }
    }

    /// Total stored bytes of a tensor of `shape`.
    pub fn nbytes(self, shape: &[usize]) -> usize {
        self.parts(shape).iter().map(Part::nbytes).sum()
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scheme::F32 => f.write_str("fp32"),
            Scheme::F16 => f.write_str("fp16"),
            Scheme::BF16 => f.write_str("bf16"),
            Scheme::Int8 => f.write_str("int8"),
            Scheme::Ternary => f.write_str("ternary"),
            Scheme::Palettize { bits, lut: LutGranularity::PerTensor } => write!(f, "palettize{}", bits.get()),
            Scheme::Palettize { bits, lut: LutGranularity::PerGroup(g) } => write!(f, "palettize{}-g{g}", bits.get()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_errors() {
        for s in ["fp32", "fp16", "bf16", "int8", "ternary", "palettize2", "palettize4-g16", "palettize6", "palettize8-g1"] {
            assert_eq!(Scheme::parse(s).unwrap().to_string(), s);
        }
        for bad in ["int4", "palettize3", "palettize4-g0", "palettize4-gx", "fp8", ""] {
            assert!(matches!(Scheme::parse(bad), Err(QuantError::UnknownScheme { .. })), "{bad}");
        }
    }

    #[test]
    fn sizes_follow_the_scheme() {
        let shape = [320, 320, 3, 3];
        let n = 320 * 320 * 9;
        assert_eq!(Scheme::F16.nbytes(&shape), 2 * n);
        assert_eq!(Scheme::Int8.nbytes(&shape), n + 4 * 320);
        let p4 = Scheme::parse("palettize4-g16").unwrap();
        assert_eq!(p4.nbytes(&shape), n / 2 + 20 * 16 * 2);
        let p6 = Scheme::parse("palettize6").unwrap();
        assert_eq!(p6.nbytes(&[3, 5]), (15 * 6usize).div_ceil(8) + 64 * 2);
        assert_eq!(Scheme::Ternary.nbytes(&[7, 3]), 6 + 7 * 2);
        // A last, shorter group still gets its own table.
        let g = LutGranularity::PerGroup(NonZeroUsize::new(16).unwrap());
        assert_eq!(g.groups(33), 3);
        assert_eq!(LutGranularity::PerTensor.groups(33), 1);
    }
}
