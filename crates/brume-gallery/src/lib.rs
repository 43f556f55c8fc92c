//! brume's on-device gallery: every image brume makes (or is given) stored with
//! its recipe, a thumbnail, the model, every parameter, timings and the image an
//! edit started from, in SQLite (WAL) beside a folder of content-addressed PNGs.
//!
//! Crash safety rests on one order: an image's file is written atomically and
//! made durable *before* the row naming it commits, so a committed row always
//! has its file; a file without a row (a crash between the two) is reconciled at
//! the next open. See README.md for the schema and the reconcile rules.
//!
//! [`Gallery`] is `Send + Sync`: one SQLite connection behind a mutex, the slow
//! parts of [`Gallery::add`] (thumbnail, file writes) outside it.

pub mod a1111;
mod error;
mod fsutil;
pub mod pngmeta;
mod reconcile;
mod schema;
pub mod time;

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use brume::pipelines::recipe::{Recipe, PARAMETERS_KEY, RECIPE_KEY};
use rusqlite::types::Value;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use error::{GalleryError, Result};
pub use reconcile::{MissingFile, ReconcileReport};
pub use schema::SCHEMA_VERSION;

/// The SQLite database inside the data directory.
pub const DB_FILE: &str = "gallery.sqlite3";
/// The folder of full-size PNGs, each named `<sha256>.png`.
pub const IMAGES_DIR: &str = "images";
/// The folder of thumbnails, each named like its image.
pub const THUMBS_DIR: &str = "thumbs";
/// Where reconciling moves files it cannot account for (never deleted unasked).
pub const ORPHANS_DIR: &str = "orphans";
/// The lock file whose exclusive lock means "this process is alone".
pub const LOCK_FILE: &str = "gallery.lock";
/// Longest side of a thumbnail, in pixels.
pub const THUMB_SIDE: u32 = 256;
/// Media type of [`Gallery::thumb_bytes`].
pub const THUMB_CONTENT_TYPE: &str = "image/png";
/// Default and largest page size of [`Gallery::list`].
pub const DEFAULT_LIMIT: usize = 50;
pub const MAX_LIMIT: usize = 500;
/// Most tags one image may carry, and the longest tag (in characters).
pub const MAX_TAGS: usize = 64;
pub const MAX_TAG_CHARS: usize = 64;

/// A gallery image's id (SQLite rowid; ids only grow, so an edit's parent has a smaller id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ImageId(pub i64);

impl std::fmt::Display for ImageId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::str::FromStr for ImageId {
    type Err = GalleryError;
    fn from_str(s: &str) -> Result<Self> {
        s.trim()
            .parse::<i64>()
            .ok()
            .filter(|v| *v > 0)
            .map(ImageId)
            .ok_or_else(|| GalleryError::invalid("id", format!("{s:?} is not a gallery id (a positive integer)")))
    }
}

/// The data directory: `$BRUME_DATA_DIR`, else `$XDG_DATA_HOME/brume`, else
/// `~/.local/share/brume`; `None` when none of these is set.
pub fn default_data_dir() -> Option<PathBuf> {
    let nonempty = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = nonempty("BRUME_DATA_DIR") {
        return Some(d);
    }
    if let Some(d) = nonempty("XDG_DATA_HOME").filter(|d| d.is_absolute()) {
        return Some(d.join("brume"));
    }
    nonempty("HOME").map(|h| h.join(".local/share/brume"))
}

/// An image to store.
#[derive(Debug, Clone, Default)]
pub struct NewImage {
    /// The PNG as it will be served, recipe chunks included. Width and height are
    /// read from it (the stored size is always the picture's own).
    pub png: Vec<u8>,
    /// The brume recipe, when brume made the image.
    pub recipe: Option<Recipe>,
    /// The A1111 "parameters" text; made from the recipe when absent.
    pub parameters: Option<String>,
    pub prompt: String,
    pub negative_prompt: Option<String>,
    pub model: Option<String>,
    pub model_hash: Option<String>,
    pub sampler: Option<String>,
    pub steps: Option<u32>,
    pub guidance: Option<f64>,
    pub seed: Option<u64>,
    /// `txt2img`, `img2img`, `inpaint` or `outpaint` (free text for imports).
    pub mode: Option<String>,
    /// Timings of the job, stored as given.
    pub timings: Option<serde_json::Value>,
    /// The gallery image an edit started from.
    pub parent: Option<ImageId>,
    /// The job and the image's index in it: adding the same pair twice returns the
    /// first id instead of a second row.
    pub job: Option<(String, u32)>,
}

impl NewImage {
    /// An image brume made, with every field taken from its recipe.
    pub fn from_recipe(png: Vec<u8>, recipe: &Recipe) -> Self {
        NewImage {
            png,
            parameters: Some(recipe.parameters_text()),
            prompt: recipe.prompt.clone(),
            negative_prompt: recipe.negative_prompt.clone(),
            model: Some(recipe.model_name.clone()),
            model_hash: Some(recipe.model_hash.clone()),
            sampler: Some(recipe.sampler.clone()),
            steps: u32::try_from(recipe.steps).ok(),
            guidance: Some(recipe.guidance_scale),
            seed: Some(recipe.seed),
            mode: serde_json::to_value(recipe.mode).ok().and_then(|v| v.as_str().map(str::to_string)),
            recipe: Some(recipe.clone()),
            ..Default::default()
        }
    }

