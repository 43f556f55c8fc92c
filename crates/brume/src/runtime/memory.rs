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

/// Watches the process's memory from a background thread: the kernel keeps
/// the peak RSS (VmHWM) but no peak of private dirty memory, so that one is
/// sampled. Samples every `interval`; a spike shorter than that can be missed,
/// which is why benchmarks run sizes where each op takes much longer.
pub struct PeakWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: Option<std::thread::JoinHandle<u64>>,
}

impl PeakWatch {
    pub fn start(interval: std::time::Duration) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
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
                    std::thread::sleep(interval);
                }
            })
            .ok();
        Self { stop, handle }
    }

    /// Stops sampling; returns (peak RSS from the kernel, sampled peak private dirty).
    pub fn finish(mut self) -> (Option<u64>, Option<u64>) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let dirty = self.handle.take().and_then(|h| h.join().ok()).filter(|&d| d > 0);
        let now = read();
        (now.peak_rss, dirty.max(now.private_dirty))
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
