//! The one rule every file brume writes goes through.
//!
//! A user's files are never lost to an output path:
//! - the name is *claimed* without replacing: the result is written to a
//!   temporary sibling, flushed and synced, then hard-linked to the name (which
//!   fails if anything is there, even a dangling symlink) instead of renamed over it;
//! - what is not a regular file (a symlink, a folder, a device, a FIFO) is never
//!   followed and never replaced, `--force` or not;
//! - the output is checked before the work ([`Output::check`], an early error
//!   that names the problem) and again at commit time: a file created at the
//!   name during the run survives, and the result is kept under a fresh name next
//!   to it ([`Written::notice`] says so) or, where a fresh name cannot be found,
//!   the write fails having replaced nothing;
//! - `force` replaces only a regular file, by rename (atomic: readers see the old
//!   file or the new one, never a partial one).
//!
//! Files rewritten during a run (a preview) are claimed once and then replaced
//! only while they are still the file this process wrote ([`Claimed`]).
//!
//! ```no_run
//! use brume::output::Output;
//! # fn work() -> Vec<u8> { Vec::new() }
//! # fn main() -> Result<(), brume::output::OutputError> {
//! let out = Output::new("picture.png", false);
//! out.check()?; // before the work: "picture.png exists; pass --force to replace it"
//! let bytes = work();
//! let written = out.write_bytes(&bytes)?; // claims the name, or a fresh one next to it
//! if let Some(note) = written.notice() {
//!     eprintln!("warning: {note}");
//! }
//! # Ok(()) }
//! ```

use std::fs::{File, Metadata, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Why an output could not be written. Every variant names the path.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("{} exists; pass --force to replace it", path.display())]
    Exists { path: PathBuf },
    #[error("{} is {kind}, not a regular file; brume never replaces or writes through it (even with --force)", path.display())]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error("{}: the folder {} does not exist", path.display(), folder.display())]
    NoFolder { path: PathBuf, folder: PathBuf },
    #[error("{} does not name a file", path.display())]
    NoName { path: PathBuf },
    #[error("{} changed while brume was writing it (it is no longer the file brume wrote); it is left alone", path.display())]
    Changed { path: PathBuf },
    #[error("{}: cannot write: {source}", path.display())]
    Io {
        path: PathBuf,
        // Not `#[source]`: the message already carries it, and error chains
        // printed with `{:#}` would say it twice.
        source: std::io::Error,
    },
}

impl From<OutputError> for crate::error::RunError {
    fn from(e: OutputError) -> Self {
        crate::error::RunError::Invalid(e.to_string())
    }
}

type Result<T> = std::result::Result<T, OutputError>;

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> OutputError + '_ {
    move |source| OutputError::Io { path: path.to_path_buf(), source }
}

/// What a directory entry is, in words, for messages.
pub fn kind_of(meta: &Metadata) -> &'static str {
    let ft = meta.file_type();
    if ft.is_symlink() {
        return "a symbolic link";
    }
    if ft.is_dir() {
        return "a folder";
    }
    if ft.is_file() {
        return "a regular file";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_block_device() || ft.is_char_device() {
            return "a device";
        }
        if ft.is_fifo() {
            return "a named pipe";
        }
        if ft.is_socket() {
            return "a socket";
        }
    }
    "not a regular file"
}

/// The folder a path lives in (`.` for a bare name).
pub fn folder_of(path: &Path) -> &Path {
    path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh hidden temporary sibling of `path`, created with `create_new` (so
/// two writers, or two threads, never share one).
fn temp_sibling(path: &Path) -> Result<(PathBuf, File)> {
    let name = path.file_name().ok_or_else(|| OutputError::NoName { path: path.to_path_buf() })?;
    let dir = folder_of(path);
    for _ in 0..100 {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{}.tmp-{}-{n}", name.to_string_lossy(), std::process::id()));
        match OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(OutputError::Io { path: path.to_path_buf(), source: e }),
        }
    }
    Err(OutputError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::AlreadyExists, "no free temporary name"),
    })
}

/// Where a result went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The file written.
    pub path: PathBuf,
    /// The name asked for (differs from `path` when something appeared there during the run).
    pub requested: PathBuf,
}

impl Written {
    /// What to tell the user when the result went under another name.
    pub fn notice(&self) -> Option<String> {
        (self.path != self.requested).then(|| {
            format!(
                "{} appeared while brume was working and was left alone; the result is in {}",
                self.requested.display(),
                self.path.display()
            )
        })
    }
}

/// `{stem}.{n}.{ext}` next to `path`: the fresh names a result may take.
fn fresh_name(path: &Path, n: usize) -> PathBuf {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    match path.extension() {
        Some(ext) => path.with_file_name(format!("{stem}.{n}.{}", ext.to_string_lossy())),
        None => path.with_file_name(format!("{stem}.{n}")),
    }
}

