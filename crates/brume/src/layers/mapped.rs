//! Weights used in place from a memory-mapped file.
//!
//! candle's CPU tensors own their memory, so turning a mapped weight into a
//! `Tensor` copies it into private, dirty memory: for an fp32 SD 1.5 UNet that is
//! 3.4 GB charged to the process on top of the page cache. When the stored dtype
//! is the compute dtype, our layers instead read the mapped bytes directly in
//! their own CPU kernels (candle custom ops), so weights stay clean, evictable
//! file pages. Only small vectors (biases, norm scales) are copied.

use std::sync::{Arc, OnceLock};

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use gemm::{gemm, Parallelism};

use crate::loading::safetensors::{SafetensorsFile, StoredDType};
use crate::loading::StoredTensor;
use super::epilogue::Epilogue;
use super::packed::EXPAND_BLOCK_VALUES;

/// An f32 matrix or kernel inside a mapped file, aligned for direct use.
#[derive(Debug, Clone)]
pub struct MappedF32 {
    file: Arc<SafetensorsFile>,
    offset: usize,
    len: usize,
    shape: Vec<usize>,
    /// The weight rounded to bf16 and packed for the kernel that multiplies it, made
    /// on first use under `--compute bf16` and kept with the weight (clones share it).
    bf16: Arc<OnceLock<Bf16Weight>>,
}

/// A weight rounded to bf16 and laid out for the bf16 kernels (AMX tiles or
/// AVX512-BF16 vectors): half its f32 bytes, private memory. Kept because rounding
/// and repacking per call cost more than the products at SD's deep levels (a
/// 1280-channel 3x3 kernel is 15 M weights for 3.8 GFLOP at 8x8).
enum Bf16Weight {
    AmxConv3x3(crate::kernels::amx::PackedConv3x3),
    /// A 1x1 kernel as the left factor of `W x`.
    AmxRows(crate::kernels::amx::PackedRows),
    /// A linear weight [out, in] as the right factor of `x W^T`.
    AmxPairs(crate::kernels::amx::PackedPairs),
    Conv3x3(crate::kernels::conv3x3_bf16::PackedConvPairs),
    /// A 3x3 kernel's Winograd F(2x2, 3x3) transform, for large maps.
    Winograd(crate::kernels::winograd_bf16::PackedWinogradPairs),
    /// A 1x1 kernel as the left factor of `W x`.
    Rows(crate::kernels::matmul_bf16::PackedPairRows),
    /// A linear weight [out, in] as the right factor of `x W^T`.
    Strips(crate::kernels::matmul_bf16::PackedStrips),
}

impl std::fmt::Debug for Bf16Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (kind, bytes) = match self {
            Bf16Weight::AmxConv3x3(p) => ("amx-conv3x3", p.bytes()),
            Bf16Weight::AmxRows(p) => ("amx-rows", p.bytes()),
            Bf16Weight::AmxPairs(p) => ("amx-pairs", p.bytes()),
            Bf16Weight::Conv3x3(p) => ("conv3x3", p.bytes()),
            Bf16Weight::Winograd(p) => ("winograd", p.bytes()),
            Bf16Weight::Rows(p) => ("rows", p.bytes()),
            Bf16Weight::Strips(p) => ("strips", p.bytes()),
        };
        write!(f, "Bf16Weight::{kind}({bytes} bytes)")
    }
}

/// The cached bf16 form `$variant` of the mapped weight `$m`, packed on first use
/// by `$pack` (a `&[f32] -> Result<_>` closure over the f32 weight); with `$how` =
/// `bf16_if`, `Ok(None)` where it was packed in another form.
macro_rules! packed_form {
    ($m:expr, $variant:ident, $pack:expr) => {
        packed_form!($m, $variant, $pack, bf16)
    };
    ($m:expr, $variant:ident, $pack:expr, $how:ident) => {
        $m.$how(|w| Ok(Bf16Weight::$variant(($pack)(w)?)), |p| match p {
            Bf16Weight::$variant(x) => Some(x),
            _ => None,
        })
    };
}

