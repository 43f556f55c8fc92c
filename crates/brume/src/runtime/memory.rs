//! Process memory as the OS accounts it. Peak RSS counts memory-mapped weight
//! pages too; private dirty memory is what a phone's jetsam actually charges.

/// Resident and peak resident set size, and private dirty bytes, when the OS tells.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryReading {
    pub rss: Option<u64>,
    pub peak_rss: Option<u64>,
    pub private_dirty: Option<u64>,
}

/// Reads the current process's memory figures (Linux: /proc; elsewhere: none yet).
pub fn read() -> MemoryReading {
    #[cfg(target_os = "linux")]
    {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let field = |text: &str, key: &str| -> Option<u64> {
            text.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
                .map(|kb| kb * 1024)
        };
        let smaps = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
        MemoryReading {
            rss: field(&status, "VmRSS:"),
            peak_rss: field(&status, "VmHWM:"),
            private_dirty: field(&smaps, "Private_Dirty:"),
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        MemoryReading::default()
    }
}

/// Human-readable bytes (MiB with one decimal).
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// A global allocator that counts the live heap bytes and their peak, and keeps
/// freed large blocks for reuse as long as that never raises the peak.
///
/// Counting: the kernel keeps a peak of RSS but none of private dirty memory, and
/// a sampler misses spikes shorter than its interval (a GroupNorm's temporaries
/// live for one op). Every tensor is a heap allocation, so counting at the
/// allocator gives the exact peak of what the estimator predicts.
///
/// Reuse: the system allocator maps each large tensor afresh and unmaps it when
/// it is dropped, so every step of a UNet faults its activations in again page by
/// page (a bf16 SD 1.5 step at 512 px on two cores faulted ~3.9 GB, a quarter of its
/// time in the kernel). A denoising loop asks for the same sizes every step, so
/// freed blocks of at least [`REUSE_MIN`] bytes are kept and handed out again for
/// the same size. The rule that keeps memory reports and budgets true: kept bytes
/// plus live bytes never exceed the counted peak, so private memory stays within
/// what the count reports and the estimator predicts; a block is released to the
/// system instead when keeping it would break that, blocks are released before a
/// new allocation would, and [`reset_heap_peak`] and [`release_reused_blocks`]
/// release them all.
///
/// A binary opts in with `#[global_allocator] static A: CountingAllocator = CountingAllocator;`.
pub struct CountingAllocator;

static HEAP_LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static HEAP_PEAK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn heap_grew(bytes: usize) {
    use std::sync::atomic::Ordering::Relaxed;
    let live = HEAP_LIVE.fetch_add(bytes, Relaxed) + bytes;
    HEAP_PEAK.fetch_max(live, Relaxed);
}

fn heap_shrank(bytes: usize) {
    HEAP_LIVE.fetch_sub(bytes, std::sync::atomic::Ordering::Relaxed);
}

/// Smallest block kept for reuse: below it the system allocator's own free lists
/// already reuse memory without faults.
pub const REUSE_MIN: usize = 1 << 20;

/// Freed large blocks, by exact size and alignment. Fixed slots and a spin lock:
/// the allocator must not allocate, and the lock is held for a scan of the slots.
struct Reuse {
    lock: std::sync::atomic::AtomicBool,
    slots: std::cell::UnsafeCell<[Block; REUSE_SLOTS]>,
    /// Bytes held in the slots (written under the lock).
    held: std::sync::atomic::AtomicUsize,
    hits: std::sync::atomic::AtomicUsize,
}

const REUSE_SLOTS: usize = 64;

#[derive(Clone, Copy)]
struct Block {
    /// 0 for an empty slot.
    ptr: usize,
    size: usize,
    align: usize,
}

const EMPTY: Block = Block { ptr: 0, size: 0, align: 0 };

// SAFETY: the slots are only touched while `lock` is held.
unsafe impl Sync for Reuse {}

static REUSE: Reuse = Reuse {
    lock: std::sync::atomic::AtomicBool::new(false),
    slots: std::cell::UnsafeCell::new([EMPTY; REUSE_SLOTS]),
    held: std::sync::atomic::AtomicUsize::new(0),
    hits: std::sync::atomic::AtomicUsize::new(0),
};

impl Reuse {
    fn with<R>(&self, f: impl FnOnce(&mut [Block; REUSE_SLOTS], &std::sync::atomic::AtomicUsize) -> R) -> R {
        use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
        while self.lock.compare_exchange_weak(false, true, Acquire, Relaxed).is_err() {
            std::hint::spin_loop();
        }
        // SAFETY: the lock is held, so no other thread touches the slots.
        let r = f(unsafe { &mut *self.slots.get() }, &self.held);
        self.lock.store(false, Release);
        r
    }

    /// A kept block of exactly this size and alignment, removed from the slots.
    fn take(&self, size: usize, align: usize) -> Option<*mut u8> {
        use std::sync::atomic::Ordering::Relaxed;
        if self.held.load(Relaxed) < size {
            return None;
        }
        let p = self.with(|slots, held| {
            let slot = slots.iter_mut().find(|b| b.ptr != 0 && b.size == size && b.align == align)?;
            let p = slot.ptr as *mut u8;
            *slot = EMPTY;
            held.fetch_sub(size, Relaxed);
            Some(p)
        });
        if p.is_some() {
            self.hits.fetch_add(1, Relaxed);
        }
        p
    }

    /// Keeps a freed block when held + live + size stays within the peak and a slot
    /// is free; `false` means the caller releases it.
    fn keep(&self, ptr: *mut u8, size: usize, align: usize) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.with(|slots, held| {
            let room = HEAP_PEAK.load(Relaxed).saturating_sub(HEAP_LIVE.load(Relaxed));
            if held.load(Relaxed) + size > room {
                return false;
            }
            let Some(slot) = slots.iter_mut().find(|b| b.ptr == 0) else { return false };
            *slot = Block { ptr: ptr as usize, size, align };
            held.fetch_add(size, Relaxed);
            true
        })
    }

    /// Releases kept blocks to the system until at most `limit` bytes are held.
    fn shrink_to(&self, limit: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.held.load(Relaxed) <= limit {
            return;
        }
        let mut out = [EMPTY; REUSE_SLOTS];
        self.with(|slots, held| {
            for (slot, o) in slots.iter_mut().zip(out.iter_mut()) {
                if held.load(Relaxed) <= limit {
                    break;
                }
                if slot.ptr != 0 {
                    held.fetch_sub(slot.size, Relaxed);
                    *o = *slot;
                    *slot = EMPTY;
                }
            }
        });
        // Outside the lock: unmapping takes a system call.
        for b in out.iter().filter(|b| b.ptr != 0) {
            // SAFETY: the block came from System with exactly this size and alignment
            // and was removed from the slots, so it is released once.
            unsafe { std::alloc::System.dealloc(b.ptr as *mut u8, std::alloc::Layout::from_size_align_unchecked(b.size, b.align)) };
        }
    }

    /// Makes room for a new block of `size` from the system: what is kept must fit
    /// under the peak with the block live.
    fn before_new(&self, size: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        let (live, peak) = (HEAP_LIVE.load(Relaxed), HEAP_PEAK.load(Relaxed));
        self.shrink_to(peak.saturating_sub(live + size));
    }
}

