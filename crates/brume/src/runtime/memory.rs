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

/// A global allocator that counts the live heap bytes and their peak, and serves
/// large blocks from pages it keeps resident as long as that never raises the peak.
///
/// Counting: the kernel keeps a peak of RSS but none of private dirty memory, and
/// a sampler misses spikes shorter than its interval (a GroupNorm's temporaries
/// live for one op). Every tensor is a heap allocation, so counting at the
/// allocator gives the exact peak of what the estimator predicts.
///
/// Reuse: blocks of at least [`REUSE_MIN`] bytes come from one reserved address
/// range where freed blocks merge with their neighbours and are carved again
/// (`large_blocks`), so a denoising loop's activations land on pages that are
/// already resident instead of being faulted in afresh every step. The rule that
/// keeps memory reports and budgets true: resident free bytes plus live bytes never
/// exceed the counted peak; free pages go back to the OS when keeping them would
/// break that, and [`reset_heap_peak`] and [`release_reused_blocks`] give them all
/// back. Where the range cannot be reserved (or is full) blocks come from the
/// system allocator, as smaller ones always do.
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

/// How many free bytes may stay resident: the counted peak less the live bytes.
fn room() -> usize {
    use std::sync::atomic::Ordering::Relaxed;
    HEAP_PEAK.load(Relaxed).saturating_sub(HEAP_LIVE.load(Relaxed))
}

/// Smallest block served from the reused range: below it the system allocator's
/// own free lists already reuse memory without faults.
pub const REUSE_MIN: usize = 1 << 20;

impl CountingAllocator {
    /// A large block from the reused range, counted; `None` to use the system's.
    fn large(layout: std::alloc::Layout, zeroed: bool) -> Option<*mut u8> {
        large_blocks::alloc(layout.size(), layout.align(), zeroed, |size| {
            heap_grew(size);
            room()
        })
    }

    /// A block from the system allocator, counted.
    ///
    /// SAFETY: as `GlobalAlloc::alloc`.
    unsafe fn system(layout: std::alloc::Layout, zeroed: bool) -> *mut u8 {
        let p = unsafe { if zeroed { std::alloc::System.alloc_zeroed(layout) } else { std::alloc::System.alloc(layout) } };
        if !p.is_null() {
            heap_grew(layout.size());
        }
        p
    }
}

use super::large_blocks;
use std::alloc::GlobalAlloc;

// SAFETY: a block from the reused range is recognised by its address and goes
// back there with the same rounded size it was counted with; every other block
// goes back to the system allocator with the layout it came with. The counters
// are only updated for allocations that succeeded.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() >= REUSE_MIN {
            if let Some(p) = Self::large(layout, false) {
                return p;
            }
        }
        unsafe { Self::system(layout, false) }
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() >= REUSE_MIN {
            if let Some(p) = Self::large(layout, true) {
                return p;
            }
        }
        unsafe { Self::system(layout, true) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        if large_blocks::owns(ptr) {
            let size = large_blocks::rounded(layout.size());
            heap_shrank(size);
            large_blocks::free(ptr, size, room());
            return;
        }
        heap_shrank(layout.size());
        unsafe { std::alloc::System.dealloc(ptr, layout) };
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        if large_blocks::owns(ptr) || new_size >= REUSE_MIN {
            // Into or out of the reused range: a new block, the bytes copied over.
            // SAFETY: GlobalAlloc's contract: new_size > 0 and the rounded layout is valid.
            let new = unsafe { std::alloc::Layout::from_size_align_unchecked(new_size, layout.align()) };
            let p = unsafe { self.alloc(new) };
            if !p.is_null() {
                // SAFETY: both blocks hold at least the smaller size and are distinct.
                unsafe {
                    std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                    self.dealloc(ptr, layout);
                }
            }
            return p;
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

/// Gives every free page the allocator keeps resident back to the OS: when a
/// segment is dropped (its activations' sizes will not come again) or a new peak
/// starts.
pub fn release_reused_blocks() {
    large_blocks::release_to(0);
}

/// Bytes of free pages kept resident for reuse, and how many large allocations
/// were served from such pages.
pub fn reuse_stats() -> (u64, u64) {
    let (held, hits) = large_blocks::stats();
    (held as u64, hits as u64)
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
/// alive (what the estimator predicts and a phone's budget needs). Under
/// [`CountingAllocator`] such blocks come from its reused range instead (which
/// keeps the same bound); the threshold still holds for those it cannot serve,
/// and for binaries without it.
pub fn return_freed_memory_promptly() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; called before heavy allocation.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 4 << 20);
    }
}