impl MappedF32 {
    /// `Some` when `t` can be used in place: stored as F32, 4-byte aligned,
    /// contiguous rows (any transform we produce is a row range or a reshape).
    pub fn from_stored(t: &StoredTensor, shape: &[usize]) -> Option<Self> {
        if t.dtype() != StoredDType::F32 {
            return None;
        }
        let bytes = t.bytes();
        if bytes.as_ptr().align_offset(std::mem::align_of::<f32>()) != 0 {
            return None;
        }
        Some(Self {
            file: t.file.clone(),
            offset: bytes.as_ptr() as usize - t.file.raw().as_ptr() as usize,
            len: bytes.len() / 4,
            shape: shape.to_vec(),
            bf16: Arc::new(OnceLock::new()),
        })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn data(&self) -> &[f32] {
        let entry_bytes = self.file.raw();
        let bytes = &entry_bytes[self.offset..self.offset + self.len * 4];
        // SAFETY: alignment was checked at construction; the mapping lives as long
        // as `self.file`; every bit pattern is a valid f32.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const f32, self.len) }
    }

    /// The packed bf16 form of this weight, made by `pack` on first use (two threads
    /// racing both pack; one result is kept), as the form `form` picks out; an error
    /// if the weight was packed for another op.
    fn bf16<T>(&self, pack: impl FnOnce(&[f32]) -> Result<Bf16Weight>, form: fn(&Bf16Weight) -> Option<&T>) -> Result<&T> {
        self.bf16_if(pack, form)?
            .ok_or_else(|| candle_core::Error::Msg(format!("mapped weight {:?} was packed for another op", self.shape)))
    }

    /// As [`Self::bf16`], `None` where the weight was packed in another form: a 3x3
    /// kernel packed for one of the direct and Winograd kernels and asked for the other
    /// at a new resolution does without it rather than holding both.
    fn bf16_if<T>(&self, pack: impl FnOnce(&[f32]) -> Result<Bf16Weight>, form: fn(&Bf16Weight) -> Option<&T>) -> Result<Option<&T>> {
        if self.bf16.get().is_none() {
            let packed = pack(self.data())?;
            let _ = self.bf16.set(packed);
        }
        Ok(self.bf16.get().and_then(form))
    }

    /// Copies into a tensor (for devices our kernels do not cover).
    pub fn to_tensor(&self, device: &candle_core::Device) -> Result<Tensor> {
        Tensor::from_slice(self.data(), self.shape.as_slice(), device)
    }
}

fn parallelism() -> Parallelism {
    match candle_core::utils::get_num_threads() {
        n if n > 1 => Parallelism::Rayon(n),
        _ => Parallelism::None,
    }
}

/// `dst[m, n] = a[m, k] * b[k, n]` with explicit (row, column) strides.
#[allow(clippy::too_many_arguments)]
fn sgemm(m: usize, n: usize, k: usize, dst: &mut [f32], a: &[f32], a_rs: usize, a_cs: usize, b: &[f32], b_rs: usize, b_cs: usize) {
    sgemm_strided(m, n, k, dst, n, a, a_rs, a_cs, b, b_rs, b_cs)
}

/// As [`sgemm`], writing rows of `dst` `dst_rs` elements apart.
#[allow(clippy::too_many_arguments)]
fn sgemm_strided(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    a: &[f32],
    a_rs: usize,
    a_cs: usize,
    b: &[f32],
    b_rs: usize,
    b_cs: usize,
) {
    assert!(m == 0 || n == 0 || dst.len() >= (m - 1) * dst_rs + n);
    // SAFETY: the strides and sizes describe memory inside the slices (checked by callers' shapes).
    unsafe {
        gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            false,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism(),
        )
    }
}

/// Whether brume's own kernels run (the direct 3x3 conv and the register-blocked
/// GEMM); `--kernels reference` keeps the im2col + `gemm` crate path.
fn fast() -> bool {
    crate::kernels::mode() == crate::kernels::KernelMode::Fast
}

fn input_f32<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    let CpuStorage::F32(data) = storage else {
        candle_core::bail!("mapped-weight kernels take f32 input");
    };
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("mapped-weight kernels need a contiguous input"),
    }
}

/// A weight our kernels can read as f32: in place, or expanded per call.
#[derive(Clone, Copy)]
enum View<'a> {
    Mapped(&'a MappedF32),
    Packed(&'a super::packed::PackedWeight),
    /// An f32 weight already in memory (a dense CPU tensor's storage).
    Slice(&'a [f32], &'a [usize]),
}

impl View<'_> {
    fn shape(&self) -> &[usize] {
        match self {
            View::Mapped(m) => &m.shape,
            View::Packed(p) => p.shape(),
            View::Slice(_, shape) => shape,
        }
    }

    /// Runs `f(first, rows, weights)` over the f32 weights of output channels
    /// `first..first + rows`: all of them at once when they are in memory, blocks of
    /// them (multiples of [`super::packed::BLOCK_ALIGN`] channels, at most `max_values` values) when
    /// a packed weight is larger than that.
    fn for_row_blocks(&self, max_values: usize, mut f: impl FnMut(usize, usize, &[f32]) -> Result<()>) -> Result<()> {
        match self {
            View::Mapped(m) => f(0, m.shape.first().copied().unwrap_or(0), m.data()),
            View::Packed(p) => p.for_row_blocks(max_values, super::packed::BLOCK_ALIGN, f),
            View::Slice(data, shape) => f(0, shape.first().copied().unwrap_or(0), data),
        }
    }
}

/// Runs `run(rows, weights, out)` once per block of output channels of `w` and
/// places each block's result in `dst`, which holds, for each of its outer items
/// (rows of a linear, images of a conv), all the channels' outputs of `unit`
/// values each. With the weights in memory there is one block and `run` writes
/// `dst` directly.
fn by_blocks(
    w: &View,
    block: usize,
    unit: usize,
    dst: &mut [f32],
    mut run: impl FnMut(usize, &[f32], &mut [f32]) -> Result<()>,
) -> Result<()> {
    let total = w.shape().first().copied().unwrap_or(0) * unit;
    let mut part = Vec::new();
    w.for_row_blocks(block, |first, rows, weights| {
        if rows * unit == total {
            return run(rows, weights, dst);
        }
        let outer = if total == 0 { 0 } else { dst.len() / total };
        if outer == 1 {
            // One item (a one-image conv, a one-row linear): the block's outputs are
            // one contiguous run of `dst`, so no staging copy (at 128x128 a block of
            // 432 channels would stage 27 MiB).
            return run(rows, weights, &mut dst[first * unit..(first + rows) * unit]);
        }
        part.clear();
        part.resize(outer * rows * unit, 0.0);
        run(rows, weights, &mut part)?;
        for (d, p) in dst.chunks_exact_mut(total).zip(part.chunks_exact(rows * unit)) {
            d[first * unit..(first + rows) * unit].copy_from_slice(p);
        }
        Ok(())
    })
}