/// An output file and whether it may replace a regular file already there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub path: PathBuf,
    pub force: bool,
}

impl Output {
    pub fn new(path: impl Into<PathBuf>, force: bool) -> Self {
        Self { path: path.into(), force }
    }

    /// The check before the work: the folder exists, and the name is free, or
    /// (with force) holds a regular file. Nothing is created.
    pub fn check(&self) -> Result<()> {
        let path = &self.path;
        if path.file_name().is_none() {
            return Err(OutputError::NoName { path: path.clone() });
        }
        let folder = folder_of(path);
        match std::fs::metadata(folder) {
            Ok(m) if m.is_dir() => {}
            _ => return Err(OutputError::NoFolder { path: path.clone(), folder: folder.to_path_buf() }),
        }
        match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(OutputError::Io { path: path.clone(), source: e }),
            Ok(m) if !m.file_type().is_file() => Err(OutputError::NotRegular { path: path.clone(), kind: kind_of(&m) }),
            Ok(_) if self.force => Ok(()),
            Ok(_) => Err(OutputError::Exists { path: path.clone() }),
        }
    }

    /// Writes the file by the rule (see the module doc): `write` fills a
    /// temporary sibling, which is then committed. A failure anywhere removes
    /// the temporary file and leaves the name as it was.
    pub fn write(&self, write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>) -> Result<Written> {
        let path = &self.path;
        let (tmp, file) = temp_sibling(path)?;
        let result = (|| {
            let mut w = BufWriter::new(file);
            write(&mut w).map_err(io_err(path))?;
            w.flush().map_err(io_err(path))?;
            let file = w.into_inner().map_err(|e| OutputError::Io { path: path.clone(), source: e.into_error() })?;
            file.sync_all().map_err(io_err(path))?;
            drop(file);
            self.commit(&tmp)
        })();
        let _ = std::fs::remove_file(&tmp);
        result
    }

    /// [`Output::write`] of bytes already in memory.
    pub fn write_bytes(&self, bytes: &[u8]) -> Result<Written> {
        self.write(|w| w.write_all(bytes))
    }

    /// Puts the finished temporary file at the name (the caller removes `tmp`).
    fn commit(&self, tmp: &Path) -> Result<Written> {
        let path = &self.path;
        if self.force {
            match std::fs::symlink_metadata(path) {
                Ok(m) if !m.file_type().is_file() => {
                    return Err(OutputError::NotRegular { path: path.clone(), kind: kind_of(&m) })
                }
                Ok(_) => {
                    std::fs::rename(tmp, path).map_err(io_err(path))?;
                    return Ok(Written { path: path.clone(), requested: path.clone() });
                }
                Err(_) => {} // gone or never there: claim it like a new file
            }
        }
        if claim(tmp, path)? {
            return Ok(Written { path: path.clone(), requested: path.clone() });
        }
        // Something is at the name now that was not there (or was replaceable)
        // before the work: keep it, and the result next to it.
        for n in 1..=999 {
            let other = fresh_name(path, n);
            if claim(tmp, &other)? {
                return Ok(Written { path: other, requested: path.clone() });
            }
        }
        Err(OutputError::Exists { path: path.clone() })
    }
}

/// Links the finished `tmp` to `path` if nothing is there; `Ok(false)` if the
/// name is taken (by anything, even a dangling symlink: link never follows).
fn claim(tmp: &Path, path: &Path) -> Result<bool> {
    match std::fs::hard_link(tmp, path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(_) => {
            // A file system without hard links: create the name exclusively and
            // copy into it; a failure removes only the file we created.
            let mut out = match OpenOptions::new().write(true).create_new(true).open(path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(false),
                Err(e) => return Err(OutputError::Io { path: path.to_path_buf(), source: e }),
            };
            let copied = (|| {
                let mut src = File::open(tmp)?;
                std::io::copy(&mut src, &mut out)?;
                out.sync_all()
            })();
            if let Err(e) = copied {
                let _ = std::fs::remove_file(path);
                return Err(OutputError::Io { path: path.to_path_buf(), source: e });
            }
            Ok(true)
        }
    }
}

/// Identity of a file (device and inode on Unix; length and mtime elsewhere).
fn identity(meta: &Metadata) -> (u64, u64) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        (meta.dev(), meta.ino())
    }
    #[cfg(not(unix))]
    {
        (meta.len(), meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_nanos() as u64).unwrap_or(0))
    }
}

/// A file this process claimed and rewrites (e.g. a preview written every
/// step): the first write goes through [`Output::write`]; later writes replace
/// it only while the name still holds the very file this process wrote.
#[derive(Debug)]
pub struct Claimed {
    output: Output,
    current: Option<(PathBuf, (u64, u64))>,
}