    /// An existing PNG, its fields read from the brume recipe it carries or else
    /// from its A1111 `parameters` text ([`GalleryError::NoRecipe`] when neither).
    /// `what` names the source in errors.
    pub fn from_png(png: Vec<u8>, what: &str) -> Result<Self> {
        let text = {
            let chunks = pngmeta::chunks(&png, what)?;
            pngmeta::text_chunks(&chunks, what)?
        };
        let find = |key: &str| text.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
        let parameters = find(PARAMETERS_KEY);
        if let Some(json) = find(RECIPE_KEY) {
            match serde_json::from_str::<Recipe>(&json) {
                Ok(recipe) => {
                    let mut n = NewImage::from_recipe(png, &recipe);
                    if parameters.is_some() {
                        n.parameters = parameters;
                    }
                    return Ok(n);
                }
                Err(e) if parameters.is_none() => {
                    return Err(GalleryError::Metadata {
                        what: what.to_string(),
                        reason: format!("the {RECIPE_KEY} chunk is not a recipe this brume reads: {e}"),
                    })
                }
                Err(e) => tracing::warn!(what, "unreadable {RECIPE_KEY} chunk ({e}); importing the parameters text"),
            }
        }
        let Some(text) = parameters else {
            return Err(GalleryError::NoRecipe(what.to_string()));
        };
        let p = a1111::parse(&text);
        Ok(NewImage {
            png,
            prompt: p.prompt.clone(),
            negative_prompt: p.negative_prompt.clone().filter(|n| !n.is_empty()),
            model: p.model().map(str::to_string),
            model_hash: p.model_hash().map(str::to_string),
            sampler: p.sampler().map(str::to_string),
            steps: p.steps(),
            guidance: p.cfg_scale(),
            seed: p.seed(),
            mode: p.get("Mode").map(|m| m.trim().to_ascii_lowercase()),
            parameters: Some(text),
            ..Default::default()
        })
    }
}

/// One gallery image as listed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageInfo {
    pub id: ImageId,
    pub prompt: String,
    pub negative_prompt: Option<String>,
    pub model: Option<String>,
    pub model_hash: Option<String>,
    pub sampler: Option<String>,
    pub steps: Option<u32>,
    pub guidance: Option<f64>,
    pub seed: Option<u64>,
    pub width: u32,
    pub height: u32,
    pub mode: Option<String>,
    /// RFC 3339, UTC.
    pub created_at: String,
    pub created_at_ms: i64,
    pub favourite: bool,
    pub tags: Vec<String>,
    pub parent: Option<ImageId>,
    /// Soft-deleted (restorable until purged).
    pub deleted: bool,
    /// SHA-256 of the PNG (hex); also its file name.
    pub sha256: String,
    pub bytes: u64,
    pub job_id: Option<String>,
}

/// One image with everything stored about it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageDetail {
    #[serde(flatten)]
    pub info: ImageInfo,
    /// The brume recipe JSON, as stored.
    pub recipe: Option<serde_json::Value>,
    /// The A1111 "parameters" text.
    pub parameters: Option<String>,
    pub timings: Option<serde_json::Value>,
    /// Ids from the root of the edit chain to this image (this one last).
    pub lineage: Vec<ImageId>,
}

impl ImageDetail {
    /// The recipe as this brume's type (`None` when absent or from an incompatible version).
    pub fn recipe_typed(&self) -> Option<Recipe> {
        self.recipe.clone().and_then(|v| serde_json::from_value(v).ok())
    }
}

/// Which soft-deleted images a query sees.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Deleted {
    /// Live images only.
    #[default]
    Exclude,
    /// Live and soft-deleted.
    Include,
    /// Soft-deleted only (what a purge would remove).
    Only,
}

/// Filters and paging of [`Gallery::list`]; every filter is optional and they combine with AND.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Query {
    /// Full-text search over prompt and negative prompt (any text; see [`fts_query`]).
    pub text: Option<String>,
    /// Model name or model hash.
    pub model: Option<String>,
    pub sampler: Option<String>,
    pub width: Option<u32>,
    pub height: Option<u32>,
    pub seed: Option<u64>,
    /// Created at or after (Unix ms; [`time::parse_time`] reads people's dates).
    pub since: Option<i64>,
    /// Created before (Unix ms).
    pub until: Option<i64>,
    pub favourite: Option<bool>,
    pub tag: Option<String>,
    /// Direct edits of this image.
    pub parent: Option<ImageId>,
    pub deleted: Deleted,
    /// From a previous page's `next_cursor`.
    pub cursor: Option<String>,
    /// Page size, 1..=[`MAX_LIMIT`]; default [`DEFAULT_LIMIT`].
    pub limit: Option<usize>,
}

