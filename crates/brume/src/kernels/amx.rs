//! AMX tile kernels (Intel Xeon since Sapphire Rapids): bf16 products, f32 sums.
//!
//! One `tdpbf16ps` multiplies a 16 x 32 bf16 tile by a 32 x 16 one into a 16 x 16
//! f32 tile: 16 384 FLOPs per instruction, about 1 000 per cycle per core (measured
//! 2.7 TFLOP/s on one Xeon core), several times what `vdpbf16ps` on zmm registers
//! reaches. On a CPU that has it, `--compute bf16` runs its 3x3 convolutions, 1x1
//! convolutions and linear layers here. The numbers are those of the AVX512-BF16
//! kernels: both round the two factors to bf16 (nearest even) and sum in f32; only
//! the order of the f32 sums differs.
//!
//! Every product is C (M x N) += A (M x K) B (K x N) on 32 x 32 output blocks: four
//! accumulator tiles (tmm0-3), two A tiles (tmm4, tmm5: rows 0-15 and 16-31, 32 bf16
//! of K each) and two B tiles (tmm6, tmm7: 16 K-pairs x 16 columns, one 32-bit word
//! holding B[2p][j] low and B[2p + 1][j] high). A tile load takes a row stride, so a
//! 3x3 conv reads B straight from the packed input: zero-bordered planes of channel
//! pairs in the flat layout ([`super::conv3x3::Flat`]), shifted per tap, with no
//! im2col copy. K is padded to whole tiles with zeros on both sides, M and N to whole
//! blocks (the padding is computed and never stored).
//!
//! Linux keeps a process's 8 KiB of tile state disabled until it asks for it
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); [`supported`] asks once. Each task loads the
//! tile configuration on its own thread and releases the tiles when it ends.

use candle_core::Result;

use super::conv3x3::{Dims, Flat};
use super::matmul::BLayout;

/// Whether this process can run the AMX kernels: the CPU has AMX-TILE and AMX-BF16
/// (and AVX512-BF16, used to pack the factors), the OS granted the tile state, and
/// `BRUME_AMX` is not `off` (to compare against the AVX512-BF16 kernels).
pub fn supported() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        let off = std::env::var("BRUME_AMX").is_ok_and(|v| v == "off" || v == "0");
        let ok = !off && imp::enable();
        tracing::debug!(amx = ok, "AMX tiles");
        ok
    })
}

fn require() -> Result<()> {
    if supported() {
        Ok(())
    } else {
        candle_core::bail!("AMX kernels need a CPU with AMX-BF16 and the OS's tile state")
    }
}

/// A 3x3 kernel [o, c, 3, 3] rounded to bf16 and laid out for the tiles: tap-major
/// rows `wt[(tap * op + oc) * k2 + ch]`, zero past o and c. Half the f32 kernel's
/// bytes; the layers keep one per in-place weight (see [`crate::layers::mapped`]) so
/// a UNet step does not repack its weights (1.7 GB of bf16 for SD 1.5).
pub struct PackedConv3x3 {
    wt: Vec<u16>,
    out_ch: usize,
    in_ch: usize,
}

impl PackedConv3x3 {
    pub fn new(weights: &[f32], out_ch: usize, in_ch: usize) -> Result<Self> {
        require()?;
        if weights.len() != out_ch * in_ch * 9 {
            candle_core::bail!("conv3x3 amx: {} weights for [{out_ch}, {in_ch}, 3, 3]", weights.len());
        }
        Ok(Self { wt: imp::pack_conv(weights, out_ch, in_ch), out_ch, in_ch })
    }

    pub fn bytes(&self) -> usize {
        self.wt.len() * 2
    }
}

/// The left factor A [m, k] of a product: bf16 rows of `kp` values (k padded to a
/// tile), whole blocks of 32 rows, zeros in the padding.
pub struct PackedRows {
    data: Vec<u16>,
    m: usize,
    k: usize,
}

impl PackedRows {
    /// `a[i * lda + kk]` for i < m, kk < k.
    pub fn new(a: &[f32], m: usize, k: usize, lda: usize) -> Result<Self> {
        require()?;
        if !super::matmul::a_fits(a, m, k, lda) {
            candle_core::bail!("gemm amx: A of {} values is too short for {m}x{k} (row stride {lda})", a.len());
        }
        // An empty factor packs to nothing (the product is empty or zero).
        let data = if m == 0 || k == 0 { Vec::new() } else { imp::pack_rows(a, m, k, lda) };
        Ok(Self { data, m, k })
    }

