//! How much memory a generation may use: published device tiers, explicit
//! budgets, and what the OS says is available right now.
//!
//! On a phone the OS does not fail an allocation when memory runs out, it kills
//! the process; knowing the budget before inference is the only defence.

use crate::error::RunError;

const MB: u64 = 1000 * 1000;
const GB: u64 = 1000 * MB;

/// A class of device with its published memory figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceTier {
    pub name: &'static str,
    pub description: &'static str,
    /// What the OS lets an app's working set reach before it is killed.
    pub working_set: u64,
    /// What a model may plan to use, leaving the app and the OS their share.
    pub safe_budget: u64,
}

/// The tiers `--device-tier` knows. Phone figures are the published working-set
/// limits on-device diffusion engineers plan against; desktop tiers leave a
/// quarter of RAM to the OS and other applications.
pub const TIERS: &[DeviceTier] = &[
    DeviceTier { name: "a16", description: "iPhone with A16 (6 GB)", working_set: GB, safe_budget: 700 * MB },
    DeviceTier { name: "a17-pro", description: "iPhone 15 Pro, A17 Pro (8 GB)", working_set: 1400 * MB, safe_budget: GB },
    DeviceTier { name: "m2", description: "iPad with M2", working_set: 3500 * MB, safe_budget: 2500 * MB },
    DeviceTier { name: "m4", description: "iPad with M4", working_set: 3500 * MB, safe_budget: 2500 * MB },
    DeviceTier {
        name: "iphone-8gb",
        description: "8 GB iPhone with the increased-memory entitlement (~4.8 GB process ceiling)",
        working_set: 4800 * MB,
        safe_budget: 3600 * MB,
    },
    DeviceTier { name: "desktop-8gb", description: "8 GB laptop or desktop", working_set: 6 * GB, safe_budget: 4500 * MB },
    DeviceTier { name: "desktop-16gb", description: "16 GB laptop or desktop", working_set: 12 * GB, safe_budget: 9 * GB },
    DeviceTier { name: "desktop-32gb", description: "32 GB laptop or desktop", working_set: 24 * GB, safe_budget: 18 * GB },
];

pub fn tier(name: &str) -> Result<&'static DeviceTier, RunError> {
    TIERS.iter().find(|t| t.name == name).ok_or_else(|| {
        let names: Vec<&str> = TIERS.iter().map(|t| t.name).collect();
        RunError::Invalid(format!("unknown device tier `{name}` (known: {})", names.join(", ")))
    })
}

/// Parses sizes like `1.2GB`, `700MB`, `1.5GiB`, `512MiB` or a plain byte count.
pub fn parse_size(text: &str) -> Result<u64, RunError> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| RunError::Invalid(format!("`{text}` is not a size (examples: 1.2GB, 700MB, 2GiB)")))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => return Err(RunError::Invalid(format!("`{text}`: unknown unit `{other}` (B, KB, MB, GB, KiB, MiB, GiB)"))),
    };
    let bytes = value * mult;
    if !bytes.is_finite() || bytes < 1.0 {
        return Err(RunError::Invalid(format!("`{text}` is not a usable memory size")));
    }
    Ok(bytes as u64)
}

/// One way the OS reported memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub source: String,
    pub bytes: u64,
}

/// What the OS says this process can still use: the smallest of every limit
/// found (cgroup limit minus usage, MemAvailable, an OS-specific figure).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Available {
    pub bytes: u64,
    pub findings: Vec<Finding>,
}

/// Reads the available memory now; `None` when the platform tells nothing.
pub fn available() -> Option<Available> {
    let findings = platform::findings();
    let bytes = findings.iter().map(|f| f.bytes).min()?;
    Some(Available { bytes, findings })
}

/// Where a [`Budget`] came from: the user named a tier or a size, or the OS was asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BudgetSource {
    /// `--device-tier NAME`: the tier's safe model budget.
    Tier(&'static DeviceTier),
    /// `--memory-budget SIZE`, as the user typed it.
    Explicit(String),
    /// Neither flag: what the OS says is available now.
    Available(Available),
    /// Neither flag, and the platform tells nothing: no limit is known.
    Unknown,
}

/// The memory a generation may plan to use, in bytes of private (dirty) memory:
/// the figure a phone's jetsam charges and `RLIMIT_DATA` bounds. Memory-mapped
/// weights are clean, evictable file pages and do not count against it; but a
/// device tier also has a working set (RSS, mapped pages included) past which
/// those pages are evicted and read from storage again on every step, so the
/// planner keeps RSS within it where it can.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    bytes: u64,
    source: BudgetSource,
    working_set: Option<u64>,
}