use std::alloc::GlobalAlloc;

// SAFETY: every block comes from the system allocator with the layout it is
// later released with: a kept block is handed out again only for the same size
// and alignment, and released to the system once, by whoever removes it from the
// slots. The counters are only updated for allocations that succeeded.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() >= REUSE_MIN {
            if let Some(p) = REUSE.take(layout.size(), layout.align()) {
                heap_grew(layout.size());
                return p;
            }
            REUSE.before_new(layout.size());
        }
        let p = unsafe { std::alloc::System.alloc(layout) };
        if !p.is_null() {
            heap_grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() >= REUSE_MIN {
            if let Some(p) = REUSE.take(layout.size(), layout.align()) {
                // SAFETY: the block holds layout.size() bytes and is ours alone now.
                unsafe { std::ptr::write_bytes(p, 0, layout.size()) };
                heap_grew(layout.size());
                return p;
            }
            REUSE.before_new(layout.size());
        }
        let p = unsafe { std::alloc::System.alloc_zeroed(layout) };
        if !p.is_null() {
            heap_grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        heap_shrank(layout.size());
        if layout.size() >= REUSE_MIN && REUSE.keep(ptr, layout.size(), layout.align()) {
            return;
        }
        unsafe { std::alloc::System.dealloc(ptr, layout) };
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            REUSE.before_new(new_size - layout.size());
        }
        let p = unsafe { std::alloc::System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                heap_grew(new_size - layout.size());
            } else {
                heap_shrank(layout.size() - new_size);
            }
        }
        p
    }
}

