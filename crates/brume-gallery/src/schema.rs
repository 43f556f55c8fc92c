//! Versioned migrations, tracked by `PRAGMA user_version`: migration `i` (from 0)
//! takes the schema from version `i` to `i + 1` inside one transaction. To change
//! the schema, append a migration; never edit one that has shipped.

use rusqlite::Connection;

use crate::error::{GalleryError, Result};

/// v1, the first schema.
const V1: &str = r#"
CREATE TABLE images (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: ids stay valid in URLs and lineage
    -- SHA-256 of the PNG, lowercase hex; the file is images/<sha256>.png
    sha256          TEXT NOT NULL CHECK (length(sha256) = 64),
    bytes           INTEGER NOT NULL,
    created_at      INTEGER NOT NULL,           -- Unix milliseconds, UTC
    job_id          TEXT,
    job_index       INTEGER,
    prompt          TEXT NOT NULL DEFAULT '',
    negative_prompt TEXT,
    model           TEXT,
    model_hash      TEXT,
    sampler         TEXT,
    steps           INTEGER,
    guidance        REAL,
    seed            INTEGER,                    -- u64 stored as its i64 bit pattern
    width           INTEGER NOT NULL,           -- of the PNG itself
    height          INTEGER NOT NULL,
    mode            TEXT,
    recipe          TEXT,                       -- the brume recipe JSON, when the image has one
    parameters      TEXT,                       -- the A1111 "parameters" text
    timings         TEXT,                       -- JSON, opaque to the gallery
    parent          INTEGER REFERENCES images(id) ON DELETE SET NULL,
    favourite       INTEGER NOT NULL DEFAULT 0,
    deleted_at      INTEGER                     -- soft delete: Unix milliseconds
);
CREATE UNIQUE INDEX images_job ON images(job_id, job_index) WHERE job_id IS NOT NULL;
CREATE INDEX images_sha ON images(sha256);
CREATE INDEX images_created ON images(created_at);
CREATE INDEX images_model ON images(model);
CREATE INDEX images_seed ON images(seed);
CREATE INDEX images_parent ON images(parent);

CREATE TABLE tags (
    image_id INTEGER NOT NULL REFERENCES images(id) ON DELETE CASCADE,
    tag      TEXT NOT NULL,
    PRIMARY KEY (image_id, tag)
) WITHOUT ROWID;
CREATE INDEX tags_tag ON tags(tag);

CREATE VIRTUAL TABLE images_fts USING fts5(
    prompt, negative_prompt, content='images', content_rowid='id', tokenize='unicode61 remove_diacritics 2'
);
CREATE TRIGGER images_fts_insert AFTER INSERT ON images BEGIN
    INSERT INTO images_fts(rowid, prompt, negative_prompt) VALUES (new.id, new.prompt, coalesce(new.negative_prompt, ''));
END;
CREATE TRIGGER images_fts_delete AFTER DELETE ON images BEGIN
    INSERT INTO images_fts(images_fts, rowid, prompt, negative_prompt)
        VALUES ('delete', old.id, old.prompt, coalesce(old.negative_prompt, ''));
END;
CREATE TRIGGER images_fts_update AFTER UPDATE OF prompt, negative_prompt ON images BEGIN
    INSERT INTO images_fts(images_fts, rowid, prompt, negative_prompt)
        VALUES ('delete', old.id, old.prompt, coalesce(old.negative_prompt, ''));
    INSERT INTO images_fts(rowid, prompt, negative_prompt) VALUES (new.id, new.prompt, coalesce(new.negative_prompt, ''));
END;
"#;

/// Every migration, in order.
const MIGRATIONS: &[&str] = &[V1];

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Brings the database to [`SCHEMA_VERSION`]; refuses one from a newer brume.
pub fn migrate(conn: &mut Connection) -> Result<()> {
    let fts5: bool = conn
        .query_row("SELECT sqlite_compileoption_used('ENABLE_FTS5')", [], |r| r.get(0))
        .map_err(GalleryError::db("checking for FTS5"))?;
    if !fts5 {
        return Err(GalleryError::MissingFeature("FTS5 (full-text search)"));
    }
    let found: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(GalleryError::db("reading the schema version"))?;
    if found > SCHEMA_VERSION {
        return Err(GalleryError::TooNew {
            found,
            known: SCHEMA_VERSION,
        });
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(found.max(0) as usize) {
        let tx = conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Exclusive)
            .map_err(GalleryError::db("starting a migration"))?;
        // Another process may have migrated while we waited for the lock.
        let now: i64 = tx
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(GalleryError::db("reading the schema version"))?;
        if now > i as i64 {
            continue;
        }
        tx.execute_batch(sql).map_err(GalleryError::db("applying a schema migration"))?;
        tx.pragma_update(None, "user_version", i as i64 + 1)
            .map_err(GalleryError::db("recording the schema version"))?;
        tx.commit().map_err(GalleryError::db("committing a schema migration"))?;
        tracing::info!(version = i + 1, "gallery schema migrated");
    }
    Ok(())
}
