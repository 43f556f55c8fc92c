//! Files: private directories, atomic durable writes and the lock that tells
//! one process it has the gallery to itself.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{GalleryError, Result};

/// Prefix of the temporary files of writes in progress; any left at start-up
/// belong to an interrupted write and are removed.
pub const TEMP_PREFIX: &str = ".tmp-";

/// Creates `path` (and missing parents) as a directory only its owner can enter,
/// or checks an existing one: a symlink or a non-directory is refused, and group
/// or other permissions on it are taken away.
pub fn private_dir(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => Err(GalleryError::DataDir {
            path: path.to_path_buf(),
            reason: "is a symbolic link; give the real directory".into(),
        }),
        Ok(m) if !m.is_dir() => Err(GalleryError::DataDir {
            path: path.to_path_buf(),
            reason: "is not a directory".into(),
        }),
        Ok(m) => {
            #[cfg(unix)]
            {
                use std::os::unix::fs::{MetadataExt, PermissionsExt};
                // SAFETY: geteuid has no preconditions.
                if m.uid() != unsafe { libc::geteuid() } {
                    tracing::warn!(path = %path.display(), "gallery directory belongs to another user, who can read every image");
                }
                if m.permissions().mode() & 0o077 != 0 {
                    tracing::warn!(path = %path.display(), "gallery directory was readable by others; setting it to 0700");
                    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
                        .map_err(GalleryError::io(path, "cannot set permissions to 0700"))?;
                }
            }
            #[cfg(not(unix))]
            let _ = m;
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut b = std::fs::DirBuilder::new();
            b.recursive(true);
            #[cfg(unix)]
            std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
            b.create(path).map_err(GalleryError::io(path, "cannot create directory"))
        }
        Err(e) => Err(GalleryError::Io {
            path: path.to_path_buf(),
            action: "cannot inspect",
            source: e,
        }),
    }
}

/// Makes durable the names in a directory (a rename or a new file).
pub fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(GalleryError::io(dir, "cannot sync directory"))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

fn create_private(path: &Path) -> std::io::Result<File> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    o.open(path)
}

/// Writes `bytes` as `dir/name` so that the name only ever points at complete,
/// durable contents: a temporary file is written and synced, renamed over the
/// name, then the directory is synced.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let tmp = dir.join(format!(
        "{TEMP_PREFIX}{}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        crate::time::now_ms()
    ));
    let result = (|| {
        let mut f = create_private(&tmp).map_err(GalleryError::io(&tmp, "cannot create"))?;
        f.write_all(bytes).map_err(GalleryError::io(&tmp, "cannot write"))?;
        f.sync_all().map_err(GalleryError::io(&tmp, "cannot sync"))?;
        drop(f);
        let dest = dir.join(name);
        std::fs::rename(&tmp, &dest).map_err(GalleryError::io(&dest, "cannot rename into place"))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result?;
    sync_dir(dir)
}

/// Whether `path` is a regular file (not a symlink) of exactly `len` bytes.
pub fn is_file_of_len(path: &Path, len: u64) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_file() && m.len() == len)
}

/// Reads a regular file of at most `max` bytes (without trusting its stated size).
pub fn read_capped(path: &Path, max: usize) -> Result<Vec<u8>> {
    use std::io::Read;
    let f = File::open(path).map_err(GalleryError::io(path, "cannot open"))?;
    let m = f.metadata().map_err(GalleryError::io(path, "cannot inspect"))?;
    if !m.is_file() {
        return Err(GalleryError::BadPng {
            what: path.display().to_string(),
            reason: "not a regular file".into(),
        });
    }
    let mut out = Vec::new();
    f.take(max as u64 + 1)
        .read_to_end(&mut out)
        .map_err(GalleryError::io(path, "cannot read"))?;
    if out.len() > max {
        return Err(GalleryError::BadPng {
            what: path.display().to_string(),
            reason: format!("larger than the {} MiB limit", max >> 20),
        });
    }
    Ok(out)
}

/// An advisory lock on `gallery.lock`: held shared by every process that has the
/// gallery open; taken exclusively (without waiting) at open to learn whether
/// this process is alone, which is when reconciling files against rows is safe
/// (another process may be between writing a file and committing its row).
pub struct DirLock {
    #[cfg_attr(not(unix), allow(dead_code))]
    file: File,
}

impl DirLock {
    /// Opens the lock file and tries to take it exclusively; returns the lock and
    /// whether that succeeded.
    pub fn open_exclusive(path: &Path) -> Result<(Self, bool)> {
        let mut o = std::fs::OpenOptions::new();
        o.read(true).write(true).create(true).truncate(false);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
        let file = o.open(path).map_err(GalleryError::io(path, "cannot open lock file"))?;
        #[cfg(unix)]
        {
            use std::os::unix::io::AsRawFd;
            // SAFETY: flock on a descriptor this File owns.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    // Another process has it open: share it.
                    // SAFETY: as above.
                    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH) };
                    return Ok((Self { file }, false));
                }
                return Err(GalleryError::Io {
                    path: path.to_path_buf(),
                    action: "cannot lock",
                    source: e,
                });
            }
            Ok((Self { file }, true))
        }
        #[cfg(not(unix))]
        Ok((Self { file }, true))
    }

    /// After reconciling: let other processes in.
    pub fn share(&self) {
        #[cfg(unix)]
        {
            use std::os::unix::io::AsRawFd;
            // SAFETY: flock on a descriptor this File owns.
            unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_SH) };
        }
    }
}