impl Budget {
    /// Resolves `--device-tier` / `--memory-budget` (at most one may be given);
    /// without either, the memory available now.
    pub fn resolve(tier_name: Option<&str>, size: Option<&str>) -> Result<Self, RunError> {
        match (tier_name, size) {
            (Some(_), Some(_)) => Err(RunError::Invalid(
                "give either --device-tier or --memory-budget, not both".into(),
            )),
            (Some(name), None) => {
                let t = tier(name)?;
                Ok(Self { bytes: t.safe_budget, source: BudgetSource::Tier(t), working_set: Some(t.working_set) })
            }
            (None, Some(text)) => Ok(Self::explicit(parse_size(text)?, text)),
            (None, None) => Ok(match available() {
                Some(a) => Self { bytes: a.bytes, source: BudgetSource::Available(a), working_set: None },
                None => Self { bytes: u64::MAX, source: BudgetSource::Unknown, working_set: None },
            }),
        }
    }

    /// A budget of `bytes`, labelled as the user wrote it.
    pub fn explicit(bytes: u64, label: &str) -> Self {
        Self { bytes, source: BudgetSource::Explicit(label.trim().to_string()), working_set: None }
    }

    /// The same source with fewer bytes (a budget that shrank mid-run).
    pub fn with_bytes(&self, bytes: u64) -> Self {
        Self { bytes, ..self.clone() }
    }

    /// The same budget with a working-set ceiling of `bytes` of RSS.
    pub fn with_working_set(self, bytes: u64) -> Self {
        Self { working_set: Some(bytes), ..self }
    }

    /// The RSS past which mapped weights would be paged from storage during the
    /// run: a device tier's published working set; `None` when not known.
    pub fn working_set(&self) -> Option<u64> {
        self.working_set
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn source(&self) -> &BudgetSource {
        &self.source
    }

    /// The budget now: a tier or explicit size does not change; the OS's figure
    /// is read again, plus the private memory this process already holds (which
    /// the OS no longer counts as available, but the run may reuse).
    pub fn refreshed(&self) -> Self {
        match &self.source {
            BudgetSource::Available(_) => match available() {
                Some(a) => {
                    let own = crate::runtime::memory::read().private_dirty.unwrap_or(0);
                    Self { bytes: a.bytes + own, source: BudgetSource::Available(a), working_set: self.working_set }
                }
                None => self.clone(),
            },
            _ => self.clone(),
        }
    }

    /// Whether a limit is known at all.
    pub fn is_limited(&self) -> bool {
        self.source != BudgetSource::Unknown
    }
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let size = crate::runtime::memory::mib(self.bytes);
        match &self.source {
            BudgetSource::Tier(t) => write!(f, "{size} (device tier {}: {})", t.name, t.description),
            BudgetSource::Explicit(text) => write!(f, "{size} (--memory-budget {text})"),
            BudgetSource::Available(a) => {
                let from = a.findings.iter().find(|x| x.bytes == a.bytes).map(|x| x.source.as_str()).unwrap_or("the OS");
                write!(f, "{size} (available now, from {from})")
            }
            BudgetSource::Unknown => write!(f, "unlimited (the platform reports no available memory)"),
        }
    }
}

#[cfg(target_os = "linux")]
mod platform {
    use super::Finding;

    fn read_u64(path: &str) -> Option<u64> {
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    }

    fn meminfo(key: &str) -> Option<u64> {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = text.lines().find(|l| l.starts_with(key))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
    }

    /// The process's cgroup v2 path (`0::/some/path`), if on the unified hierarchy.
    fn cgroup_v2_dir() -> Option<String> {
        let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
        Some(format!("/sys/fs/cgroup{}", path.trim_end_matches('/')))
    }

    pub fn findings() -> Vec<Finding> {
        let mut out = Vec::new();
        if let Some(dir) = cgroup_v2_dir() {
            // memory.max is "max" when unlimited; walk up to the first limit.
            let mut d = std::path::PathBuf::from(&dir);
            loop {
                let max = d.join("memory.max");
                if let Some(limit) = std::fs::read_to_string(&max).ok().and_then(|s| s.trim().parse::<u64>().ok()) {
                    let usage = read_u64(&d.join("memory.current").to_string_lossy()).unwrap_or(0);
                    out.push(Finding {
                        source: format!("cgroup v2 {} minus memory.current", max.display()),
                        bytes: limit.saturating_sub(usage),
                    });
                    break;
                }
                if !d.pop() || d == std::path::Path::new("/sys/fs") {
                    break;
                }
            }
        }
        if let Some(limit) = read_u64("/sys/fs/cgroup/memory/memory.limit_in_bytes") {
            // v1 reports "unlimited" as a huge number.
            if limit < (1u64 << 60) {
                let usage = read_u64("/sys/fs/cgroup/memory/memory.usage_in_bytes").unwrap_or(0);
                out.push(Finding {
                    source: "cgroup v1 memory.limit_in_bytes minus usage".into(),
                    bytes: limit.saturating_sub(usage),
                });
            }
        }
        if let Some(avail) = meminfo("MemAvailable:") {
            out.push(Finding {
                source: "/proc/meminfo MemAvailable".into(),
                bytes: avail,
            });
        }
        out
    }
}

#[cfg(target_os = "ios")]
mod platform {
    use super::Finding;

