//! Hand-written CPU kernels for the hot operations, as candle custom ops.
//!
//! Each kernel computes what the plain candle path in [`crate::layers`] computes
//! (proven on random inputs in `tests/kernels_*.rs`), only faster: fused, tiled,
//! multi-threaded over rayon's pool and vectorised for the instruction set this CPU
//! offers, detected once at run time so one binary runs on any x86-64 (AVX-512,
//! AVX2+FMA, or the portable path); on aarch64 the portable path is NEON.
//!
//! The layer types decide when a kernel runs ([`use_fast`]); the process-wide
//! [`KernelMode`] switch sends everything back to the plain candle path, which is
//! how `--kernels reference` checks a result or a timing against candle.

/// Defines `unsafe fn $name(isa: Isa, args..)` that runs `$body` compiled for `isa`'s
/// vectors: inside `target_feature` functions for AVX-512 and AVX2, else as is. For
/// plain loops left to the compiler's vectorizer: a closure handed to such a function
/// is compiled on its own, for the baseline instruction set (SSE2), and was not inlined
/// (the Winograd transforms ran without AVX that way). The caller promises `isa` runs
/// on this CPU.
macro_rules! on_isa_fn {
    ($(#[$m:meta])* $vis:vis unsafe fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis unsafe fn $name(isa: $crate::kernels::Isa, $($arg: $ty),*) {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            unsafe fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,fma")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn avx512($($arg: $ty),*) {
                // SAFETY: forwarded from the caller.
                unsafe { body($($arg),*) }
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn avx2($($arg: $ty),*) {
                // SAFETY: forwarded from the caller.
                unsafe { body($($arg),*) }
            }
            // SAFETY: the caller's contract: `isa` runs on this CPU.
            unsafe {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    $crate::kernels::Isa::Avx512 => avx512($($arg),*),
                    #[cfg(target_arch = "x86_64")]
                    $crate::kernels::Isa::Avx2 => avx2($($arg),*),
                    _ => body($($arg),*),
                }
            }
        }
    };
}

pub mod amx;
pub mod attention_amx;
pub mod attention_bf16;
mod bf16;
pub mod conv3x3;
pub mod conv3x3_upsampled;
pub mod conv3x3_bf16;
pub mod flash_attention;
pub mod geglu;
pub mod gelu;
pub mod group_norm;
pub(crate) mod im2col;
pub mod matmul;
pub mod matmul_bf16;
pub mod peak;
mod simd;
pub mod winograd;
pub mod winograd43;
pub mod winograd43_strips;
pub mod winograd_bf16;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};

/// Which implementation the layers run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelMode {
    /// brume's kernels on the CPU (candle's own ops elsewhere). The default.
    Fast,
    /// candle's plain ops everywhere: the reference the kernels are proven against.
    Reference,
}

impl KernelMode {
    /// Parses `fast` or `reference` (the CLI's `--kernels` values).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "fast" => Some(Self::Fast),
            "reference" => Some(Self::Reference),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Fast => "fast",
            Self::Reference => "reference",
        }
    }
}

static MODE: AtomicU8 = AtomicU8::new(0);

/// Sets the implementation every layer in this process runs from now on.
pub fn set_mode(mode: KernelMode) {
    MODE.store(if mode == KernelMode::Fast { 0 } else { 1 }, Ordering::Relaxed);
}

/// The implementation the layers run (default [`KernelMode::Fast`]).
pub fn mode() -> KernelMode {
    if MODE.load(Ordering::Relaxed) == 0 {
        KernelMode::Fast
    } else {
        KernelMode::Reference
    }
}

/// What the kernels multiply in. Activations and sums stay f32 either way; `Bf16`
/// rounds the factors of the 3x3 convolutions, linear layers and 1x1 convolutions
/// to bf16 (error ~1e-3 relative) and multiplies them on AMX tiles where the CPU
/// has them ([`amx`]), else with AVX512-BF16 dot products; in-place f32 weights then
/// keep a bf16 copy packed for that kernel ([`bf16_copies_for`]), half their bytes.
/// Attention's products run in bf16 too: on the tiles with AMX ([`attention_amx`],
/// see [`amx::attention_enabled`]), else with AVX512-BF16 ([`attention_bf16`]);
/// norms and softmax stay f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compute {
    F32,
    Bf16,
}

