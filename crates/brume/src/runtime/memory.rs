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
