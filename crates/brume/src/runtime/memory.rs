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

/// A global allocator that counts the live heap bytes and their peak.
///
/// The kernel keeps a peak of RSS but none of private dirty memory, and a
/// sampler misses spikes shorter than its interval (a GroupNorm's temporaries
/// live for one op). Every tensor is a heap allocation, so counting at the
/// allocator gives the exact peak of what the estimator predicts. A binary
/// opts in with `#[global_allocator] static A: CountingAllocator = CountingAllocator;`;
/// two relaxed atomic operations per allocation are its whole cost.
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

// SAFETY: every call is forwarded unchanged to the system allocator; the
// counters are only updated for allocations that succeeded.
unsafe impl std::alloc::GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let p = std::alloc::System.alloc(layout);
        if !p.is_null() {
            heap_grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        let p = std::alloc::System.alloc_zeroed(layout);
        if !p.is_null() {
            heap_grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        std::alloc::System.dealloc(ptr, layout);
        heap_shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        let p = std::alloc::System.realloc(ptr, layout, new_size);
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

/// Live heap bytes and their peak since the last [`reset_heap_peak`], when the
/// running binary installed [`CountingAllocator`] (otherwise `None`).
pub fn heap() -> Option<(u64, u64)> {
    use std::sync::atomic::Ordering::Relaxed;
    let peak = HEAP_PEAK.load(Relaxed);
    // Any program has allocated by the time it asks, so a zero peak means the
    // counting allocator is not the global one.
    (peak > 0).then(|| (HEAP_LIVE.load(Relaxed) as u64, peak as u64))
}

/// Starts a new heap peak from what is live now.
pub fn reset_heap_peak() {
    use std::sync::atomic::Ordering::Relaxed;
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