/// One page of results, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Page {
    pub items: Vec<ImageInfo>,
    /// Pass as [`Query::cursor`] for the next page; `None` on the last.
    pub next_cursor: Option<String>,
}

/// What [`Gallery::import_bytes`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Imported {
    pub id: ImageId,
    /// False when the same PNG was already in the gallery (its id is returned).
    pub created: bool,
}

/// What [`Gallery::purge`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PurgeReport {
    pub rows: usize,
    pub files: usize,
}

/// Turns any user text into a safe FTS5 query: each whitespace-separated word
/// becomes a quoted phrase (quotes doubled, so `"`, `NEAR(`, `AND`, `-` and `:`
/// are plain text), a trailing `*` stays a prefix search, and the words are
/// ANDed. `None` when no word holds a letter or digit.
pub fn fts_query(text: &str) -> Option<String> {
    // Control characters (NUL ends SQLite's reading of the query) separate words.
    let text: String = text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    let terms: Vec<String> = text
        .split_whitespace()
        .filter_map(|w| {
            let prefix = w.ends_with('*');
            let w: String = w.trim_end_matches('*').chars().take(200).collect();
            if !w.chars().any(char::is_alphanumeric) {
                return None;
            }
            Some(format!("\"{}\"{}", w.replace('"', "\"\""), if prefix { "*" } else { "" }))
        })
        .take(32)
        .collect();
    (!terms.is_empty()).then(|| terms.join(" "))
}

/// Text from an image made safe to print on a terminal: control characters
/// (C0, DEL, C1, which can drive the terminal) and bidirectional overrides
/// (which can reorder what is shown) become `\n`, `\t`, `\u{..}` escapes.
pub fn escape_for_terminal(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') => {
                out.push_str(&format!("\\u{{{:x}}}", c as u32))
            }
            c => out.push(c),
        }
    }
    out
}

/// The gallery: open one per data directory and share it (it is `Send + Sync`).
pub struct Gallery {
    root: PathBuf,
    images: PathBuf,
    thumbs: PathBuf,
    conn: Mutex<Connection>,
    /// Held (shared) for the gallery's life; see [`fsutil::DirLock`].
    _lock: fsutil::DirLock,
}

/// The columns of [`ImageInfo`], in [`info_from_row`]'s order.
const INFO_COLS: &str = "i.id, i.prompt, i.negative_prompt, i.model, i.model_hash, i.sampler, i.steps, i.guidance, i.seed, \
     i.width, i.height, i.mode, i.created_at, i.favourite, \
     (SELECT group_concat(tag, char(31)) FROM (SELECT tag FROM tags WHERE image_id = i.id ORDER BY tag)), \
     i.parent, i.deleted_at, i.sha256, i.bytes, i.job_id";

fn info_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<ImageInfo> {
    let created_at_ms: i64 = r.get(12)?;
    let tags: Option<String> = r.get(14)?;
    Ok(ImageInfo {
        id: ImageId(r.get(0)?),
        prompt: r.get(1)?,
        negative_prompt: r.get(2)?,
        model: r.get(3)?,
        model_hash: r.get(4)?,
        sampler: r.get(5)?,
        steps: r.get::<_, Option<i64>>(6)?.and_then(|v| u32::try_from(v).ok()),
        guidance: r.get(7)?,
        seed: r.get::<_, Option<i64>>(8)?.map(|v| v as u64),
        width: r.get::<_, i64>(9)?.try_into().unwrap_or(0),
        height: r.get::<_, i64>(10)?.try_into().unwrap_or(0),
        mode: r.get(11)?,
        created_at: time::format_rfc3339(created_at_ms),
        created_at_ms,
        favourite: r.get(13)?,
        tags: tags.map(|t| t.split('\u{1f}').map(str::to_string).collect()).unwrap_or_default(),
        parent: r.get::<_, Option<i64>>(15)?.map(ImageId),
        deleted: r.get::<_, Option<i64>>(16)?.is_some(),
        sha256: r.get(17)?,
        bytes: r.get::<_, i64>(18)?.try_into().unwrap_or(0),
        job_id: r.get(19)?,
    })
}

fn clean_tag(tag: &str) -> Result<String> {
    let t = tag.trim();
    if t.is_empty() {
        return Err(GalleryError::invalid("tag", "empty tag"));
    }
    if t.chars().count() > MAX_TAG_CHARS {
        return Err(GalleryError::invalid("tag", format!("longer than {MAX_TAG_CHARS} characters")));
    }
    if t.chars().any(char::is_control) {
        return Err(GalleryError::invalid("tag", "holds control characters"));
    }
    Ok(t.to_string())
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `name` is `<64 lowercase hex>.png`, the only names the gallery writes.
pub(crate) fn sha_of_name(name: &str) -> Option<&str> {
    let sha = name.strip_suffix(".png")?;
    (sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))).then_some(sha)
}