impl Compute {
    /// Parses `f32` or `bf16` (the CLI's `--compute` values).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "f32" => Some(Self::F32),
            "bf16" => Some(Self::Bf16),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }
}

static COMPUTE: AtomicU8 = AtomicU8::new(0);

/// Sets what the kernels multiply in; bf16 is refused on a CPU without AVX512-BF16.
pub fn set_compute(c: Compute) -> Result<(), String> {
    if c == Compute::Bf16 && !conv3x3_bf16::supported() {
        return Err(format!("bf16 compute needs AVX512-BF16, which this CPU lacks (kernels: {})", isa().name()));
    }
    COMPUTE.store(if c == Compute::Bf16 { 1 } else { 0 }, Ordering::Relaxed);
    Ok(())
}

/// What the kernels multiply in (default f32).
pub fn compute() -> Compute {
    if COMPUTE.load(Ordering::Relaxed) == 1 {
        Compute::Bf16
    } else {
        Compute::F32
    }
}

/// Whether a layer should run its kernel for this tensor: fast mode, a CPU tensor
/// of a dtype the kernel takes (the kernels compute in f32).
pub fn use_fast(t: &Tensor) -> bool {
    matches!(t.device(), Device::Cpu) && fast_for(t.dtype())
}

/// Whether CPU tensors of `dtype` take the kernels: fast mode and f32. One rule
/// for the layers ([`use_fast`]) and the memory estimator, which must predict them.
pub fn fast_for(dtype: DType) -> bool {
    mode() == KernelMode::Fast && dtype == DType::F32
}

/// Whether CPU tensors of `dtype` take the AMX kernels: [`fast_for`], bf16 compute
/// and a CPU with AMX. One rule for the layers and the memory estimator, which must
/// count the AMX conv's packed input.
pub fn amx_for(dtype: DType) -> bool {
    bf16_copies_for(dtype) && amx::supported()
}

/// Whether in-place f32 conv and linear weights keep a bf16 copy packed for the
/// kernel that multiplies them (AMX tiles or AVX512-BF16 vectors): [`fast_for`] and
/// bf16 compute (which [`set_compute`] allows only where one of them exists). One
/// rule for the layers and the memory estimator, which must count the copies.
pub fn bf16_copies_for(dtype: DType) -> bool {
    fast_for(dtype) && compute() == Compute::Bf16
}

/// A bf16 attention kernel: on AMX tiles ([`attention_amx`]) or with AVX512-BF16
/// vectors ([`attention_bf16`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Attention {
    Tiles,
    Vectors,
}

/// The bf16 attention kernel `--compute bf16` runs on this CPU: the tiles where it
/// has AMX (unless `BRUME_AMX_ATTENTION=off`, when attention stays f32 for
/// comparison), else the vectors. `None` under f32 compute, and with
/// `BRUME_BF16_ATTENTION=off` (f32 attention, to compare). One rule for the
/// attention layer and the memory estimator, which counts the rounded keys and
/// values each kernel packs per call.
pub fn bf16_attention() -> Option<Bf16Attention> {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("BRUME_BF16_ATTENTION").is_ok_and(|v| v == "off" || v == "0"));
    if compute() != Compute::Bf16 || off {
        None
    } else if amx::attention_enabled() {
        Some(Bf16Attention::Tiles)
    } else if !amx::supported() && bf16::supported() {
        Some(Bf16Attention::Vectors)
    } else {
        None
    }
}

/// Whether attention on the CPU runs the fused kernel, whatever the input dtype
/// (it computes in f32): fast mode on a CPU where it pays ([`attention_pays`]).
pub fn fused_attention_on_cpu() -> bool {
    mode() == KernelMode::Fast && attention_pays()
}

