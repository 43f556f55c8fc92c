//! Start-up reconciliation of files against rows (see README.md for the rules).
//!
//! Runs only when this process holds the gallery lock exclusively: another
//! process may be between writing a file and committing its row, and its file
//! must not be taken for an orphan.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{GalleryError, Result};
use crate::fsutil::{self, TEMP_PREFIX};
use crate::{pngmeta, sha256_hex, sha_of_name, Gallery, ImageId, NewImage, ORPHANS_DIR};

/// A row removed because its file was gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MissingFile {
    pub id: ImageId,
    pub file: String,
}

/// What reconciling found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReconcileReport {
    /// Why reconciling did not run (another process has the gallery open).
    pub skipped: Option<String>,
    /// Live rows whose image file was missing (or truncated): removed.
    pub missing_files: Vec<MissingFile>,
    /// Soft-deleted rows whose file a purge had removed before crashing: removed.
    pub finished_purges: usize,
    /// Files without a row that carried a recipe: imported again (file, new id).
    pub reimported: Vec<(String, ImageId)>,
    /// Files that could not be accounted for, moved to `orphans/` (paths relative to the data dir).
    pub orphaned: Vec<String>,
    /// Temporary files of interrupted writes, removed.
    pub temp_removed: Vec<String>,
    /// Thumbnails rebuilt for rows that lacked one.
    pub thumbs_rebuilt: usize,
    /// Thumbnails with no image, removed.
    pub thumbs_removed: usize,
}

impl ReconcileReport {
    /// Whether nothing needed doing (a skipped run counts as clean).
    pub fn is_clean(&self) -> bool {
        self.missing_files.is_empty()
            && self.finished_purges == 0
            && self.reimported.is_empty()
            && self.orphaned.is_empty()
            && self.temp_removed.is_empty()
            && self.thumbs_rebuilt == 0
            && self.thumbs_removed == 0
    }
}

impl std::fmt::Display for ReconcileReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(why) = &self.skipped {
            return write!(f, "gallery reconcile skipped: {why}");
        }
        if self.is_clean() {
            return write!(f, "gallery consistent");
        }
        let mut parts = Vec::new();
        if !self.missing_files.is_empty() {
            let ids: Vec<String> = self.missing_files.iter().map(|m| format!("{} ({})", m.id, m.file)).collect();
            parts.push(format!("{} row(s) had no file and were removed: {}", ids.len(), ids.join(", ")));
        }
        if self.finished_purges > 0 {
            parts.push(format!("{} interrupted purge(s) finished", self.finished_purges));
        }
        if !self.reimported.is_empty() {
            let v: Vec<String> = self.reimported.iter().map(|(f, id)| format!("{f} as {id}")).collect();
            parts.push(format!("{} file(s) without a row re-imported: {}", v.len(), v.join(", ")));
        }
        if !self.orphaned.is_empty() {
            parts.push(format!(
                "{} unaccounted file(s) moved to {ORPHANS_DIR}/: {}",
                self.orphaned.len(),
                self.orphaned.join(", ")
            ));
        }
        if !self.temp_removed.is_empty() {
            parts.push(format!(
                "{} temporary file(s) of interrupted writes removed",
                self.temp_removed.len()
            ));
        }
        if self.thumbs_rebuilt > 0 {
            parts.push(format!("{} thumbnail(s) rebuilt", self.thumbs_rebuilt));
        }
        if self.thumbs_removed > 0 {
            parts.push(format!("{} stray thumbnail(s) removed", self.thumbs_removed));
        }
        write!(f, "gallery reconciled: {}", parts.join("; "))
    }
}