/// `x [rows, in] -> x W^T [rows, out]` with W [out, in] mapped or packed; a packed
/// W is expanded at most `block` values at a time.
struct LinearOp<'a> {
    w: View<'a>,
    block: usize,
    /// Whether bf16 compute may round this product's factors ([`super::Linear`]'s
    /// conditioning projections say no).
    bf16: bool,
    /// [n], added to every row in place (`y + b` as the separate op sums it): a
    /// separate add allocated and walked a second output (42 MB for SD 1.5's GEGLU
    /// projection at 64x64 tokens).
    bias: Option<&'a [f32]>,
}

/// Checks a linear layer's bias against its `n` outputs.
fn check_bias(bias: Option<&[f32]>, n: usize) -> Result<()> {
    match bias {
        Some(b) if b.len() != n => candle_core::bail!("mapped linear: bias of {} for {n} outputs", b.len()),
        _ => Ok(()),
    }
}

/// `row += bias`, in the separate op's order, so every path that adds it in place
/// gives the same values.
fn add_bias(row: &mut [f32], bias: &[f32]) {
    for (v, b) in row.iter_mut().zip(bias) {
        *v += b;
    }
}

impl LinearOp<'_> {
    fn finish(&self, mut dst: Vec<f32>, rows: usize, n: usize) -> Result<(CpuStorage, Shape)> {
        check_bias(self.bias, n)?;
        if let Some(b) = self.bias {
            use rayon::prelude::*;
            let per = (1 << 14) / n.max(1) + 1;
            dst.par_chunks_mut(n * per).for_each(|chunk| {
                for row in chunk.chunks_exact_mut(n) {
                    add_bias(row, b);
                }
            });
        }
        Ok((CpuStorage::F32(dst), Shape::from((rows, n))))
    }
}

impl CustomOp1 for LinearOp<'_> {
    fn name(&self) -> &'static str {
        "mapped-linear"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = input_f32(storage, layout)?;
        let (rows, k) = layout.shape().dims2()?;
        let (n, wk) = (self.w.shape()[0], self.w.shape()[1]);
        if k != wk {
            candle_core::bail!("mapped linear: input width {k} but weight is {:?}", self.w.shape());
        }
        let mut dst = vec![0f32; rows * n];
        if let (View::Mapped(m), true) = (self.w, self.bf16 && crate::kernels::bf16_copies_for(candle_core::DType::F32)) {
            linear_bf16_cached(x, rows, k, m, &mut dst)?;
            return self.finish(dst, rows, n);
        }
        by_blocks(&self.w, self.block, 1, &mut dst, |nb, w, out| linear_into(x, rows, k, nb, w, self.bf16, out))?;
        self.finish(dst, rows, n)
    }
}

/// `dst [rows, n] = x [rows, k] W^T` with the mapped weight's cached bf16 form, on
/// AMX tiles where the CPU has them, else AVX512-BF16 vectors.
fn linear_bf16_cached(x: &[f32], rows: usize, k: usize, m: &MappedF32, dst: &mut [f32]) -> Result<()> {
    let n = m.shape[0];
    if crate::kernels::amx::supported() {
        use crate::kernels::amx::{gemm_packed, PackedPairs, PackedRows};
        let w = packed_form!(m, AmxPairs, |w| PackedPairs::new(w, k, n, crate::kernels::matmul::BLayout::NK { ld: k }))?;
        return gemm_packed(&PackedRows::new(x, rows, k, k)?, w, dst);
    }
    use crate::kernels::matmul_bf16::{gemm_packed_b, PackedStrips};
    let w = packed_form!(m, Strips, |w| PackedStrips::of_linear(w, n, k))?;
    gemm_packed_b(x, rows, w, dst)
}

/// `dst [rows, n] = x [rows, k] W^T` for W [n, k] in memory.
/// `bf16`: whether bf16 compute may round the factors.
#[allow(clippy::too_many_arguments)]
fn linear_into(x: &[f32], rows: usize, k: usize, n: usize, w: &[f32], bf16: bool, dst: &mut [f32]) -> Result<()> {
    if fast() {
        use crate::kernels::matmul::{gemm, BLayout};
        // b[k, n] = W[n, k]: moving along k is stride 1, along n stride `in`.
        let b = BLayout::NK { ld: k };
        match crate::kernels::compute() {
            crate::kernels::Compute::Bf16 if bf16 => crate::kernels::matmul_bf16::gemm(rows, n, k, x, k, w, b, dst),
            _ => gemm(crate::kernels::isa(), rows, n, k, x, k, w, b, dst),
        }
    } else {
        sgemm(rows, n, k, dst, x, k, 1, w, 1, k);
        Ok(())
    }
}

/// `x [rows, in]` times the transposed mapped weight; `bf16`: whether bf16
/// compute may round the factors (see [`super::Linear`]).
pub fn linear(x: &Tensor, w: &MappedF32, bf16: bool) -> Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&LinearOp { w: View::Mapped(w), block: EXPAND_BLOCK_VALUES, bf16, bias: None })
}

