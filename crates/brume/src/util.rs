//! Small shared helpers.

use std::io::BufWriter;
use std::path::Path;

/// Writes a file atomically by the output rule ([`crate::output`]) with
/// `force`: to a fresh temporary sibling (created exclusively, never through a
/// planted link), flushed and synced, then renamed over the destination, which
/// may only be a regular file (a symlink, folder or device there is an error,
/// left as it was). A crash, a full disk or an error mid-write leaves the
/// destination untouched and removes the temporary file. For files brume
/// regenerates in its own folders; user-named outputs use
/// [`crate::output::Output`] with the user's `--force`.
pub fn atomic_write(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<std::fs::File>) -> std::io::Result<()>,
) -> std::io::Result<()> {
    crate::output::Output::new(path, true).write(write).map(|_| ()).map_err(|e| match e {
        crate::output::OutputError::Io { source, .. } => source,
        e => std::io::Error::other(e.to_string()),
    })
}