    pub fn bytes(&self) -> usize {
        self.data.len() * 2
    }
}

/// The right factor B [k, n] of a product: k / 2 rows (k padded to a tile) of pair
/// words (B[2p][j] low, B[2p + 1][j] high), n padded to whole blocks of 32.
pub struct PackedPairs {
    data: Vec<u32>,
    k: usize,
    n: usize,
}

impl PackedPairs {
    pub(crate) fn new(b: &[f32], k: usize, n: usize, bl: BLayout) -> Result<Self> {
        require()?;
        let ok = super::matmul::b_fits(b, k, n, bl);
        if !ok {
            candle_core::bail!("gemm amx: B of {} values is too short for {k}x{n} ({bl:?})", b.len());
        }
        let data = if k == 0 || n == 0 { Vec::new() } else { imp::pack_pairs_of(b, k, n, bl) };
        Ok(Self { data, k, n })
    }

    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }
}

/// Whether `--compute bf16` also runs attention on the tiles ([`super::attention_amx`]):
/// AMX, unless `BRUME_AMX_ATTENTION=off`. On SD 1.5 at 512 px it saves about 8 % of a
/// bf16 UNet step on a 2-core Xeon (2.84-3.06 -> 2.65-2.81 s) and moves the step's
/// error against f32 from 9.06e-3 to 9.57e-3, inside the 1e-2 that makes a mode count
/// as accurate (PyTorch's bf16 is at 1.7e-2); the switch is there to compare.
pub fn attention_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| supported() && !std::env::var("BRUME_AMX_ATTENTION").is_ok_and(|v| v == "off" || v == "0"))
}

/// `out` [b, o, h, w] = conv3x3(`x`, `weights` [o, c, 3, 3]), padding 1, on AMX.
pub(crate) fn conv3x3(x: &[f32], d: Dims, weights: &[f32], out: &mut [f32]) -> Result<()> {
    let packed = PackedConv3x3::new(weights, d.out_ch, d.in_ch)?;
    conv3x3_packed(x, d, &packed, out)
}

/// As [`conv3x3`] with the kernel already packed.
pub(crate) fn conv3x3_packed(x: &[f32], d: Dims, w: &PackedConv3x3, out: &mut [f32]) -> Result<()> {
    require()?;
    let Dims { batch, in_ch: c, out_ch: o, h, w: wd } = d;
    if (w.out_ch, w.in_ch) != (o, c) || x.len() != batch * c * h * wd || out.len() != batch * o * h * wd {
        candle_core::bail!("conv3x3 amx: buffer sizes do not match {d:?} (kernel [{}, {}])", w.out_ch, w.in_ch);
    }
    if out.is_empty() {
        return Ok(());
    }
    if c == 0 {
        out.fill(0.0);
        return Ok(());
    }
    imp::conv3x3(x, d, &w.wt, out);
    Ok(())
}

/// `dst[i][j] = sum_kk a[i * lda + kk] * B[kk][j]` on AMX (see [`super::matmul::gemm`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(m: usize, n: usize, k: usize, a: &[f32], lda: usize, b: &[f32], bl: BLayout, dst: &mut [f32]) -> Result<()> {
    require()?;
    if !super::matmul::check(m, n, k, a, lda, b, bl, dst)? {
        return Ok(());
    }
    gemm_packed(&PackedRows::new(a, m, k, lda)?, &PackedPairs::new(b, k, n, bl)?, dst)
}

/// `dst [m, n] = A B` from packed factors.
pub(crate) fn gemm_packed(a: &PackedRows, b: &PackedPairs, dst: &mut [f32]) -> Result<()> {
    require()?;
    let (m, n, k) = (a.m, b.n, a.k);
    if b.k != k || dst.len() < m * n {
        candle_core::bail!("gemm amx: A {m}x{k}, B {}x{n}, output of {}", b.k, dst.len());
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        dst[..m * n].fill(0.0);
        return Ok(());
    }
    imp::gemm(m, n, k, &a.data, &b.data, dst);
    Ok(())
}