/// A linear layer's f32 CPU call with its bias added in place: `None` when the weight
/// has no such path for `x` (another dtype or device, or dense).
pub(crate) fn linear_param(x: &Tensor, w: &super::Param, bf16: bool, bias: Option<&[f32]>) -> Result<Option<Tensor>> {
    use super::Param;
    if x.dtype() != candle_core::DType::F32 {
        return Ok(None);
    }
    let w = match w {
        Param::Mapped(m) => View::Mapped(m),
        Param::Packed(p) => View::Packed(p),
        Param::Dense(_) => return Ok(None),
    };
    x.contiguous()?.apply_op1_no_bwd(&LinearOp { w, block: EXPAND_BLOCK_VALUES, bf16, bias }).map(Some)
}

/// Bytes of projection one block of rows of [`LinearGegluOp`] makes before its GEGLU
/// reads them back: small enough to stay in L2/L3 between the two.
const GEGLU_BLOCK_BYTES: usize = 2 << 20;

/// Fewest rows per block: thinner products lose more in the GEMM than the cache saves
/// (SD 1.5's 16x16 level, 256 x 1280 -> 10240: 48-row blocks took up to 1.13x the two ops).
const GEGLU_MIN_ROWS: usize = 192;

/// A GEGLU projection, `a * gelu(gate)` of the halves of `x W^T + b`, a block of rows
/// at a time with the mapped weight's cached bf16 form (or in f32, see
/// [`linear_geglu_param`]): the [rows, 2 inner] product (42 MB at SD 1.5's 4096 tokens
/// x 2560) is never written out to memory and read back, only one block of it, while
/// it is still in cache. The values are those of the product, the in-place bias and
/// [`crate::kernels::geglu::geglu`], to the bit. Against those two ops under bf16
/// compute (medians of 25 alternated calls, bias included, 2 threads):
/// 4096 x 320 -> 2560 0.023-0.025 s vs 0.042-0.044 (the two ops also fault in 63 MB
/// of fresh output per call), 1024 x 640 -> 5120 0.020-0.025 vs 0.021-0.027, 256 x
/// 1280 -> 10240 (one block and a short one) level.
struct LinearGegluOp<'a> {
    w: &'a MappedF32,
    bias: Option<&'a [f32]>,
    /// The blocks' products with the weight's cached bf16 form, else the f32 GEMM.
    bf16: bool,
}

impl CustomOp1 for LinearGegluOp<'_> {
    fn name(&self) -> &'static str {
        "mapped-linear-geglu"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        use rayon::prelude::*;
        let x = input_f32(storage, layout)?;
        let (rows, k) = layout.shape().dims2()?;
        let (n, wk) = (self.w.shape[0], self.w.shape[1]);
        if k != wk || n % 2 != 0 {
            candle_core::bail!("mapped linear geglu: input width {k}, weight {:?} (needs an even output width)", self.w.shape);
        }
        check_bias(self.bias, n)?;
        let inner = n / 2;
        let mut out = vec![0f32; rows * inner];
        if rows == 0 || inner == 0 {
            return Ok((CpuStorage::F32(out), Shape::from((rows, inner))));
        }
        // Whole row chunks of the GEMM, and at least GEGLU_MIN_ROWS rows.
        let mc = crate::kernels::matmul_bf16::MC;
        let per = if self.bf16 { (GEGLU_BLOCK_BYTES / (4 * n)).max(GEGLU_MIN_ROWS) / mc * mc } else { GEGLU_F32_ROWS };
        let mut block = vec![0f32; per.min(rows) * n];
        let mut r0 = 0;
        while r0 < rows {
            let rc = per.min(rows - r0);
            let (h, dst) = (&mut block[..rc * n], &mut out[r0 * inner..(r0 + rc) * inner]);
            let xb = &x[r0 * k..(r0 + rc) * k];
            if self.bf16 {
                linear_bf16_cached(xb, rc, k, self.w, h)?;
            } else {
                use crate::kernels::matmul::{gemm, BLayout};
                gemm(crate::kernels::isa(), rc, n, k, xb, k, self.w.data(), BLayout::NK { ld: k }, h)?;
            }
            h.par_chunks_mut(n).zip(dst.par_chunks_mut(inner)).try_for_each(|(row, d)| {
                if let Some(b) = self.bias {
                    add_bias(row, b);
                }
                crate::kernels::geglu::geglu_row(row, d)
            })?;
            r0 += rc;
        }
        Ok((CpuStorage::F32(out), Shape::from((rows, inner))))
    }
}

/// [`LinearGegluOp`] where it applies: an f32 CPU input, an in-place f32 weight and
/// fast kernels, with bf16 compute (whose bf16 form is packed once, so a call per block
/// of rows costs nothing extra) or, on AVX2, f32 compute with a weight of at most
/// [`GEGLU_F32_WEIGHT_MAX`] (packed again by every block of [`GEGLU_F32_ROWS`], from
/// cache after the first); `None` elsewhere, where the caller runs the product and the
/// GEGLU as two ops.
pub(crate) fn linear_geglu_param(x: &Tensor, w: &super::Param, bias: Option<&[f32]>) -> Result<Option<Tensor>> {
    use crate::kernels::{compute, fast_for, isa, Compute, Isa};
    let super::Param::Mapped(m) = w else { return Ok(None) };
    if !matches!(x.device(), candle_core::Device::Cpu) {
        return Ok(None);
    }
    let bf16 = crate::kernels::bf16_copies_for(x.dtype());
    let f32_blocks = fast_for(x.dtype()) && compute() == Compute::F32 && isa() == Isa::Avx2 && 4 * m.len <= GEGLU_F32_WEIGHT_MAX;
    if !bf16 && !f32_blocks {
        return Ok(None);
    }
    x.contiguous()?.apply_op1_no_bwd(&LinearGegluOp { w: m, bias, bf16 }).map(Some)
}

