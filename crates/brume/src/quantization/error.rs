//! What can be wrong with a compressed tensor or a precision policy.

/// Errors in schemes, policies and compressed tensors. Loading wraps them in
/// [`crate::LoadError::Quantized`] with the file and tensor named.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error(
        "unknown precision scheme `{scheme}` (known: fp32, fp16, bf16, int8, ternary, palettizeN or palettizeN-gG \
         with N in 2, 4, 6, 8 and G output channels per lookup table)"
    )]
    UnknownScheme { scheme: String },
    #[error("lookup table is {found:?} but {bits}-bit indices over {groups} group(s) need [{groups}, {levels}] (F16)")]
    LutSize {
        bits: u32,
        groups: usize,
        levels: usize,
        found: Vec<usize>,
    },
    #[error("packed data holds {found} bytes but shape {shape:?} at {bits} bits per value needs {expected}")]
    IndexBytes {
        shape: Vec<usize>,
        bits: u32,
        expected: usize,
        found: usize,
    },
    #[error("companion tensor `{companion}` is missing")]
    MissingCompanion { companion: String },
    #[error("part `{part}` has dtype {found} and shape {found_shape:?}; the scheme needs {expected} {expected_shape:?}")]
    PartMismatch {
        part: String,
        found: String,
        found_shape: Vec<usize>,
        expected: String,
        expected_shape: Vec<usize>,
    },
    #[error("the precision metadata names a tensor the file does not hold")]
    MissingData,
    #[error("invalid precision metadata: {reason}")]
    BadMetadata { reason: String },
    #[error("ternary data holds the invalid 2-bit code 3 (valid: 0 = -1, 1 = 0, 2 = +1)")]
    BadTernaryCode,
    #[error("policy {origin} line {line}: {reason}")]
    Policy { origin: String, line: usize, reason: String },
    #[error("cannot quantize: {reason}")]
    Values { reason: String },
}