/// GFLOP/s of one thread's tiles multiplying in registers for about `time`
/// (the AMX ceiling; [`super::peak::peak_amx_gflops`] runs it on every thread).
pub(crate) fn tile_rate(time: std::time::Duration) -> Result<f64> {
    require()?;
    Ok(imp::tile_rate(time))
}

/// Bytes of the packed input a 3x3 conv makes on AMX (channel pairs padded to 16,
/// zero-bordered planes); the packed weights are the layer's (see [`PackedConv3x3`]).
pub fn conv3x3_input_bytes(batch: usize, in_ch: usize, h: usize, w: usize) -> usize {
    let g = ConvGeom::new(in_ch, 0, h, w);
    g.flat.bytes(batch, g.cpp)
}

/// Sizes of the packed operands of one 3x3 conv.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct ConvGeom {
    /// Channel pairs, padded to whole K tiles (16 pairs).
    cpp: usize,
    /// bf16 values per packed weight row (2 * cpp).
    k2: usize,
    /// Output channels padded to whole blocks.
    op: usize,
    /// The input's flat layout in blocks of 32 positions.
    flat: Flat,
}

impl ConvGeom {
    fn new(c: usize, o: usize, h: usize, w: usize) -> Self {
        let cpp = c.div_ceil(2).div_ceil(16) * 16;
        Self { cpp, k2: 2 * cpp, op: o.div_ceil(BLOCK) * BLOCK, flat: Flat::new(h, w, BLOCK) }
    }
}

/// Output rows and columns per register block (2 x 2 tiles of 16).
const BLOCK: usize = 32;
/// Bytes of A panels a task keeps hot while it sweeps B (about half an L2).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const A_PANELS_BYTES: usize = 1 << 20;

#[cfg(target_arch = "x86_64")]
pub(super) mod imp {
    use std::arch::asm;

    use rayon::prelude::*;

    use super::super::bf16::{pack_pairs, round_into};
    use super::super::conv3x3::Dims;
    use super::super::matmul::BLayout;
    use super::super::SharedMut;
    use super::{ConvGeom, A_PANELS_BYTES, BLOCK};

    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;

    pub(super) fn enable() -> bool {
        // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
        let r = std::arch::x86_64::__cpuid_count(7, 0);
        if (r.edx >> 22) & 1 == 0 || (r.edx >> 24) & 1 == 0 || !super::super::bf16::supported() {
            return false;
        }
        request_tiles()
    }

    #[cfg(target_os = "linux")]
    fn request_tiles() -> bool {
        // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM takes two integers and only
        // changes which XSAVE features this process may use.
        unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
    }