impl Claimed {
    pub fn new(output: Output) -> Self {
        Self { output, current: None }
    }

    /// The early check of the name (see [`Output::check`]).
    pub fn check(&self) -> Result<()> {
        self.output.check()
    }

    /// Where the file is, once written.
    pub fn path(&self) -> Option<&Path> {
        self.current.as_ref().map(|(p, _)| p.as_path())
    }

    /// Writes the bytes: the first time by the rule, then over its own file.
    pub fn write_bytes(&mut self, bytes: &[u8]) -> Result<Written> {
        let Some((path, id)) = self.current.clone() else {
            let w = self.output.write_bytes(bytes)?;
            let meta = std::fs::symlink_metadata(&w.path).map_err(io_err(&w.path))?;
            self.current = Some((w.path.clone(), identity(&meta)));
            return Ok(w);
        };
        let (tmp, mut file) = temp_sibling(&path)?;
        let result = (|| {
            file.write_all(bytes).map_err(io_err(&path))?;
            file.sync_all().map_err(io_err(&path))?;
            let meta = std::fs::symlink_metadata(&path).map_err(|_| OutputError::Changed { path: path.clone() })?;
            if !meta.file_type().is_file() || identity(&meta) != id {
                return Err(OutputError::Changed { path: path.clone() });
            }
            let new_id = identity(&std::fs::symlink_metadata(&tmp).map_err(io_err(&path))?);
            std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
            Ok(new_id)
        })();
        let _ = std::fs::remove_file(&tmp);
        let new_id = result?;
        self.current = Some((path.clone(), new_id));
        Ok(Written { requested: self.output.path.clone(), path })
    }
}

/// Whether two paths name the same existing file (e.g. an output and an input).
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => identity(&x) == identity(&y),
        _ => false,
    }
}

/// Whether stderr is a terminal: progress lines with `\r` and ANSI colour only then.
pub fn stderr_is_terminal() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal()
}

/// Escapes control characters (and other invisible ones that can move the
/// cursor or rewrite a terminal) in text read from a file, so printing it
/// cannot drive the terminal. Newlines and tabs are kept.
pub fn escape_control(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\n' | '\t' => out.push(c),
            c if c.is_control() || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') => {
                out.extend(c.escape_default())
            }
            c => out.push(c),
        }
    }
    out
}

/// The output folder of a command that writes a whole tree (`convert --out`):
/// the tree is built in a temporary sibling folder, then committed by
/// [`OutputDir::commit`].
#[derive(Debug, Clone)]
pub struct OutputDir {
    pub path: PathBuf,
    pub force: bool,
}

/// A temporary folder removed when dropped (unless committed): an error or a
/// cancel leaves no debris.
#[derive(Debug)]
pub struct TempDir {
    path: Option<PathBuf>,
}