/// Whether the fused attention kernel beats candle's plain path on this CPU. The
/// plain-array path does not (with the ISA capped to it on an AVX-512 machine it ran
/// 1.7x slower than candle's own SIMD matmuls), so an x86-64 without AVX2 keeps the
/// plain path; `flash_attention` itself still runs anywhere. On aarch64 the
/// portable path is NEON with fused multiply-adds and the fused kernel runs: the
/// plain path's score matrices (n_q x n_k per head, and the softmax beside them: 2 x
/// 1 GiB for a guided SD 1.5 step's 4096-token self-attention) do not fit the phones'
/// working sets the memory planner budgets for, which made it chunk attention or
/// fall back in size.
/// Its speed there against candle's NEON matmuls is unmeasured (no ARM host here).
pub fn attention_pays() -> bool {
    cfg!(target_arch = "aarch64") || isa() != Isa::Portable
}

/// The instruction set the kernels use on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F (16 f32 lanes) with FMA.
    Avx512,
    /// AVX2 with FMA (8 lanes).
    Avx2,
    /// The 8-lane path every CPU of the target has: NEON intrinsics on aarch64,
    /// plain Rust arrays elsewhere (SSE2 on a bare x86-64).
    Portable,
}

impl Isa {
    /// Whether this CPU can run the kernels built for `self`.
    pub fn supported(self) -> bool {
        match self {
            Self::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every path this CPU can run, widest first (tests prove each one).
    pub fn all_supported() -> Vec<Isa> {
        [Self::Avx512, Self::Avx2, Self::Portable].into_iter().filter(|i| i.supported()).collect()
    }

    /// f32 lanes per vector on this instruction set.
    pub(crate) fn lanes(self) -> usize {
        use simd::Simd;
        match self {
            Self::Avx512 => 16,
            Self::Avx2 => 8,
            Self::Portable => simd::Portable::LANES,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Avx512 => "avx512",
            Self::Avx2 => "avx2+fma",
            Self::Portable if cfg!(target_arch = "aarch64") => "neon",
            Self::Portable => "portable",
        }
    }
}

/// Detected once per process. `BRUME_KERNEL_ISA=avx2|portable` caps it (to test
/// the narrower paths on a wider machine); a wider value than the CPU has is ignored.
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let detected = detect();
        let capped = match std::env::var("BRUME_KERNEL_ISA").as_deref() {
            Ok("portable") => Isa::Portable,
            Ok("avx2") if detected == Isa::Avx512 => Isa::Avx2,
            _ => detected,
        };
        tracing::debug!(isa = capped.name(), "CPU kernels");
        capped
    })
}

fn detect() -> Isa {
    Isa::all_supported()[0]
}

/// A raw pointer that rayon tasks may share because each task writes a disjoint
/// part of the buffer behind it (every use says why its part is disjoint).
#[derive(Clone, Copy)]
pub(crate) struct SharedMut(pub *mut f32);
// SAFETY: only used for buffers that outlive the parallel loop, with disjoint writes per task.
unsafe impl Send for SharedMut {}
// SAFETY: as above.
unsafe impl Sync for SharedMut {}

impl SharedMut {
    /// The pointer (a method, so closures capture the whole Send + Sync wrapper).
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// The error a kernel called for an instruction set this CPU lacks returns.
pub(crate) fn require(isa: Isa) -> candle_core::Result<()> {
    if isa.supported() {
        Ok(())
    } else {
        candle_core::bail!("this CPU cannot run the {} kernels", isa.name())
    }
}

/// Checks that every element a strided view addresses lies inside its buffer, so
/// the kernels' unchecked pointer arithmetic stays in bounds.
pub(crate) fn check_bounds(len: usize, layout: &candle_core::Layout) -> candle_core::Result<()> {
    let last = layout
        .dims()
        .iter()
        .zip(layout.stride())
        .try_fold(layout.start_offset(), |acc, (&d, &s)| if d == 0 { None } else { Some(acc + (d - 1) * s) });
    match last {
        Some(last) if last >= len => candle_core::bail!("kernel input view ends at {last}, past its buffer of {len}"),
        _ => Ok(()),
    }
}