fn entries(dir: &Path) -> Result<Vec<(String, PathBuf, std::fs::FileType)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).map_err(GalleryError::io(dir, "cannot list"))? {
        let e = e.map_err(GalleryError::io(dir, "cannot list"))?;
        let ft = e.file_type().map_err(GalleryError::io(e.path(), "cannot inspect"))?;
        out.push((e.file_name().to_string_lossy().into_owned(), e.path(), ft));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

impl Gallery {
    fn move_to_orphans(&self, path: &Path, name: &str, report: &mut ReconcileReport) -> Result<()> {
        let dir = self.root().join(ORPHANS_DIR);
        fsutil::private_dir(&dir)?;
        let mut dest = dir.join(name);
        let mut n = 1;
        while std::fs::symlink_metadata(&dest).is_ok() {
            dest = dir.join(format!("{name}.{n}"));
            n += 1;
        }
        std::fs::rename(path, &dest).map_err(GalleryError::io(path, "cannot move to orphans"))?;
        let rel = dest.strip_prefix(self.root()).unwrap_or(&dest).display().to_string();
        tracing::warn!(file = %path.display(), to = %rel, "gallery: unaccounted file moved aside");
        report.orphaned.push(rel);
        Ok(())
    }

    pub(crate) fn reconcile(&self) -> Result<ReconcileReport> {
        let mut report = ReconcileReport::default();
        let images = self.images_dir().to_path_buf();
        let thumbs = self.thumbs_dir().to_path_buf();

        // 1. Temporary files of interrupted writes.
        for dir in [&images, &thumbs] {
            for (name, path, ft) in entries(dir)? {
                if name.starts_with(TEMP_PREFIX) && !ft.is_dir() {
                    std::fs::remove_file(&path).map_err(GalleryError::io(&path, "cannot remove temporary file"))?;
                    report
                        .temp_removed
                        .push(format!("{}/{name}", dir.file_name().unwrap_or_default().to_string_lossy()));
                }
            }
        }

        // 2. Rows whose file is gone.
        let rows: Vec<(i64, String, bool, i64)> = {
            let conn = self.conn();
            let mut stmt = conn
                .prepare("SELECT id, sha256, deleted_at IS NOT NULL, bytes FROM images")
                .map_err(GalleryError::db("reading rows to reconcile"))?;
            let rows = stmt
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
                .and_then(|r| r.collect::<rusqlite::Result<Vec<_>>>());
            rows.map_err(GalleryError::db("reading rows to reconcile"))?
        };
        let mut referenced = HashSet::new();
        let mut gone = Vec::new();
        for (id, sha, deleted, bytes) in rows {
            if fsutil::is_file_of_len(&self.image_path(&sha), bytes.max(0) as u64) {
                referenced.insert(sha);
            } else {
                gone.push((id, sha, deleted));
            }
        }
        if !gone.is_empty() {
            let mut conn = self.conn();
            let tx = conn
                .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                .map_err(GalleryError::db("starting reconcile"))?;
            for (id, sha, deleted) in &gone {
                tx.execute("DELETE FROM images WHERE id = ?1", [id])
                    .map_err(GalleryError::db("removing a row without file"))?;
                if *deleted {
                    report.finished_purges += 1;
                } else {
                    tracing::warn!(id, "gallery: image file {sha}.png missing; row removed");
                    report.missing_files.push(MissingFile {
                        id: ImageId(*id),
                        file: format!("images/{sha}.png"),
                    });
                }
            }
            tx.commit().map_err(GalleryError::db("committing reconcile"))?;
        }

        // 3. Files without a row.
        for (name, path, ft) in entries(&images)? {
            let sha = sha_of_name(&name).map(str::to_string);
            match sha {
                Some(sha) if ft.is_file() => {
                    if referenced.contains(&sha) {
                        continue;
                    }
                    let what = format!("images/{name}");
                    let imported = fsutil::read_capped(&path, pngmeta::MAX_PNG_BYTES).and_then(|bytes| {
                        if sha256_hex(&bytes) != sha {
                            return Err(GalleryError::BadPng {
                                what: what.clone(),
                                reason: "content does not match its name".into(),
                            });
                        }
                        let new = NewImage::from_png(bytes, &what)?;
                        self.add_inner(new, true)
                    });
                    match imported {
                        Ok(i) => {
                            tracing::warn!(file = %what, id = i.id.0, "gallery: file without a row re-imported");
                            referenced.insert(sha);
                            report.reimported.push((what, i.id));
                        }
                        Err(e) => {
                            tracing::warn!("gallery: {e}");
                            self.move_to_orphans(&path, &name, &mut report)?;
                        }
                    }
                }
                _ => self.move_to_orphans(&path, &name, &mut report)?,
            }
        }

        // 4. Thumbnails: derived data, removed when stray and rebuilt when missing.
        let mut have_thumb = HashSet::new();
        for (name, path, ft) in entries(&thumbs)? {
            match sha_of_name(&name) {
                Some(sha) if ft.is_file() && referenced.contains(sha) => {
                    have_thumb.insert(sha.to_string());
                }
                _ if ft.is_dir() => self.move_to_orphans(&path, &name, &mut report)?,
                _ => {
                    std::fs::remove_file(&path).map_err(GalleryError::io(&path, "cannot remove stray thumbnail"))?;
                    report.thumbs_removed += 1;
                }
            }
        }
        for sha in referenced.difference(&have_thumb) {
            let rebuilt = fsutil::read_capped(&self.image_path(sha), pngmeta::MAX_PNG_BYTES)
                .and_then(|png| crate::make_thumbnail(&png, &format!("images/{sha}.png")))
                .and_then(|t| fsutil::write_atomic(&thumbs, &format!("{sha}.png"), &t));
            match rebuilt {
                Ok(()) => report.thumbs_rebuilt += 1,
                Err(e) => tracing::warn!("gallery: cannot rebuild a thumbnail: {e}"),
            }
        }
        Ok(report)
    }
}