impl TempDir {
    pub fn path(&self) -> &Path {
        self.path.as_deref().unwrap_or(Path::new(""))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

impl OutputDir {
    pub fn new(path: impl Into<PathBuf>, force: bool) -> Self {
        Self { path: path.into(), force }
    }

    /// Before the work: the parent folder exists; the name is free, or is an
    /// empty folder, or (with force) a folder `replaceable` accepts. A symlink,
    /// a file or a device is never replaced.
    pub fn check(&self, replaceable: impl Fn(&Path) -> bool) -> Result<()> {
        let path = &self.path;
        if path.file_name().is_none() {
            return Err(OutputError::NoName { path: path.clone() });
        }
        let folder = folder_of(path);
        if !std::fs::metadata(folder).map(|m| m.is_dir()).unwrap_or(false) {
            return Err(OutputError::NoFolder { path: path.clone(), folder: folder.to_path_buf() });
        }
        match std::fs::symlink_metadata(path) {
            Err(_) => Ok(()),
            Ok(m) if !m.file_type().is_dir() => Err(OutputError::NotRegular { path: path.clone(), kind: kind_of(&m) }),
            Ok(_) if is_empty_dir(path) => Ok(()),
            Ok(_) if self.force && replaceable(path) => Ok(()),
            Ok(_) => Err(OutputError::Exists { path: path.clone() }),
        }
    }

    /// A fresh temporary sibling folder to build the tree in.
    pub fn temp(&self) -> Result<TempDir> {
        let name = self.path.file_name().ok_or_else(|| OutputError::NoName { path: self.path.clone() })?;
        let dir = folder_of(&self.path);
        for _ in 0..100 {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let tmp = dir.join(format!(".{}.tmp-{}-{n}", name.to_string_lossy(), std::process::id()));
            match std::fs::create_dir(&tmp) {
                Ok(()) => return Ok(TempDir { path: Some(tmp) }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(OutputError::Io { path: tmp, source: e }),
            }
        }
        Err(OutputError::Exists { path: self.path.clone() })
    }

    /// Moves the finished tree into place. A free name (or an empty folder) is
    /// claimed; with force, a folder `replaceable` accepts is replaced, and only
    /// when every file it holds is one the new tree rewrites: nothing else it
    /// held is deleted. Anything else at the name fails, leaving it as it was
    /// (and the temporary folder is removed when `tmp` drops).
    pub fn commit(&self, tmp: TempDir, replaceable: impl Fn(&Path) -> bool) -> Result<()> {
        let path = &self.path;
        let src = tmp.path().to_path_buf();
        match std::fs::symlink_metadata(path) {
            Err(_) => {
                // Claim the name with an empty folder (mkdir never replaces),
                // then rename onto it: that succeeds only while it stays empty.
                std::fs::create_dir(path).map_err(|e| match e.kind() {
                    std::io::ErrorKind::AlreadyExists => OutputError::Exists { path: path.clone() },
                    _ => OutputError::Io { path: path.clone(), source: e },
                })?;
                self.rename_onto_empty(&src, path, tmp)
            }
            Ok(m) if !m.file_type().is_dir() => Err(OutputError::NotRegular { path: path.clone(), kind: kind_of(&m) }),
            Ok(_) if is_empty_dir(path) => self.rename_onto_empty(&src, path, tmp),
            Ok(_) if self.force && replaceable(path) => {
                if let Some(extra) = files_not_in(path, &src) {
                    return Err(OutputError::Io {
                        path: path.clone(),
                        source: std::io::Error::other(format!(
                            "it holds {} which the new model does not replace; brume deletes nothing it did not write \
                             (move it, or choose another --out)",
                            extra.display()
                        )),
                    });
                }
                // Move the old tree aside, put the new one in place, then delete the old one.
                let old = self.temp()?;
                let old_path = old.path().to_path_buf();
                std::fs::remove_dir(&old_path).map_err(io_err(&old_path))?;
                std::fs::rename(path, &old_path).map_err(io_err(path))?;
                if let Err(e) = std::fs::rename(&src, path) {
                    let _ = std::fs::rename(&old_path, path);
                    return Err(OutputError::Io { path: path.clone(), source: e });
                }
                let mut tmp = tmp;
                tmp.path = None;
                drop(old); // removes the previous tree
                Ok(())
            }
            Ok(_) => Err(OutputError::Exists { path: path.clone() }),
        }
    }

    fn rename_onto_empty(&self, src: &Path, path: &Path, mut tmp: TempDir) -> Result<()> {
        match std::fs::rename(src, path) {
            Ok(()) => {
                tmp.path = None;
                Ok(())
            }
            Err(_) => {
                // Something was put into the folder meanwhile: keep it.
                let _ = std::fs::remove_dir(path); // only succeeds while empty
                Err(OutputError::Exists { path: path.to_path_buf() })
            }
        }
    }
}

fn is_empty_dir(path: &Path) -> bool {
    std::fs::read_dir(path).map(|mut r| r.next().is_none()).unwrap_or(false)
}

/// The first entry under `old` (a file, a link, an empty folder) that `new` does
/// not hold at the same relative path, if any.
fn files_not_in(old: &Path, new: &Path) -> Option<PathBuf> {
    fn walk(dir: &Path, rel: &Path, new: &Path, depth: usize) -> Option<PathBuf> {
        let Ok(rd) = std::fs::read_dir(dir) else { return Some(dir.to_path_buf()) };
        for e in rd.flatten() {
            let r = rel.join(e.file_name());
            let Ok(m) = std::fs::symlink_metadata(e.path()) else { return Some(e.path()) };
            if m.file_type().is_dir() && depth < 16 {
                if !std::fs::metadata(new.join(&r)).map(|n| n.is_dir()).unwrap_or(false) {
                    return Some(e.path());
                }
                if let Some(p) = walk(&e.path(), &r, new, depth + 1) {
                    return Some(p);
                }
            } else if !m.file_type().is_file()
                || !std::fs::symlink_metadata(new.join(&r)).map(|n| n.file_type().is_file()).unwrap_or(false)
            {
                return Some(e.path());
            }
        }
        None
    }
    walk(old, Path::new(""), new, 0)
}

/// A warning when a picture brume writes as PNG is named otherwise (`.jpg`,
/// `.webp`, no extension): the bytes are PNG whatever the name, and tools that
/// trust the extension would misread it.
pub fn png_extension_warning(path: &Path) -> Option<String> {
    match path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase()) {
        Some(e) if e == "png" => None,
        Some(e) => Some(format!(
            "{} is written as PNG (the format that carries brume's recipe), not .{e}; name it .png so other tools read it right",
            path.display()
        )),
        None => Some(format!("{} has no extension; it is written as PNG (name it .png)", path.display())),
    }
}