/// Largest f32 weight (bytes) whose GEGLU projection is made by blocks of rows under
/// f32 compute: SD's 64x64 level (320 -> 2560, 3.3 MB), packed once per block and kept
/// in L3 between them; the 32x32 and 16x16 levels' weights (13 and 52 MB) would come
/// from memory once per block (1024 x 640 -> 5120 by blocks of 192 rows: 0.068 s
/// against the two ops' 0.061), so they keep the two ops.
const GEGLU_F32_WEIGHT_MAX: usize = 4 << 20;

/// Rows per block of an f32 GEGLU projection: a 5 MB product block at 2560 wide, in
/// L3 until the GEGLU reads it. `cargo run --release -p brume --example geglu_layer`
/// (4096 x 320 -> 2560 with bias, alternated with the two ops in one process, Zen 3,
/// two runs, time over the two ops' medians): blocks of 192 rows 0.85 / 0.77, 512 0.83
/// / 0.80, 1024 0.86 / 0.88, 2048 0.88 / 0.92.
const GEGLU_F32_ROWS: usize = 512;

/// `x [rows, in]` times the transposed packed weight (expanded for the call).
pub fn linear_packed(x: &Tensor, w: &super::packed::PackedWeight, bf16: bool) -> Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&LinearOp { w: View::Packed(w), block: EXPAND_BLOCK_VALUES, bf16, bias: None })
}

/// 2-D convolution with a mapped [out, in, k, k] kernel: im2col + one GEMM per image.
struct ConvOp<'a> {
    w: View<'a>,
    stride: usize,
    padding: usize,
    /// Most values of a packed kernel expanded at once.
    block: usize,
    /// Whether bf16 compute may round this convolution's factors ([`super::Conv2d`]
    /// keeps a network's first and last in f32).
    bf16: bool,
    /// Bias, offset, residual and activation, applied to the output in place.
    epilogue: Epilogue<'a>,
    /// Convolve the nearest-neighbour 2x upsampling of the input (a decoder's
    /// `Upsample2D`): formed only where the direct kernel cannot read it in place.
    upsample: bool,
}

impl CustomOp1 for ConvOp<'_> {
    fn name(&self) -> &'static str {
        "mapped-conv2d"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = input_f32(storage, layout)?;
        let (b, c, h, w) = layout.shape().dims4()?;
        let (h, w) = if self.upsample { (2 * h, 2 * w) } else { (h, w) };
        let ws = self.w.shape();
        let (o, wc, kh, kw) = (ws[0], ws[1], ws[2], ws[3]);
        if c != wc {
            candle_core::bail!("mapped conv: {c} input channels but kernel is {ws:?}");
        }
        let (s, p) = (self.stride, self.padding);
        if h + 2 * p < kh || w + 2 * p < kw {
            candle_core::bail!("mapped conv: input {h}x{w} smaller than kernel");
        }
        let ho = (h + 2 * p - kh) / s + 1;
        let wo = (w + 2 * p - kw) / s + 1;
        let hw = ho * wo;
        let geom = ConvGeom { b, c, h, w, kh, kw, s, p, ho, wo };
        let mut dst = vec![0f32; b * o * hw];
        // The direct f32 kernel reads the half-size map itself; every other path gets
        // the upsampled map.
        let in_place_up = self.upsample && direct_upsampled(geom, self.bf16);
        let upsampled;
        let x = if self.upsample && !in_place_up {
            upsampled = nearest2x(x, b * c, h / 2, w / 2);
            &upsampled[..]
        } else {
            x
        };
        if let (View::Mapped(m), true) = (self.w, self.bf16 && crate::kernels::bf16_copies_for(candle_core::DType::F32)) {
            if conv_bf16_cached(x, geom, m, o, &mut dst)? {
                self.epilogue.apply(&mut dst, o, hw)?;
                return Ok((CpuStorage::F32(dst), Shape::from((b, o, ho, wo))));
            }
        }
        let mut cols = Vec::new();
        by_blocks(&self.w, self.block, hw, &mut dst, |ob, w, out| conv_into(x, geom, ob, w, self.bf16, in_place_up, &mut cols, out))?;
        self.epilogue.apply(&mut dst, o, hw)?;
        Ok((CpuStorage::F32(dst), Shape::from((b, o, ho, wo))))
    }
}

/// Whether the conv of `g` (its input size already the upsampled one) runs the direct
/// f32 3x3 kernel on rows, which reads an upsampled input in place
/// ([`crate::kernels::conv3x3::run_upsampled`]); `bf16` as [`ConvOp`]'s.
/// (Opt-in Winograd is not taken for these.)
fn direct_upsampled(g: ConvGeom, bf16: bool) -> bool {
    (g.kh, g.kw, g.s, g.p) == (3, 3, 1, 1)
        && fast()
        && !(bf16 && crate::kernels::compute() == crate::kernels::Compute::Bf16)
        && crate::kernels::conv3x3::reads_upsampled(crate::kernels::isa(), g.b, g.c, g.h, g.w)
}