/// A thumbnail of a PNG: at most [`THUMB_SIDE`] pixels on its longest side, PNG.
/// Decoding is bounded (side and allocation limits), and fails on broken pixel data.
pub fn make_thumbnail(png: &[u8], what: &str) -> Result<Vec<u8>> {
    let bad = |e: image::ImageError| GalleryError::BadPng {
        what: what.to_string(),
        reason: e.to_string(),
    };
    let mut reader = image::ImageReader::with_format(std::io::Cursor::new(png), image::ImageFormat::Png);
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(pngmeta::MAX_SIDE);
    limits.max_image_height = Some(pngmeta::MAX_SIDE);
    limits.max_alloc = Some(1 << 30);
    reader.limits(limits);
    let img = reader.decode().map_err(bad)?;
    let img = if img.width() > THUMB_SIDE || img.height() > THUMB_SIDE {
        img.thumbnail(THUMB_SIDE, THUMB_SIDE)
    } else {
        img
    };
    let img = if img.color().has_alpha() {
        image::DynamicImage::ImageRgba8(img.to_rgba8())
    } else {
        image::DynamicImage::ImageRgb8(img.to_rgb8())
    };
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).map_err(bad)?;
    Ok(out.into_inner())
}

impl Gallery {
    /// Opens (creating if needed) the gallery in `data_dir`: the directory is made
    /// 0700 (a symlink or a file there is refused), the database is migrated to
    /// [`SCHEMA_VERSION`], and, when no other process has the gallery open, files
    /// and rows are reconciled (the report says what was found; see README.md).
    pub fn open(data_dir: &Path) -> Result<(Gallery, ReconcileReport)> {
        fsutil::private_dir(data_dir)?;
        let images = data_dir.join(IMAGES_DIR);
        let thumbs = data_dir.join(THUMBS_DIR);
        fsutil::private_dir(&images)?;
        fsutil::private_dir(&thumbs)?;
        let (lock, alone) = fsutil::DirLock::open_exclusive(&data_dir.join(LOCK_FILE))?;
        let db_path = data_dir.join(DB_FILE);
        if std::fs::symlink_metadata(&db_path).is_ok_and(|m| !m.is_file()) {
            return Err(GalleryError::DataDir {
                path: db_path,
                reason: "is not a regular file".into(),
            });
        }
        let mut conn = Connection::open(&db_path).map_err(GalleryError::db("opening"))?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&db_path, std::fs::Permissions::from_mode(0o600))
                .map_err(GalleryError::io(&db_path, "cannot set permissions to 0600"))?;
        }
        conn.busy_timeout(Duration::from_secs(10))
            .map_err(GalleryError::db("setting the busy timeout"))?;
        let mode: String = conn
            .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
            .map_err(GalleryError::db("switching to WAL"))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(GalleryError::MissingFeature("WAL journal mode"));
        }
        // FULL: a commit is on disk when it returns (a job reported done stays done
        // through a power cut, not only a crash).
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(GalleryError::db("setting synchronous"))?;
        conn.pragma_update(None, "foreign_keys", "ON")
            .map_err(GalleryError::db("enabling foreign keys"))?;
        schema::migrate(&mut conn)?;
        let gallery = Gallery {
            root: data_dir.to_path_buf(),
            images,
            thumbs,
            conn: Mutex::new(conn),
            _lock: lock,
        };
        let report = if alone {
            let r = gallery.reconcile()?;
            gallery._lock.share();
            r
        } else {
            ReconcileReport {
                skipped: Some("another process has the gallery open".into()),
                ..Default::default()
            }
        };
        if !report.is_clean() {
            tracing::warn!("{report}");
        }
        Ok((gallery, report))
    }

    /// The data directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    pub(crate) fn conn(&self) -> MutexGuard<'_, Connection> {
        // A panic mid-transaction rolled it back when the transaction dropped.
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn image_path(&self, sha: &str) -> PathBuf {
        self.images.join(format!("{sha}.png"))
    }

    pub(crate) fn thumb_path(&self, sha: &str) -> PathBuf {
        self.thumbs.join(format!("{sha}.png"))
    }

    pub(crate) fn images_dir(&self) -> &Path {
        &self.images
    }

    pub(crate) fn thumbs_dir(&self) -> &Path {
        &self.thumbs
    }

    /// Stores an image and returns its id. The PNG is checked (structure, CRCs,
    /// pixels), written atomically and synced, with its thumbnail, before its row
    /// commits. Adding the same `job` pair again returns the first id.
    pub fn add(&self, new: NewImage) -> Result<ImageId> {
        self.add_inner(new, false).map(|i| i.id)
    }

    /// `dedupe`: return the id of a live row with the same PNG instead of adding one.
    pub(crate) fn add_inner(&self, new: NewImage, dedupe: bool) -> Result<Imported> {
        let what = match &new.job {
            Some((job, i)) => format!("job {job} image {i}"),
            None => "image".to_string(),
        };
        let (width, height) = {
            let chunks = pngmeta::chunks(&new.png, &what)?;
            pngmeta::dimensions(&chunks, &what)?
        };
        for (field, text) in [("prompt", Some(&new.prompt)), ("negative_prompt", new.negative_prompt.as_ref())] {
            if text.is_some_and(|t| t.len() > pngmeta::MAX_TEXT_BYTES) {
                return Err(GalleryError::invalid(field, "longer than 1 MiB"));
            }
        }
        let sha = sha256_hex(&new.png);
        if let Some(found) = self.existing(&new, &sha, dedupe)? {
            return Ok(Imported { id: found, created: false });
        }
        let thumb = make_thumbnail(&new.png, &what)?;
        let image_path = self.image_path(&sha);
        let len = new.png.len() as u64;
        if !fsutil::is_file_of_len(&image_path, len) {
            fsutil::write_atomic(&self.images, &format!("{sha}.png"), &new.png)?;
        }
        if !fsutil::is_file_of_len(&self.thumb_path(&sha), thumb.len() as u64) {
            fsutil::write_atomic(&self.thumbs, &format!("{sha}.png"), &thumb)?;
        }
        let recipe = new
            .recipe
            .as_ref()
            .map(serde_json::to_string)
            .transpose()
            .map_err(|e| GalleryError::invalid("recipe", e.to_string()))?;
        let parameters = new.parameters.clone().or_else(|| new.recipe.as_ref().map(Recipe::parameters_text));
        let timings = new.timings.as_ref().map(|t| t.to_string());

        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(GalleryError::db("starting an insert"))?;
        if let Some(found) = existing_in(&tx, &new, &sha, dedupe)? {
            return Ok(Imported { id: found, created: false });
        }
        // Files are removed only under this write lock (purge): one removed since
        // we wrote it is written again before the row can commit.
        if !fsutil::is_file_of_len(&image_path, len) {
            fsutil::write_atomic(&self.images, &format!("{sha}.png"), &new.png)?;
        }
        if !fsutil::is_file_of_len(&self.thumb_path(&sha), thumb.len() as u64) {
            fsutil::write_atomic(&self.thumbs, &format!("{sha}.png"), &thumb)?;
        }
        let parent = match new.parent {
            Some(p) => {
                let exists = tx
                    .query_row("SELECT 1 FROM images WHERE id = ?1", [p.0], |_| Ok(()))
                    .optional()
                    .map_err(GalleryError::db("looking up the parent"))?
                    .is_some();
                if !exists {
                    // The result of a finished job is kept even if its parent was purged meanwhile.
                    tracing::warn!(parent = p.0, "{what}: parent image not in the gallery; stored without it");
                }
                exists.then_some(p.0)
            }
            None => None,
        };
        tx.execute(
            "INSERT INTO images (sha256, bytes, created_at, job_id, job_index, prompt, negative_prompt, model, model_hash, \
             sampler, steps, guidance, seed, width, height, mode, recipe, parameters, timings, parent) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20)",
            params![
                sha,
                len as i64,
                time::now_ms(),
                new.job.as_ref().map(|j| j.0.clone()),
                new.job.as_ref().map(|j| j.1 as i64),
                new.prompt,
                new.negative_prompt,
                new.model,
                new.model_hash,
                new.sampler,
                new.steps.map(|s| s as i64),
                new.guidance.filter(|g| g.is_finite()),
                new.seed.map(|s| s as i64),
                width as i64,
                height as i64,
                new.mode,
                recipe,
                parameters,
                timings,
                parent,
            ],
        )
        .map_err(GalleryError::db("inserting an image"))?;
        let id = ImageId(tx.last_insert_rowid());
        tx.commit().map_err(GalleryError::db("committing an image"))?;
        tracing::debug!(id = id.0, sha, "{what} stored");
        Ok(Imported { id, created: true })
    }

    fn existing(&self, new: &NewImage, sha: &str, dedupe: bool) -> Result<Option<ImageId>> {
        existing_in(&self.conn(), new, sha, dedupe)
    }

    /// Everything about one image (soft-deleted ones too: see `deleted`).
    pub fn get(&self, id: ImageId) -> Result<ImageDetail> {
        let conn = self.conn();
        let (info, recipe, parameters, timings) = conn
            .query_row(
                &format!("SELECT {INFO_COLS}, i.recipe, i.parameters, i.timings FROM images i WHERE i.id = ?1"),
                [id.0],
                |r| {
                    Ok((
                        info_from_row(r)?,
                        r.get::<_, Option<String>>(20)?,
                        r.get::<_, Option<String>>(21)?,
                        r.get::<_, Option<String>>(22)?,
                    ))
                },
            )
            .optional()
            .map_err(GalleryError::db("reading an image"))?
            .ok_or(GalleryError::NotFound(id))?;
        let lineage = lineage_in(&conn, id)?;
        Ok(ImageDetail {
            info,
            recipe: recipe.and_then(|r| serde_json::from_str(&r).ok()),
            parameters,
            timings: timings.and_then(|t| serde_json::from_str(&t).ok()),
            lineage,
        })
    }

    /// One page of images matching `q`, newest first (keyset pagination on the id,
    /// so pages stay consistent while images are added).
    pub fn list(&self, q: &Query) -> Result<Page> {
        let limit = q.limit.unwrap_or(DEFAULT_LIMIT);
        if limit == 0 || limit > MAX_LIMIT {
            return Err(GalleryError::invalid("limit", format!("{limit} is outside 1..={MAX_LIMIT}")));
        }
        let mut sql = format!("SELECT {INFO_COLS} FROM images i WHERE 1");
        let mut args: Vec<Value> = Vec::new();
        match q.deleted {
            Deleted::Exclude => sql.push_str(" AND i.deleted_at IS NULL"),
            Deleted::Include => {}
            Deleted::Only => sql.push_str(" AND i.deleted_at IS NOT NULL"),
        }
        if let Some(text) = q.text.as_deref().filter(|t| !t.trim().is_empty()) {
            match fts_query(text) {
                Some(m) => {
                    sql.push_str(" AND i.id IN (SELECT rowid FROM images_fts WHERE images_fts MATCH ?)");
                    args.push(Value::Text(m));
                }
                // Only punctuation: nothing can match.
                None => {
                    return Ok(Page {
                        items: Vec::new(),
                        next_cursor: None,
                    })
                }
            }
        }
        if let Some(m) = &q.model {
            sql.push_str(" AND (i.model = ? OR i.model_hash = ?)");
            args.push(Value::Text(m.clone()));
            args.push(Value::Text(m.clone()));
        }
        let mut eq = |col: &str, v: Value| {
            sql.push_str(&format!(" AND i.{col} = ?"));
            args.push(v);
        };
        if let Some(s) = &q.sampler {
            eq("sampler", Value::Text(s.clone()));
        }
        if let Some(w) = q.width {
            eq("width", Value::Integer(w as i64));
        }
        if let Some(h) = q.height {
            eq("height", Value::Integer(h as i64));
        }
        if let Some(s) = q.seed {
            eq("seed", Value::Integer(s as i64));
        }
        if let Some(f) = q.favourite {
            eq("favourite", Value::Integer(f as i64));
        }
        if let Some(p) = q.parent {
            eq("parent", Value::Integer(p.0));
        }
        if let Some(t) = q.since {
            sql.push_str(" AND i.created_at >= ?");
            args.push(Value::Integer(t));
        }
        if let Some(t) = q.until {
            sql.push_str(" AND i.created_at < ?");
            args.push(Value::Integer(t));
        }
        if let Some(tag) = &q.tag {
            sql.push_str(" AND EXISTS (SELECT 1 FROM tags t WHERE t.image_id = i.id AND t.tag = ?)");
            args.push(Value::Text(tag.trim().to_string()));
        }
        if let Some(c) = q.cursor.as_deref().filter(|c| !c.is_empty()) {
            let after = c
                .parse::<i64>()
                .ok()
                .filter(|v| *v > 0)
                .ok_or_else(|| GalleryError::invalid("cursor", format!("{c:?} is not a cursor this gallery gave")))?;
            sql.push_str(" AND i.id < ?");
            args.push(Value::Integer(after));
        }
        sql.push_str(" ORDER BY i.id DESC LIMIT ?");
        args.push(Value::Integer(limit as i64 + 1));
        let conn = self.conn();
        let mut stmt = conn.prepare(&sql).map_err(GalleryError::db("preparing a listing"))?;
        let mut items = stmt
            .query_map(rusqlite::params_from_iter(args), info_from_row)
            .and_then(|rows| rows.collect::<rusqlite::Result<Vec<_>>>())
            .map_err(GalleryError::db("listing images"))?;
        let next_cursor = if items.len() > limit {
            items.truncate(limit);
            items.last().map(|i| i.id.0.to_string())
        } else {
            None
        };
        Ok(Page { items, next_cursor })
    }

    /// Full-text search over prompts and negative prompts, with `q`'s filters.
    pub fn search(&self, text: &str, q: &Query) -> Result<Page> {
        let mut q = q.clone();
        q.text = Some(text.to_string());
        self.list(&q)
    }

    fn require(&self, conn: &Connection, id: ImageId) -> Result<()> {
        conn.query_row("SELECT 1 FROM images WHERE id = ?1", [id.0], |_| Ok(()))
            .optional()
            .map_err(GalleryError::db("looking up an image"))?
            .ok_or(GalleryError::NotFound(id))
    }

    pub fn set_favourite(&self, id: ImageId, favourite: bool) -> Result<()> {
        let n = self
            .conn()
            .execute("UPDATE images SET favourite = ?1 WHERE id = ?2", params![favourite, id.0])
            .map_err(GalleryError::db("setting a favourite"))?;
        if n == 0 {
            return Err(GalleryError::NotFound(id));
        }
        Ok(())
    }

    /// The image's tags, sorted.
    pub fn tags(&self, id: ImageId) -> Result<Vec<String>> {
        let conn = self.conn();
        self.require(&conn, id)?;
        let mut stmt = conn
            .prepare("SELECT tag FROM tags WHERE image_id = ?1 ORDER BY tag")
            .map_err(GalleryError::db("reading tags"))?;
        let tags = stmt
            .query_map([id.0], |r| r.get(0))
            .and_then(|rows| rows.collect::<rusqlite::Result<Vec<String>>>())
            .map_err(GalleryError::db("reading tags"))?;
        Ok(tags)
    }

    /// Replaces the image's tags (trimmed, deduplicated; each 1..=64 characters, at most 64).
    pub fn set_tags(&self, id: ImageId, tags: &[String]) -> Result<()> {
        let mut clean = tags.iter().map(|t| clean_tag(t)).collect::<Result<Vec<_>>>()?;
        clean.sort();
        clean.dedup();
        if clean.len() > MAX_TAGS {
            return Err(GalleryError::invalid("tags", format!("{} tags, at most {MAX_TAGS}", clean.len())));
        }
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(GalleryError::db("starting a tag update"))?;
        self.require(&tx, id)?;
        tx.execute("DELETE FROM tags WHERE image_id = ?1", [id.0])
            .map_err(GalleryError::db("clearing tags"))?;
        for t in &clean {
            tx.execute("INSERT INTO tags (image_id, tag) VALUES (?1, ?2)", params![id.0, t])
                .map_err(GalleryError::db("adding a tag"))?;
        }
        tx.commit().map_err(GalleryError::db("committing tags"))
    }

    pub fn add_tag(&self, id: ImageId, tag: &str) -> Result<()> {
        let tag = clean_tag(tag)?;
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(GalleryError::db("starting a tag update"))?;
        self.require(&tx, id)?;
        let count: i64 = tx
            .query_row(
                "SELECT count(*) FROM tags WHERE image_id = ?1 AND tag <> ?2",
                params![id.0, tag],
                |r| r.get(0),
            )
            .map_err(GalleryError::db("counting tags"))?;
        if count as usize >= MAX_TAGS {
            return Err(GalleryError::invalid("tags", format!("image {id} already has {MAX_TAGS} tags")));
        }
        tx.execute("INSERT OR IGNORE INTO tags (image_id, tag) VALUES (?1, ?2)", params![id.0, tag])
            .map_err(GalleryError::db("adding a tag"))?;
        tx.commit().map_err(GalleryError::db("committing tags"))
    }

    pub fn remove_tag(&self, id: ImageId, tag: &str) -> Result<()> {
        let conn = self.conn();
        self.require(&conn, id)?;
        conn.execute("DELETE FROM tags WHERE image_id = ?1 AND tag = ?2", params![id.0, tag.trim()])
            .map_err(GalleryError::db("removing a tag"))?;
        Ok(())
    }

    /// Soft delete: hidden from listings, restorable until [`Gallery::purge`]. Idempotent.
    pub fn delete(&self, id: ImageId) -> Result<()> {
        let conn = self.conn();
        self.require(&conn, id)?;
        conn.execute(
            "UPDATE images SET deleted_at = ?1 WHERE id = ?2 AND deleted_at IS NULL",
            params![time::now_ms(), id.0],
        )
        .map_err(GalleryError::db("deleting an image"))?;
        Ok(())
    }

    /// Undoes a soft delete. Idempotent.
    pub fn restore(&self, id: ImageId) -> Result<()> {
        let conn = self.conn();
        self.require(&conn, id)?;
        conn.execute("UPDATE images SET deleted_at = NULL WHERE id = ?1", [id.0])
            .map_err(GalleryError::db("restoring an image"))?;
        Ok(())
    }

    /// Removes for good every soft-deleted image: rows, and the files no remaining
    /// row shares. Files are unlinked while the write transaction is held, so no
    /// concurrent add can commit a row for a file being removed; a crash before the
    /// commit leaves soft-deleted rows without files, which reconciling finishes.
    pub fn purge(&self) -> Result<PurgeReport> {
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(GalleryError::db("starting a purge"))?;
        let shas: Vec<String> = {
            let mut stmt = tx
                .prepare("SELECT DISTINCT sha256 FROM images WHERE deleted_at IS NOT NULL")
                .map_err(GalleryError::db("finding deleted images"))?;
            let rows = stmt
                .query_map([], |r| r.get(0))
                .and_then(|r| r.collect::<rusqlite::Result<Vec<_>>>());
            rows.map_err(GalleryError::db("finding deleted images"))?
        };
        let rows = tx
            .execute("DELETE FROM images WHERE deleted_at IS NOT NULL", [])
            .map_err(GalleryError::db("purging rows"))?;
        let mut files = 0;
        for sha in &shas {
            let shared = tx
                .query_row("SELECT 1 FROM images WHERE sha256 = ?1 LIMIT 1", [sha], |_| Ok(()))
                .optional()
                .map_err(GalleryError::db("checking shared files"))?
                .is_some();
            if shared {
                continue;
            }
            for path in [self.image_path(sha), self.thumb_path(sha)] {
                match std::fs::remove_file(&path) {
                    Ok(()) => files += 1,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        return Err(GalleryError::Io {
                            path,
                            action: "cannot remove",
                            source: e,
                        })
                    }
                }
            }
        }
        tx.commit().map_err(GalleryError::db("committing a purge"))?;
        fsutil::sync_dir(&self.images)?;
        Ok(PurgeReport { rows, files })
    }

    /// The edit chain ending at `id`: ids from the root image to `id` itself.
    pub fn lineage(&self, id: ImageId) -> Result<Vec<ImageId>> {
        lineage_in(&self.conn(), id)
    }

    fn sha_of(&self, id: ImageId) -> Result<String> {
        self.conn()
            .query_row("SELECT sha256 FROM images WHERE id = ?1", [id.0], |r| r.get(0))
            .optional()
            .map_err(GalleryError::db("looking up an image"))?
            .ok_or(GalleryError::NotFound(id))
    }

    /// The PNG exactly as stored (recipe included).
    pub fn image_bytes(&self, id: ImageId) -> Result<Vec<u8>> {
        let sha = self.sha_of(id)?;
        fsutil::read_capped(&self.image_path(&sha), pngmeta::MAX_PNG_BYTES)
    }

    /// The thumbnail ([`THUMB_CONTENT_TYPE`]); rebuilt if its file went missing.
    pub fn thumb_bytes(&self, id: ImageId) -> Result<Vec<u8>> {
        let sha = self.sha_of(id)?;
        let path = self.thumb_path(&sha);
        match fsutil::read_capped(&path, pngmeta::MAX_PNG_BYTES) {
            Ok(b) => Ok(b),
            Err(GalleryError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                let png = fsutil::read_capped(&self.image_path(&sha), pngmeta::MAX_PNG_BYTES)?;
                let thumb = make_thumbnail(&png, &format!("image {id}"))?;
                fsutil::write_atomic(&self.thumbs, &format!("{sha}.png"), &thumb)?;
                Ok(thumb)
            }
            Err(e) => Err(e),
        }
    }

    /// The PNG for sharing: as stored (`with_metadata`), or with every text and
    /// other metadata chunk removed (the pixels' chunks copied byte for byte).
    pub fn export(&self, id: ImageId, with_metadata: bool) -> Result<Vec<u8>> {
        let bytes = self.image_bytes(id)?;
        if with_metadata {
            return Ok(bytes);
        }
        let chunks = pngmeta::chunks(&bytes, &format!("image {id}"))?;
        Ok(pngmeta::strip(&chunks))
    }

    /// Imports a PNG carrying a brume recipe or A1111 parameters. The same PNG
    /// imported twice gives the same id. `what` names the source in errors.
    pub fn import_bytes(&self, png: Vec<u8>, what: &str) -> Result<Imported> {
        let new = NewImage::from_png(png, what)?;
        self.add_inner(new, true)
    }

    /// [`Gallery::import_bytes`] of a file (read with a size cap).
    pub fn import_file(&self, path: &Path) -> Result<Imported> {
        let bytes = fsutil::read_capped(path, pngmeta::MAX_PNG_BYTES)?;
        self.import_bytes(bytes, &path.display().to_string())
    }

    /// How many images (live ones, or all).
    pub fn count(&self, include_deleted: bool) -> Result<u64> {
        let sql = if include_deleted {
            "SELECT count(*) FROM images"
        } else {
            "SELECT count(*) FROM images WHERE deleted_at IS NULL"
        };
        let n: i64 = self
            .conn()
            .query_row(sql, [], |r| r.get(0))
            .map_err(GalleryError::db("counting images"))?;
        Ok(n as u64)
    }
}