    #[cfg(not(target_os = "linux"))]
    fn request_tiles() -> bool {
        let _ = (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
        false
    }

    /// Palette 1, all eight tiles 16 rows x 64 bytes.
    #[repr(C, align(64))]
    struct TileConfig {
        palette: u8,
        start_row: u8,
        reserved: [u8; 14],
        colsb: [u16; 16],
        rows: [u8; 16],
    }

    /// The tiles of the calling thread, configured; released on drop, so a task
    /// that ends (or unwinds) leaves no tile state for the OS to save.
    pub(in crate::kernels) struct Tiles;

    impl Tiles {
        /// SAFETY: the process was granted the tile state ([`enable`] returned true).
        pub(in crate::kernels) unsafe fn configure() -> Self {
            let mut cfg = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
            for t in 0..8 {
                cfg.colsb[t] = 64;
                cfg.rows[t] = 16;
            }
            // SAFETY: a valid palette-1 configuration, 64-byte aligned.
            unsafe { asm!("ldtilecfg [{0}]", in(reg) &cfg as *const TileConfig, options(nostack, readonly, preserves_flags)) };
            Tiles
        }
    }

    impl Drop for Tiles {
        fn drop(&mut self) {
            // SAFETY: the tiles were configured by this thread.
            unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
        }
    }

    /// Zeroes the four accumulators.
    ///
    /// SAFETY: the tiles are configured ([`Tiles::configure`]).
    #[inline(always)]
    pub(in crate::kernels) unsafe fn zero() {
        unsafe { asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem, preserves_flags)) };
    }

    /// One K step of a 32 x 32 block: accumulators += A (32 rows at `a`, `lda` bytes
    /// apart, 64 bytes each) x B (16 pair rows at `b`, `ldb` bytes apart, 128 bytes each).
    ///
    /// SAFETY: the tiles are configured; those bytes are readable.
    #[inline(always)]
    pub(in crate::kernels) unsafe fn step(a: *const u8, lda: usize, b: *const u8, ldb: usize) {
        unsafe {
            asm!(
                "tileloadd tmm4, [{a0} + {lda}*1]",
                "tileloadd tmm6, [{b0} + {ldb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b1} + {ldb}*1]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{a1} + {lda}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a,
                a1 = in(reg) a.add(16 * lda),
                b0 = in(reg) b,
                b1 = in(reg) b.add(64),
                lda = in(reg) lda,
                ldb = in(reg) ldb,
                options(nostack, readonly, preserves_flags)
            )
        };
    }

    /// Stores the accumulators as 32 rows of 32 f32 at `c`, rows `ldc` bytes apart.
    ///
    /// SAFETY: the tiles are configured; those bytes are writable.
    #[inline(always)]
    pub(in crate::kernels) unsafe fn store(c: *mut u8, ldc: usize) {
        unsafe {
            asm!(
                "tilestored [{c0} + {ldc}*1], tmm0",
                "tilestored [{c1} + {ldc}*1], tmm1",
                "tilestored [{c2} + {ldc}*1], tmm2",
                "tilestored [{c3} + {ldc}*1], tmm3",
                c0 = in(reg) c,
                c1 = in(reg) c.add(64),
                c2 = in(reg) c.add(16 * ldc),
                c3 = in(reg) c.add(16 * ldc + 64),
                ldc = in(reg) ldc,
                options(nostack, preserves_flags)
            )
        };
    }

    /// GFLOP/s of this thread running `tdpbf16ps` on four independent accumulators
    /// from tiles already loaded (no memory traffic) for about `time`.
    pub(super) fn tile_rate(time: std::time::Duration) -> f64 {
        // One K step in the panel layouts the kernels use: A 32 rows of 64 bytes, B 16
        // rows of 128 bytes (two 16-column tiles side by side), 2 KiB each.
        let (a, b) = (vec![0x3A83u16; BLOCK * BLOCK], vec![0x3A83u16; BLOCK * BLOCK]);
        let start = std::time::Instant::now();
        let mut iters = 0usize;
        // SAFETY: `enable` granted the tiles (the caller checked `supported`); `step`
        // reads 32 rows of 64 bytes from a and 16 rows of 128 bytes from b: 2 KiB each.
        unsafe {
            let _tiles = Tiles::configure();
            zero();
            step(a.as_ptr() as *const u8, BLOCK * 2, b.as_ptr() as *const u8, BLOCK * 4);
            while start.elapsed() < time {
                for _ in 0..256 {
                    asm!(
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        options(nostack, nomem, preserves_flags)
                    );
                }
                iters += 256;
            }
        }
        // 4 instructions x 16 x 16 x 32 multiply-adds x 2 FLOP.
        (iters * 4 * 16 * 16 * 32 * 2) as f64 / start.elapsed().as_secs_f64() / 1e9
    }

    /// Tasks of `band` consecutive items out of `count`, enough of them to feed
    /// every thread (at least four each), each no longer than `max_band`.
    fn bands(count: usize, other_tasks: usize, max_band: usize) -> usize {
        let want = 4 * rayon::current_num_threads();
        let per = want.div_ceil(other_tasks.max(1));
        count.div_ceil(per.max(1)).clamp(1, max_band.max(1))
    }

    /// The tap-major bf16 rows of a [o, c, 3, 3] kernel ([`super::PackedConv3x3`]).
    pub(super) fn pack_conv(weights: &[f32], o: usize, c: usize) -> Vec<u16> {
        let g = ConvGeom::new(c, o, 1, 1);
        // One output channel's nine rows per item, so its [c, 3, 3] weights are read
        // from memory once (tap by tap, they are 9 reads of a whole layer).
        let mut wt = vec![0u16; 9 * g.op * g.k2];
        let rows = SharedMut(wt.as_mut_ptr() as *mut f32);
        (0..o).into_par_iter().for_each(|oc| {
            let src = &weights[oc * c * 9..(oc + 1) * c * 9];
            for tap in 0..9 {
                // SAFETY: row (tap, oc) of k2 values lies inside wt (9 * op rows) and is
                // written by this item only; AVX512-BF16 was checked by `enable`.
                unsafe {
                    let row = std::slice::from_raw_parts_mut((rows.get() as *mut u16).add((tap * g.op + oc) * g.k2), g.k2);
                    gather_tap(src, tap, row);
                }
            }
        });
        wt
    }

    pub(super) fn conv3x3(x: &[f32], d: Dims, wt: &[u16], out: &mut [f32]) {
        let Dims { batch, in_ch: c, out_ch: o, h, w } = d;
        let g = ConvGeom::new(c, o, h, w);
        // Input: per image, cpp planes of pair words in the flat layout, zero-bordered.
        let xp = super::super::conv3x3_bf16::pack_flat_pairs(x, d, g.flat, g.cpp);
        let flat = g.flat;
        let obs = g.op / BLOCK;
        // Output-channel bands whose packed weights (9 taps x 32 rows x k2 each) stay in L2.
        let ob_band = (A_PANELS_BYTES / (9 * BLOCK * g.k2 * 2)).clamp(1, obs);
        let oc_tasks = obs.div_ceil(ob_band);
        let pb_band = bands(flat.blocks, batch * oc_tasks, flat.blocks);
        let p_tasks = flat.blocks.div_ceil(pb_band);
        let dst = SharedMut(out.as_mut_ptr());
        let xp = &xp;
        (0..batch * oc_tasks * p_tasks).into_par_iter().for_each(|t| {
            let (n, rest) = (t / (oc_tasks * p_tasks), t % (oc_tasks * p_tasks));
            let (ot, pt) = (rest / p_tasks, rest % p_tasks);
            let img = &xp[n * g.cpp * flat.plane..(n + 1) * g.cpp * flat.plane];
            let obr = ot * ob_band..((ot + 1) * ob_band).min(obs);
            let pbr = pt * pb_band..((pt + 1) * pb_band).min(flat.blocks);
            // SAFETY: `enable` granted the tiles; the task writes only image n's output
            // channels of `obr` at the flat positions of `pbr`, disjoint from other tasks.
            unsafe { conv_task(img, wt, g, d, n, obr, pbr, dst) };
        });
    }

    /// `dst[ch] = bf16(src[ch * 9 + tap])` for every channel of one output channel's
    /// [c, 3, 3] weights: the tap's column, gathered 16 channels at a time and rounded
    /// by `vcvtneps2bf16` (a scalar loop over a 1280-channel layer's 15 M weights
    /// took longer than the layer's products at 16x16).
    ///
    /// SAFETY: the CPU has AVX512-BF16; `src.len()` is a multiple of 9 and `dst`
    /// holds `src.len() / 9` values.
    #[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
    unsafe fn gather_tap(src: &[f32], tap: usize, dst: &mut [u16]) {
        use std::arch::x86_64::*;
        let c = src.len() / 9;
        let idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(9));
        let mut ch = 0;
        while ch < c {
            let live = (c - ch).min(16);
            let mask: __mmask16 = if live == 16 { 0xFFFF } else { (1u16 << live) - 1 };
            // SAFETY: lanes < live read src[(ch + lane) * 9 + tap] < c * 9; dst[ch..ch + live] is in bounds.
            unsafe {
                let v = _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), mask, idx, src.as_ptr().add(ch * 9 + tap));
                let r: [u16; 16] = std::mem::transmute(_mm512_cvtneps_pbh(v));
                std::ptr::copy_nonoverlapping(r.as_ptr(), dst.as_mut_ptr().add(ch), live);
            }
            ch += 16;
        }
    }

    /// Blocks `pbr` of flat positions x output-channel blocks `obr` of image `n`.
    ///
    /// SAFETY: AMX tiles granted; `img` is the image's cpp packed planes, `wt` the
    /// packed weights of `g`; `dst` the [b, o, h, w] output, of which only this
    /// task's channels and positions of image n are written.
    #[allow(clippy::too_many_arguments)]
    unsafe fn conv_task(
        img: &[u32],
        wt: &[u16],
        g: ConvGeom,
        d: Dims,
        n: usize,
        obr: std::ops::Range<usize>,
        pbr: std::ops::Range<usize>,
        dst: SharedMut,
    ) {
        let (o, h, w, flat) = (d.out_ch, d.h, d.w, g.flat);
        let (lda, ldb) = (g.k2 * 2, flat.plane * 4);
        let kq = g.cpp / 16;
        let mut tile = [0f32; BLOCK * BLOCK];
        // SAFETY: the caller's grant.
        let _tiles = unsafe { Tiles::configure() };
        for pb in pbr {
            let p0 = pb * BLOCK;
            for ob in obr.clone() {
                let m0 = ob * BLOCK;
                // SAFETY: A rows m0..m0 + 32 <= op of each tap, k2 values each; B pair rows
                // q * 16..+16 <= cpp at positions p0 + off..+32 <= plane (off <= 2 * pitch + 2).
                unsafe {
                    zero();
                    for tap in 0..9 {
                        let off = (tap / 3) * flat.pitch + tap % 3;
                        let arow = wt.as_ptr().add((tap * g.op + m0) * g.k2) as *const u8;
                        let bcol = img.as_ptr().add(p0 + off) as *const u8;
                        for q in 0..kq {
                            step(arow.add(q * 64), lda, bcol.add(q * 16 * ldb), ldb);
                        }
                    }
                    store(tile.as_mut_ptr() as *mut u8, BLOCK * 4);
                }
                for r in 0..BLOCK.min(o - m0) {
                    // SAFETY: channel m0 + r < o of image n: a plane inside the output;
                    // scatter writes only its positions of this block.
                    unsafe { flat.scatter(w, h, tile.as_ptr().add(r * BLOCK), p0, BLOCK, dst.get().add((n * o + m0 + r) * h * w)) };
                }
            }
        }
    }

    /// A's bf16 values ([`super::PackedRows`]) in panels: row block ib, K step s is
    /// one contiguous 32 x 32 tile pair at `((ib * ks + s) * 32 + r) * 32`, so each
    /// step's loads read 2 KiB in a row instead of 32 rows a whole row apart.
    pub(super) fn pack_rows(a: &[f32], m: usize, k: usize, lda: usize) -> Vec<u16> {
        let kp = k.div_ceil(BLOCK) * BLOCK;
        let ks = kp / BLOCK;
        let mb = m.div_ceil(BLOCK);
        let mut ap = vec![0u16; mb * BLOCK * kp];
        ap.par_chunks_mut(BLOCK * kp).enumerate().for_each(|(ib, panel)| {
            let mut row = vec![0u16; kp];
            for r in 0..BLOCK.min(m - ib * BLOCK) {
                let i = ib * BLOCK + r;
                // SAFETY: AVX512-BF16 (checked by `enable`); the row holds kp >= k values.
                unsafe { round_into(&a[i * lda..i * lda + k], row.as_mut_ptr()) };
                for s in 0..ks {
                    panel[(s * BLOCK + r) * BLOCK..(s * BLOCK + r + 1) * BLOCK].copy_from_slice(&row[s * BLOCK..(s + 1) * BLOCK]);
                }
            }
        });
        ap
    }

    /// B's pair words ([`super::PackedPairs`]) in panels: column block jb is kp / 2
    /// rows of 32 words at `(jb * kp / 2 + p) * 32`, one contiguous 2 KiB run per K step.
    pub(super) fn pack_pairs_of(b: &[f32], k: usize, n: usize, bl: BLayout) -> Vec<u32> {
        let kp = k.div_ceil(BLOCK) * BLOCK;
        let (nb, half) = (n.div_ceil(BLOCK), kp / 2);
        let mut bp = vec![0u32; nb * half * BLOCK];
        match bl {
            BLayout::KN { ld } => bp.par_chunks_mut(half * BLOCK).enumerate().for_each(|(jb, panel)| {
                let (j0, cols) = (jb * BLOCK, BLOCK.min(n - jb * BLOCK));
                for p in 0..k.div_ceil(2) {
                    let lo = &b[2 * p * ld + j0..2 * p * ld + j0 + cols];
                    let hi = (2 * p + 1 < k).then(|| &b[(2 * p + 1) * ld + j0..(2 * p + 1) * ld + j0 + cols]);
                    // SAFETY: AVX-512 F and BW; the panel row has 32 >= cols words.
                    unsafe { pack_pairs(lo, hi, panel.as_mut_ptr().add(p * BLOCK)) };
                }
            }),
            BLayout::NK { ld } => bp.par_chunks_mut(half * BLOCK).enumerate().for_each(|(jb, panel)| {
                // Column j of B is row j of an [n, k] matrix: round it, then its pair
                // words go down column j % 32 of the panel.
                let mut words = vec![0u32; half];
                for jj in 0..BLOCK.min(n - jb * BLOCK) {
                    let j = jb * BLOCK + jj;
                    words.fill(0);
                    // SAFETY: AVX512-BF16; `words` holds kp >= k bf16 values.
                    unsafe { round_into(&b[j * ld..j * ld + k], words.as_mut_ptr() as *mut u16) };
                    for (p, &v) in words.iter().enumerate() {
                        panel[p * BLOCK + jj] = v;
                    }
                }
            }),
        }
        bp
    }

    /// `dst [m, n]` from packed A and B panels (see `pack_rows`, `pack_pairs_of`).
    pub(super) fn gemm(m: usize, n: usize, k: usize, ap: &[u16], bp: &[u32], dst: &mut [f32]) {
        let kp = k.div_ceil(BLOCK) * BLOCK;
        let (mb, nb) = (m.div_ceil(BLOCK), n.div_ceil(BLOCK));
        let ib_band = (A_PANELS_BYTES / (BLOCK * kp * 2)).clamp(1, mb);
        let i_tasks = mb.div_ceil(ib_band);
        let jb_band = bands(nb, i_tasks, nb);
        let j_tasks = nb.div_ceil(jb_band);
        let out = SharedMut(dst.as_mut_ptr());
        (0..i_tasks * j_tasks).into_par_iter().for_each(|t| {
            let (it, jt) = (t / j_tasks, t % j_tasks);
            let ibr = it * ib_band..((it + 1) * ib_band).min(mb);
            let jbr = jt * jb_band..((jt + 1) * jb_band).min(nb);
            // SAFETY: tiles granted; the task writes only rows of `ibr` x columns of
            // `jbr` of the m x n output, disjoint from other tasks.
            unsafe { gemm_task(ap, bp, m, n, kp, ibr, jbr, out) };
        });
    }

    /// Row blocks `ibr` x column blocks `jbr` of the m x n output.
    ///
    /// SAFETY: AMX tiles granted; `ap` and `bp` are the panels of `pack_rows` and
    /// `pack_pairs_of` for m x kp and kp x n; `out` is the m x n output.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm_task(ap: &[u16], bp: &[u32], m: usize, n: usize, kp: usize, ibr: std::ops::Range<usize>, jbr: std::ops::Range<usize>, out: SharedMut) {
        let ks = kp / BLOCK;
        // Panels (see pack_rows, pack_pairs_of): A tile rows 64 bytes apart, B's 128.
        let (lda, ldb) = (BLOCK * 2, BLOCK * 4);
        let mut tile = [0f32; BLOCK * BLOCK];
        // SAFETY: the caller's grant.
        let _tiles = unsafe { Tiles::configure() };
        for jb in jbr {
            let j0 = jb * BLOCK;
            for ib in ibr.clone() {
                let i0 = ib * BLOCK;
                // SAFETY: row block ib < mb and column block jb < nb of the panels;
                // ks steps of 2 KiB (A) and 2 KiB (B) each inside them.
                unsafe {
                    zero();
                    let arow = ap.as_ptr().add(ib * ks * BLOCK * BLOCK) as *const u8;
                    let bcol = bp.as_ptr().add(jb * ks * 16 * BLOCK) as *const u8;
                    for s in 0..ks {
                        step(arow.add(s * BLOCK * BLOCK * 2), lda, bcol.add(s * 16 * BLOCK * 4), ldb);
                    }
                }
                let (rows, cols) = (BLOCK.min(m - i0), BLOCK.min(n - j0));
                // SAFETY: rows i0..i0 + rows < m, columns j0..j0 + cols <= n.
                unsafe {
                    let at = out.get().add(i0 * n + j0);
                    if rows == BLOCK && cols == BLOCK {
                        store(at as *mut u8, n * 4);
                    } else {
                        store(tile.as_mut_ptr() as *mut u8, BLOCK * 4);
                        for r in 0..rows {
                            std::ptr::copy_nonoverlapping(tile.as_ptr().add(r * BLOCK), at.add(r * n), cols);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod imp {
    use super::super::conv3x3::Dims;
    use super::super::matmul::BLayout;

    const UNREACHABLE: &str = "AMX is x86-64 only; `supported` is false here";

    pub(super) fn tile_rate(_: std::time::Duration) -> f64 {
        unreachable!("{UNREACHABLE}")
    }

    pub(super) fn enable() -> bool {
        false
    }

    pub(super) fn pack_conv(_: &[f32], _: usize, _: usize) -> Vec<u16> {
        unreachable!("{UNREACHABLE}")
    }

    pub(super) fn pack_rows(_: &[f32], _: usize, _: usize, _: usize) -> Vec<u16> {
        unreachable!("{UNREACHABLE}")
    }

    pub(super) fn pack_pairs_of(_: &[f32], _: usize, _: usize, _: BLayout) -> Vec<u32> {
        unreachable!("{UNREACHABLE}")
    }

    pub(super) fn conv3x3(_: &[f32], _: Dims, _: &[u16], _: &mut [f32]) {
        unreachable!("{UNREACHABLE}")
    }

    pub(super) fn gemm(_: usize, _: usize, _: usize, _: &[u16], _: &[u32], _: &mut [f32]) {
        unreachable!("{UNREACHABLE}")
    }
}

/// Runs `f` on the values of a contiguous f32 CPU tensor, where they lie.
fn with_f32<R>(t: &candle_core::Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    use candle_core::{CpuStorage, Storage};
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(data)) = &*storage else {
        candle_core::bail!("AMX kernels take f32 CPU tensors");
    };
    let (a, b) = layout.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("strided tensor".into()))?;
    f(&data[a..b])
}

/// 3x3 / stride 1 / padding 1 convolution of `x` [b, c, h, w] with `w` [o, c, 3, 3]
/// on AMX (no bias); f32 CPU tensors (tests, benches).
pub fn conv3x3_amx(x: &candle_core::Tensor, w: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    let (o, wc, kh, kw) = w.dims4()?;
    let (b, c, h, wd) = x.dims4()?;
    if (kh, kw) != (3, 3) || wc != c {
        candle_core::bail!("conv3x3 amx: kernel {:?} does not fit input {:?}", w.dims(), x.dims());
    }
    let mut out = vec![0f32; b * o * h * wd];
    with_f32(x, |xs| with_f32(w, |ws| conv3x3(xs, Dims { batch: b, in_ch: c, out_ch: o, h, w: wd }, ws, &mut out)))?;
    candle_core::Tensor::from_vec(out, (b, o, h, wd), x.device())
}

/// `a [m, k] x w^T` with `w [n, k]` on AMX (tests, benches).
pub fn linear_amx(a: &candle_core::Tensor, w: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    let (m, k) = a.dims2()?;
    let (n, wk) = w.dims2()?;
    if wk != k {
        candle_core::bail!("linear amx: input width {k}, weight {:?}", w.dims());
    }
    let mut out = vec![0f32; m * n];
    with_f32(a, |av| with_f32(w, |wv| gemm(m, n, k, av, k, wv, BLayout::NK { ld: k }, &mut out)))?;
    candle_core::Tensor::from_vec(out, (m, n), a.device())
}

/// `w [o, k] x x [k, hw]` on AMX: a 1x1 convolution's product (tests, benches).
pub fn conv1x1_amx(w: &candle_core::Tensor, x: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    let (o, k) = w.dims2()?;
    let (xk, hw) = x.dims2()?;
    if xk != k {
        candle_core::bail!("conv1x1 amx: weight {:?} does not fit input {:?}", w.dims(), x.dims());
    }
    let mut out = vec![0f32; o * hw];
    with_f32(w, |wv| with_f32(x, |xv| gemm(o, hw, k, wv, k, xv, BLayout::KN { ld: hw }, &mut out)))?;
    candle_core::Tensor::from_vec(out, (o, hw), x.device())
}