    extern "C" {
        /// libSystem (iOS 13+): bytes the process can still allocate before jetsam.
        fn os_proc_available_memory() -> usize;
    }

    pub fn findings() -> Vec<Finding> {
        // SAFETY: a plain query without arguments or side effects.
        let bytes = unsafe { os_proc_available_memory() } as u64;
        vec![Finding {
            source: "os_proc_available_memory".into(),
            bytes,
        }]
    }
}

#[cfg(target_os = "macos")]
mod platform {
    use super::Finding;

    #[repr(C)]
    #[derive(Default)]
    struct VmStatistics64 {
        free_count: u32,
        active_count: u32,
        inactive_count: u32,
        wire_count: u32,
        zero_fill_count: u64,
        reactivations: u64,
        pageins: u64,
        pageouts: u64,
        faults: u64,
        cow_faults: u64,
        lookups: u64,
        hits: u64,
        purges: u64,
        purgeable_count: u32,
        speculative_count: u32,
        decompressions: u64,
        compressions: u64,
        swapins: u64,
        swapouts: u64,
        compressor_page_count: u32,
        throttled_count: u32,
        external_page_count: u32,
        internal_page_count: u32,
        total_uncompressed_pages_in_compressor: u64,
    }

    const HOST_VM_INFO64: i32 = 4;
    const HOST_VM_INFO64_COUNT: u32 = (std::mem::size_of::<VmStatistics64>() / std::mem::size_of::<i32>()) as u32;

    extern "C" {
        fn mach_host_self() -> u32;
        fn host_statistics64(host: u32, flavor: i32, info: *mut i32, count: *mut u32) -> i32;
        fn host_page_size(host: u32, size: *mut usize) -> i32;
    }

    pub fn findings() -> Vec<Finding> {
        let mut stats = VmStatistics64::default();
        let mut count = HOST_VM_INFO64_COUNT;
        let mut page = 0usize;
        // SAFETY: the out-pointers are valid for the sizes passed; mach returns
        // KERN_SUCCESS (0) when it filled them.
        let ok = unsafe {
            let host = mach_host_self();
            host_statistics64(host, HOST_VM_INFO64, &mut stats as *mut _ as *mut i32, &mut count) == 0
                && host_page_size(host, &mut page) == 0
        };
        if !ok {
            return Vec::new();
        }
        // Free and inactive (reclaimable) pages, as Activity Monitor's "available" does.
        let pages = stats.free_count as u64 + stats.inactive_count as u64 + stats.purgeable_count as u64;
        vec![Finding {
            source: "host_statistics64 free + inactive + purgeable".into(),
            bytes: pages * page as u64,
        }]
    }
}

#[cfg(not(any(target_os = "linux", target_os = "ios", target_os = "macos")))]
mod platform {
    pub fn findings() -> Vec<super::Finding> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1.2GB").unwrap(), 1_200_000_000);
        assert_eq!(parse_size("700MB").unwrap(), 700_000_000);
        assert_eq!(parse_size("2GiB").unwrap(), 2 * 1024 * 1024 * 1024);
        assert_eq!(parse_size(" 512 mib ").unwrap(), 512 * 1024 * 1024);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        for bad in ["", "GB", "1.2XB", "-5GB", "0"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tiers_are_named_and_ordered() {
        assert_eq!(tier("a16").unwrap().safe_budget, 700 * MB);
        assert_eq!(tier("a17-pro").unwrap().working_set, 1400 * MB);
        assert!(tier("a15").is_err());
        for t in TIERS {
            assert!(t.safe_budget < t.working_set, "{}", t.name);
        }
    }

    #[test]
    fn budgets_resolve_from_tier_size_or_os() {
        let b = Budget::resolve(Some("a17-pro"), None).unwrap();
        assert_eq!(b.bytes(), GB);
        assert!(matches!(b.source(), BudgetSource::Tier(t) if t.name == "a17-pro"));
        assert!(b.to_string().contains("a17-pro"), "{b}");
        let b = Budget::resolve(None, Some("1.2GB")).unwrap();
        assert_eq!(b.bytes(), 1_200_000_000);
        assert!(b.to_string().contains("--memory-budget 1.2GB"), "{b}");
        assert!(Budget::resolve(Some("a16"), Some("1GB")).is_err());
        let e = Budget::resolve(Some("a15"), None).unwrap_err().to_string();
        assert!(e.contains("a15") && e.contains("a17-pro"), "{e}");
        assert!(Budget::resolve(None, Some("lots")).is_err());
        let os = Budget::resolve(None, None).unwrap();
        #[cfg(target_os = "linux")]
        assert!(matches!(os.source(), BudgetSource::Available(_)) && os.is_limited());
        assert_eq!(os.with_bytes(5).bytes(), 5);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn linux_reports_available_memory() {
        let a = available().expect("MemAvailable at least");
        assert!(a.bytes > 0 && a.findings.iter().any(|f| f.source.contains("MemAvailable")));
    }
}