fn existing_in(conn: &Connection, new: &NewImage, sha: &str, dedupe: bool) -> Result<Option<ImageId>> {
    if let Some((job, index)) = &new.job {
        let found = conn
            .query_row(
                "SELECT id FROM images WHERE job_id = ?1 AND job_index = ?2",
                params![job, *index as i64],
                |r| r.get(0),
            )
            .optional()
            .map_err(GalleryError::db("looking up a job's image"))?;
        if let Some(id) = found {
            return Ok(Some(ImageId(id)));
        }
    }
    if dedupe {
        let found = conn
            .query_row(
                "SELECT id FROM images WHERE sha256 = ?1 AND deleted_at IS NULL ORDER BY id LIMIT 1",
                [sha],
                |r| r.get(0),
            )
            .optional()
            .map_err(GalleryError::db("looking up an image by content"))?;
        return Ok(found.map(ImageId));
    }
    Ok(None)
}

fn lineage_in(conn: &Connection, id: ImageId) -> Result<Vec<ImageId>> {
    let mut stmt = conn
        .prepare(
            "WITH RECURSIVE chain(id, parent, depth) AS ( \
                 SELECT id, parent, 0 FROM images WHERE id = ?1 \
                 UNION ALL SELECT i.id, i.parent, c.depth + 1 FROM images i JOIN chain c ON i.id = c.parent WHERE c.depth < 10000) \
             SELECT id FROM chain ORDER BY depth DESC",
        )
        .map_err(GalleryError::db("reading lineage"))?;
    let ids = stmt
        .query_map([id.0], |r| r.get(0).map(ImageId))
        .and_then(|rows| rows.collect::<rusqlite::Result<Vec<_>>>())
        .map_err(GalleryError::db("reading lineage"))?;
    if ids.is_empty() {
        return Err(GalleryError::NotFound(id));
    }
    Ok(ids)
}