/// `planes` maps of h x w, each value repeated into a 2 x 2 block.
fn nearest2x(x: &[f32], planes: usize, h: usize, w: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out = vec![0f32; planes * 4 * h * w];
    out.par_chunks_mut(4 * h * w).zip(x.par_chunks(h * w)).for_each(|(dst, src)| {
        for (y, row) in src.chunks_exact(w).enumerate() {
            let (top, bottom) = dst[2 * y * 2 * w..(2 * y + 2) * 2 * w].split_at_mut(2 * w);
            for (pair, &v) in top.chunks_exact_mut(2).zip(row) {
                pair[0] = v;
                pair[1] = v;
            }
            bottom.copy_from_slice(top);
        }
    });
    out
}

/// The sizes of one convolution call (input, kernel, stride, padding, output).
#[derive(Clone, Copy)]
struct ConvGeom {
    b: usize,
    c: usize,
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    s: usize,
    p: usize,
    ho: usize,
    wo: usize,
}

/// The 3x3 / padding 1 and 1x1 convolutions in bf16 with the mapped kernel's cached
/// packed form (on AMX tiles where the CPU has them, else AVX512-BF16 vectors);
/// `false` (nothing written) for the other shapes.
fn conv_bf16_cached(x: &[f32], g: ConvGeom, m: &MappedF32, o: usize, out: &mut [f32]) -> Result<bool> {
    use crate::kernels::conv3x3::Dims;
    use crate::kernels::matmul::BLayout;
    let ConvGeom { b, c, h, w, kh, kw, s, p, .. } = g;
    let d = Dims { batch: b, in_ch: c, out_ch: o, h, w };
    let amx = crate::kernels::amx::supported();
    if (kh, kw, s, p) == (3, 3, 1, 1) {
        if amx {
            use crate::kernels::amx::{conv3x3_packed, PackedConv3x3};
            let wt = packed_form!(m, AmxConv3x3, |w| PackedConv3x3::new(w, o, c))?;
            conv3x3_packed(x, d, wt, out)?;
        } else if crate::kernels::winograd_bf16::wins(d) {
            use crate::kernels::conv3x3_bf16::PackedConvPairs;
            use crate::kernels::winograd_bf16::{run_packed, PackedWinogradPairs};
            match packed_form!(m, Winograd, |w| PackedWinogradPairs::new(w, o, c), bf16_if)? {
                Some(u) => run_packed(x, d, u, out)?,
                // Packed for the direct kernel at another map size: that form serves
                // (as accurate, and nothing transformed per call).
                None => crate::kernels::conv3x3_bf16::run_packed(x, d, packed_form!(m, Conv3x3, |w| PackedConvPairs::new(w, o, c))?, out)?,
            }
        } else {
            use crate::kernels::conv3x3_bf16::{run_packed, run_vector, PackedConvPairs};
            match packed_form!(m, Conv3x3, |w| PackedConvPairs::new(w, o, c), bf16_if)? {
                Some(wt) => run_packed(x, d, wt, out)?,
                None => run_vector(x, d, m.data(), out)?,
            }
        }
        return Ok(true);
    }
    if (kh, kw, s, p) != (1, 1, 1, 0) {
        return Ok(false);
    }
    let hw = h * w;
    if amx {
        use crate::kernels::amx::{gemm_packed, PackedPairs, PackedRows};
        let wr = packed_form!(m, AmxRows, |w| PackedRows::new(w, o, c, c))?;
        for n in 0..b {
            let img = &x[n * c * hw..(n + 1) * c * hw];
            let pairs = PackedPairs::new(img, c, hw, BLayout::KN { ld: hw })?;
            gemm_packed(wr, &pairs, &mut out[n * o * hw..(n + 1) * o * hw])?;
        }
        return Ok(true);
    }
    use crate::kernels::matmul_bf16::{gemm_packed_a, PackedPairRows};
    let wr = packed_form!(m, Rows, |w| PackedPairRows::new(w, o, c, c))?;
    for n in 0..b {
        let img = &x[n * c * hw..(n + 1) * c * hw];
        gemm_packed_a(wr, hw, img, BLayout::KN { ld: hw }, &mut out[n * o * hw..(n + 1) * o * hw])?;
    }
    Ok(true)
}