/// Releases every freed block [`CountingAllocator`] keeps for reuse to the system:
/// when a segment is dropped (its activations' sizes will not come again) or a
/// new peak starts.
pub fn release_reused_blocks() {
    REUSE.shrink_to(0);
}

/// Bytes of freed blocks kept for reuse, and how many allocations reused one.
pub fn reuse_stats() -> (u64, u64) {
    use std::sync::atomic::Ordering::Relaxed;
    (REUSE.held.load(Relaxed) as u64, REUSE.hits.load(Relaxed) as u64)
}

/// Live heap bytes and their peak since the last [`reset_heap_peak`], when the
/// running binary installed [`CountingAllocator`] (otherwise `None`).
pub fn heap() -> Option<(u64, u64)> {
    use std::sync::atomic::Ordering::Relaxed;
    let peak = HEAP_PEAK.load(Relaxed);
    // Any program has allocated by the time it asks, so a zero peak means the
    // counting allocator is not the global one.
    (peak > 0).then(|| (HEAP_LIVE.load(Relaxed) as u64, peak as u64))
}

/// Starts a new heap peak from what is live now (kept blocks are released first:
/// they would be private memory above the new peak).
pub fn reset_heap_peak() {
    use std::sync::atomic::Ordering::Relaxed;
    release_reused_blocks();
    if HEAP_PEAK.load(Relaxed) > 0 {
        HEAP_PEAK.store(HEAP_LIVE.load(Relaxed).max(1), Relaxed);
    }
}

/// Watches the process's memory: the kernel keeps the peak RSS (VmHWM) but no
/// peak of private dirty memory. With [`CountingAllocator`] installed, that
/// peak is the private dirty memory at the start plus the heap's growth to its
/// exact peak; a background thread also samples private dirty every
/// `interval` (it sees what the heap count does not: stacks, libraries), and
/// the larger of the two is reported. Without the allocator a spike shorter
/// than the interval can be missed.
pub struct PeakWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: Option<std::thread::JoinHandle<u64>>,
    /// Private dirty bytes and live heap bytes when the watch started.
    base: Option<(u64, u64)>,
}

impl PeakWatch {
    pub fn start(interval: std::time::Duration) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        reset_heap_peak();
        let base = read().private_dirty.zip(heap().map(|(live, _)| live));
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::Builder::new()
            .name("brume-peak-watch".into())
            .spawn(move || {
                let mut peak = 0u64;
                loop {
                    if let Some(d) = read().private_dirty {
                        peak = peak.max(d);
                    }
                    if flag.load(Ordering::Relaxed) {
                        return peak;
                    }
                    // Parked, not asleep: `finish` wakes it at once.
                    std::thread::park_timeout(interval);
                }
            })
            .ok();
        Self { stop, handle, base }
    }

    /// Stops sampling; returns (peak RSS from the kernel, peak private dirty).
    pub fn finish(mut self) -> (Option<u64>, Option<u64>) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let sampled = self.handle.take().and_then(|h| {
            h.thread().unpark();
            h.join().ok()
        });
        let sampled = sampled.filter(|&d| d > 0);
        let counted = self.base.zip(heap()).map(|((dirty, live), (_, peak))| dirty + peak.saturating_sub(live));
        let now = read();
        (now.peak_rss, sampled.max(counted).max(now.private_dirty))
    }
}

/// Makes freed tensor memory go back to the OS at once. glibc's allocator
/// serves requests under a threshold (which grows with use, up to 32 MiB) from
/// heaps it keeps after `free`, so a process that has run a model holds on to
/// its largest activations; a fixed 1 MiB threshold maps every tensor of note
/// on its own and unmaps it when dropped, so private memory follows what is
/// alive (what the estimator predicts and a phone's budget needs).
pub fn return_freed_memory_promptly() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; called before heavy allocation.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 4 << 20);
    }
}