/// `out [b, o, ho, wo]` = conv(`x`, `weights` [o, c, kh, kw]); `cols` is the reused
/// patch buffer of the im2col path; `bf16`: whether bf16 compute may round the factors;
/// `up`: `x` is the half-size map of an upsampled input ([`direct_upsampled`] holds).
#[allow(clippy::too_many_arguments)]
fn conv_into(x: &[f32], g: ConvGeom, o: usize, weights: &[f32], bf16: bool, up: bool, cols: &mut Vec<f32>, out: &mut [f32]) -> Result<()> {
    let bf16 = bf16 && crate::kernels::compute() == crate::kernels::Compute::Bf16;
    let ConvGeom { b, c, h, w, kh, kw, s, p, ho, wo } = g;
    let (hw, ck) = (ho * wo, c * kh * kw);
    if up {
        let d = crate::kernels::conv3x3::Dims { batch: b, in_ch: c, out_ch: o, h, w };
        if !crate::kernels::conv3x3::run_upsampled(crate::kernels::isa(), x, d, weights, out)? {
            candle_core::bail!("conv over an upsampled map: {d:?} takes no in-place path");
        }
        return Ok(());
    }
    if (kh, kw, s, p) == (3, 3, 1, 1) && fast() {
        let d = crate::kernels::conv3x3::Dims { batch: b, in_ch: c, out_ch: o, h, w };
        return if bf16 && crate::kernels::winograd_bf16::wins(d) {
            crate::kernels::winograd_bf16::run(x, d, weights, out)
        } else if bf16 {
            crate::kernels::conv3x3_bf16::run(x, d, weights, out)
        } else {
            crate::kernels::conv3x3::run_best(crate::kernels::isa(), x, d, weights, out)
        };
    }
    let direct = kh == 1 && kw == 1 && s == 1 && p == 0;
    // Unfold a band of output rows at a time so the patch buffer stays near
    // COLS_BUDGET whatever the image size (a whole 512x512 VAE layer would need ~1.2 GB).
    const COLS_BUDGET: usize = 16 << 20;
    let band = (COLS_BUDGET / (4 * ck * wo).max(1)).clamp(1, ho);
    if !direct && cols.len() < ck * band * wo {
        cols.resize(ck * band * wo, 0.0);
    }
    for n in 0..b {
        let img = &x[n * c * h * w..(n + 1) * c * h * w];
        let out = &mut out[n * o * hw..(n + 1) * o * hw];
        if direct && fast() {
            use crate::kernels::matmul::{gemm, BLayout};
            let bl = BLayout::KN { ld: hw };
            if bf16 {
                crate::kernels::matmul_bf16::gemm(o, hw, ck, weights, ck, img, bl, out)?
            } else {
                gemm(crate::kernels::isa(), o, hw, ck, weights, ck, img, bl, out)?
            }
            continue;
        }
        if direct {
            sgemm(o, hw, ck, out, weights, ck, 1, img, hw, 1);
            continue;
        }
        let mut oy0 = 0;
        while oy0 < ho {
            let rows = band.min(ho - oy0);
            let cols = &mut cols[..ck * rows * wo];
            crate::kernels::im2col::im2col(img, c, h, w, kh, kw, s, p, oy0, rows, wo, cols);
            let n_cols = rows * wo;
            sgemm_strided(o, n_cols, ck, &mut out[oy0 * wo..], hw, weights, ck, 1, cols, n_cols, 1);
            oy0 += rows;
        }
    }
    Ok(())
}

/// `bf16`: whether bf16 compute may round the factors (see [`super::Conv2d`]).
pub fn conv2d(x: &Tensor, w: &MappedF32, stride: usize, padding: usize, bf16: bool) -> Result<Tensor> {
    conv_view(x, View::Mapped(w), stride, padding, EXPAND_BLOCK_VALUES, bf16, Epilogue::default(), false)
}

/// 2-D convolution with a packed kernel, expanded for the call.
pub fn conv2d_packed(x: &Tensor, w: &super::packed::PackedWeight, stride: usize, padding: usize, bf16: bool) -> Result<Tensor> {
    conv_view(x, View::Packed(w), stride, padding, EXPAND_BLOCK_VALUES, bf16, Epilogue::default(), false)
}

/// A conv layer's f32 CPU call with its epilogue, on `x` or (`upsample`) its nearest
/// 2x upsampling: `None` when the weight has no such path for `x` (another dtype or
/// device), and the layer runs candle's ops.
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv2d_param(
    x: &Tensor,
    w: &super::Param,
    stride: usize,
    padding: usize,
    bf16: bool,
    epilogue: Epilogue,
    upsample: bool,
) -> Result<Option<Tensor>> {
    use super::Param;
    let f32_input = x.dtype() == candle_core::DType::F32;
    let e = EXPAND_BLOCK_VALUES;
    match w {
        Param::Mapped(m) if f32_input => conv_view(x, View::Mapped(m), stride, padding, e, bf16, epilogue, upsample).map(Some),
        Param::Packed(p) if f32_input => conv_view(x, View::Packed(p), stride, padding, e, bf16, epilogue, upsample).map(Some),
        Param::Dense(t) if crate::kernels::use_fast(x) && t.dtype() == x.dtype() && matches!(t.device(), candle_core::Device::Cpu) => {
            conv_dense(x, t, stride, padding, bf16, epilogue, upsample).map(Some)
        }
        _ => Ok(None),
    }
}

#[allow(clippy::too_many_arguments)]
fn conv_view(x: &Tensor, w: View, stride: usize, padding: usize, block: usize, bf16: bool, epilogue: Epilogue, upsample: bool) -> Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&ConvOp { w, stride, padding, block, bf16, epilogue, upsample })
}

/// [`linear_packed`] expanding at most `block` values at a time (tests of the split path).
#[cfg(test)]
pub(crate) fn linear_packed_in_blocks(x: &Tensor, w: &super::packed::PackedWeight, block: usize) -> Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&LinearOp { w: View::Packed(w), block, bf16: true, bias: None })
}

/// [`conv2d_packed`] expanding at most `block` values at a time (tests of the split path).
#[cfg(test)]
pub(crate) fn conv2d_packed_in_blocks(
    x: &Tensor,
    w: &super::packed::PackedWeight,
    stride: usize,
    padding: usize,
    block: usize,
) -> Result<Tensor> {
    conv_view(x, View::Packed(w), stride, padding, block, true, Epilogue::default(), false)
}

/// 2-D convolution with a dense f32 CPU kernel, through the same im2col + GEMM
/// path as the mapped weights. candle's own conv re-lays the kernel out on every
/// call and unfolds the whole image at once; this reads it where it is and unfolds
/// a band of rows at a time.
/// `bf16`: whether bf16 compute may round the factors.
pub fn conv2d_dense(x: &Tensor, w: &Tensor, stride: usize, padding: usize, bf16: bool) -> Result<Tensor> {
    conv_dense(x, w, stride, padding, bf16, Epilogue::default(), false)
}

fn conv_dense(x: &Tensor, w: &Tensor, stride: usize, padding: usize, bf16: bool, epilogue: Epilogue, upsample: bool) -> Result<Tensor> {
    let w = w.contiguous()?;
    let (storage, layout) = w.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("dense conv kernel: the weight is not on the CPU");
    };
    let data = input_f32(cpu, layout)?;
    conv_view(x, View::Slice(data, w.dims()), stride, padding, EXPAND_BLOCK_VALUES, bf16, epilogue, upsample)
}

/// Gathers rows of a mapped [rows, dim] table.
pub fn gather_rows(table: &MappedF32, ids: &[u32], device: &candle_core::Device) -> Result<Tensor> {
    let (rows, dim) = (table.shape[0], table.shape[1]);
    let data = table.data();
    let mut out = Vec::with_capacity(ids.len() * dim);
    for &id in ids {
        let id = id as usize;
        if id >= rows {
            candle_core::bail!("token id {id} is out of range for an embedding table of {rows} rows");
        }
        out.extend_from_slice(&data[id * dim..(id + 1) * dim]);
    }
    Tensor::from_vec(out, (ids.len(), dim), device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loading::safetensors::write_safetensors;
    use crate::loading::Transform;
    use candle_core::Device;

    fn mapped(shape: &[usize], seed: u64) -> (MappedF32, Tensor, tempfile::TempDir) {
        let mut rng = crate::samplers::Rng::new(seed);
        let t = rng.randn(shape, &Device::Cpu).unwrap();
        let bytes: Vec<u8> = t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("w.safetensors");
        write_safetensors(&p, &[("w".into(), StoredDType::F32, shape.to_vec(), bytes)], &Default::default()).unwrap();
        let file = SafetensorsFile::open(&p).unwrap();
        let st = StoredTensor {
            entry: file.entry("w").unwrap().clone(),
            file,
            source: "w".into(),
            transform: Transform::Identity,
            quant: None,
        };
        (MappedF32::from_stored(&st, shape).expect("aligned"), t, dir)
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        let m = b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        d / m
    }

    #[test]
    fn linear_matches_candle() {
        for (rows, k, n) in [(1, 3, 5), (7, 64, 33), (130, 96, 257)] {
            let (w, wt, _d) = mapped(&[n, k], 1);
            let x = crate::samplers::Rng::new(2).randn(&[rows, k], &Device::Cpu).unwrap();
            let want = x.matmul(&wt.t().unwrap()).unwrap();
            assert!(max_rel(&linear(&x, &w, true).unwrap(), &want) < 1e-5);
        }
    }

    #[test]
    fn conv_matches_candle() {
        for (b, c, o, h, w, k, s, p) in [
            (2, 3, 8, 9, 7, 3, 1, 1),
            (1, 8, 4, 8, 8, 3, 2, 1),
            (1, 5, 6, 7, 9, 3, 2, 0),
            (2, 16, 8, 5, 6, 1, 1, 0),
            // Big enough that the patch buffer is split into bands of rows.
            (1, 64, 4, 130, 70, 3, 1, 1),
            (1, 64, 4, 129, 71, 3, 2, 1),
        ] {
            let (wm, wt, _d) = mapped(&[o, c, k, k], 3);
            let x = crate::samplers::Rng::new(4).randn(&[b, c, h, w], &Device::Cpu).unwrap();
            let want = x.conv2d(&wt, p, s, 1, 1).unwrap();
            let got = conv2d(&x, &wm, s, p, true).unwrap();
            assert_eq!(got.dims(), want.dims());
            assert!(max_rel(&got, &want) < 1e-5, "{:?}", (b, c, o, h, w, k, s, p));
            // The same kernel over a dense tensor's storage, also from a strided view.
            let dense = conv2d_dense(&x, &wt, s, p, true).unwrap();
            assert!(max_rel(&dense, &want) < 1e-5, "dense {:?}", (b, c, o, h, w, k, s, p));
            let strided = wt.transpose(2, 3).unwrap();
            let want_t = x.conv2d(&strided.contiguous().unwrap(), p, s, 1, 1).unwrap();
            assert!(max_rel(&conv2d_dense(&x, &strided, s, p, true).unwrap(), &want_t) < 1e-5);
        }
    }

    #[test]
    fn gather_checks_range() {
        let (t, tt, _d) = mapped(&[10, 4], 5);
        let got = gather_rows(&t, &[3, 0, 9], &Device::Cpu).unwrap();
        let want = tt.index_select(&Tensor::new(&[3u32, 0, 9], &Device::Cpu).unwrap(), 0).unwrap();
        assert_eq!(max_rel(&got, &want), 0.0);
        assert!(gather_rows(&t, &[10], &Device::Cpu).is_err());
    }
}
