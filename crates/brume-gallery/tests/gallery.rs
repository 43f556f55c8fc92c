//! The gallery's behaviour, end to end on a temporary data directory.

mod common;

use std::path::Path;

use brume_gallery::{
    pngmeta, time, Deleted, Gallery, GalleryError, ImageId, NewImage, Query, ReconcileReport, DB_FILE, IMAGES_DIR, THUMBS_DIR,
};
use common::{a1111_png, made, png, recipe};

fn open(dir: &Path) -> (Gallery, ReconcileReport) {
    Gallery::open(dir).expect("open gallery")
}

fn ids(page: &brume_gallery::Page) -> Vec<i64> {
    page.items.iter().map(|i| i.id.0).collect()
}

fn q() -> Query {
    Query::default()
}

#[test]
fn opens_private_migrated_and_reopens() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("a/b/brume");
    let (g, report) = open(&dir);
    assert!(report.is_clean(), "{report}");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        for d in [dir.clone(), dir.join(IMAGES_DIR), dir.join(THUMBS_DIR)] {
            assert_eq!(
                std::fs::metadata(&d).unwrap().permissions().mode() & 0o777,
                0o700,
                "{}",
                d.display()
            );
        }
        assert_eq!(std::fs::metadata(dir.join(DB_FILE)).unwrap().permissions().mode() & 0o777, 0o600);
    }
    let id = g.add(made("a red circle", 1, 16, 16)).unwrap();
    drop(g);
    {
        let c = rusqlite::Connection::open(dir.join(DB_FILE)).unwrap();
        let v: i64 = c.query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
        assert_eq!(v, brume_gallery::SCHEMA_VERSION);
        let mode: String = c.query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
        assert_eq!(mode, "wal");
    }
    let (g, report) = open(&dir);
    assert!(report.is_clean(), "{report}");
    assert_eq!(g.get(id).unwrap().info.prompt, "a red circle");
    drop(g);

    // A schema from a newer brume is refused, not clobbered.
    rusqlite::Connection::open(dir.join(DB_FILE))
        .unwrap()
        .pragma_update(None, "user_version", 99)
        .unwrap();
    assert!(matches!(Gallery::open(&dir), Err(GalleryError::TooNew { found: 99, .. })));

    // A data directory that is a file or a symlink is refused.
    let file = tmp.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    assert!(matches!(Gallery::open(&file), Err(GalleryError::DataDir { .. })));
    #[cfg(unix)]
    {
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(tmp.path().join("a"), &link).unwrap();
        let err = Gallery::open(&link).err().expect("symlink refused");
        assert!(err.to_string().contains("symbolic link"), "{err}");
    }
}

#[cfg(unix)]
#[test]
fn existing_data_dir_is_made_private() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("d");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let _ = open(&dir);
    assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
}

#[test]
fn add_get_and_idempotent_jobs() {
    let tmp = tempfile::tempdir().unwrap();
    let (g, _) = open(tmp.path());
    let mut new = made("a cat on a mat", 42, 24, 16);
    new.timings = Some(serde_json::json!({"total_ms": 12}));
    new.job = Some(("job-1".into(), 0));
    let bytes = new.png.clone();
    let id = g.add(new.clone()).unwrap();
    assert_eq!(g.add(new.clone()).unwrap(), id, "same job and index: same row");
    assert_eq!(g.count(true).unwrap(), 1);
    // Same picture from another job is another gallery entry (sharing the file).
    new.job = Some(("job-2".into(), 0));
    let id2 = g.add(new).unwrap();
    assert_ne!(id, id2);

    let d = g.get(id).unwrap();
    assert_eq!(d.info.prompt, "a cat on a mat");
    assert_eq!(d.info.negative_prompt.as_deref(), Some("blurry, dark"));
    assert_eq!((d.info.width, d.info.height), (24, 16));
    assert_eq!(d.info.seed, Some(42));
    assert_eq!(d.info.steps, Some(20));
    assert_eq!(d.info.sampler.as_deref(), Some("ddim"));
    assert_eq!(d.info.model.as_deref(), Some("builtin"));
    assert_eq!(d.info.model_hash.as_deref(), Some("abcdef0123"));
    assert_eq!(d.info.mode.as_deref(), Some("txt2img"));
    assert_eq!(d.info.job_id.as_deref(), Some("job-1"));
    assert_eq!(d.timings, Some(serde_json::json!({"total_ms": 12})));
    assert_eq!(d.recipe_typed().unwrap(), recipe("a cat on a mat", 42, 24, 16));
    assert!(d.parameters.unwrap().contains("Steps: 20"));
    assert_eq!(d.lineage, vec![id]);
    assert!(time::parse_time(&d.info.created_at, "t").is_ok());
    assert_eq!(g.image_bytes(id).unwrap(), bytes);

    let thumb = g.thumb_bytes(id).unwrap();
    let t = image::load_from_memory(&thumb).unwrap();
    assert_eq!((t.width(), t.height()), (24, 16), "small images keep their size");

    assert!(g.get(ImageId(999)).unwrap_err().is_not_found());
    assert!(g.image_bytes(ImageId(999)).unwrap_err().is_not_found());
    // Seeds past i64::MAX survive.
    let mut big = made("big seed", u64::MAX - 3, 8, 8);
    big.seed = Some(u64::MAX - 3);
    let bid = g.add(big).unwrap();
    assert_eq!(g.get(bid).unwrap().info.seed, Some(u64::MAX - 3));
    assert_eq!(
        ids(&g
            .list(&Query {
                seed: Some(u64::MAX - 3),
                ..q()
            })
            .unwrap()),
        vec![bid.0]
    );
}

#[test]
fn thumbnails_fit_256() {
    let tmp = tempfile::tempdir().unwrap();
    let (g, _) = open(tmp.path());
    let id = g.add(made("wide", 3, 600, 300)).unwrap();
    let t = image::load_from_memory(&g.thumb_bytes(id).unwrap()).unwrap();
    assert_eq!((t.width(), t.height()), (256, 128));
}

#[test]
fn bad_pngs_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (g, _) = open(tmp.path());
    let mut n = made("x", 1, 8, 8);
    n.png = b"not a png".to_vec();
    assert!(matches!(g.add(n.clone()), Err(GalleryError::BadPng { .. })));
    let mut good = png(1, 8, 8, None);
    let last = good.len() - 20;
    good[last] ^= 0xff; // breaks a CRC
    n.png = good;
    assert!(matches!(g.add(n), Err(GalleryError::BadPng { .. })));
    assert_eq!(g.count(true).unwrap(), 0);
}

#[test]
fn pages_filters_and_search() {
    let tmp = tempfile::tempdir().unwrap();
    let (g, _) = open(tmp.path());
    let prompts = [
        "a red circle",
        "a blue square",
        "a café at night",
        "red-car racing",
        "the quick brown fox",
        "cat in a hat",
        "dog",
    ];
    let mut all = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut n = made(p, i as u64, if i % 2 == 0 { 16 } else { 24 }, 16);
        if i == 3 {
            n.sampler = Some("euler".into());
            n.model = Some("other".into());
        }
        all.push(g.add(n).unwrap());
    }
    // Pages of 3: newest first, no overlaps, cursor ends.
    let mut seen = Vec::new();
    let mut cursor = None;
    let mut pages = 0;
    loop {
        let page = g
            .list(&Query {
                limit: Some(3),
                cursor: cursor.clone(),
                ..q()
            })
            .unwrap();
        seen.extend(ids(&page));
        pages += 1;
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    let mut expect: Vec<i64> = all.iter().map(|i| i.0).collect();
    expect.reverse();
    assert_eq!(seen, expect);
    assert!(matches!(
        g.list(&Query {
            cursor: Some("zzz".into()),
            ..q()
        }),
        Err(GalleryError::Invalid { field: "cursor", .. })
    ));
    assert!(matches!(
        g.list(&Query { limit: Some(0), ..q() }),
        Err(GalleryError::Invalid { field: "limit", .. })
    ));
    assert!(g
        .list(&Query {
            limit: Some(100_000),
            ..q()
        })
        .is_err());

    // Filters.
    assert_eq!(
        ids(&g
            .list(&Query {
                sampler: Some("euler".into()),
                ..q()
            })
            .unwrap()),
        vec![all[3].0]
    );
    assert_eq!(
        ids(&g
            .list(&Query {
                model: Some("other".into()),
                ..q()
            })
            .unwrap()),
        vec![all[3].0]
    );
    assert_eq!(
        g.list(&Query {
            model: Some("abcdef0123".into()),
            ..q()
        })
        .unwrap()
        .items
        .len(),
        7,
        "model hash matches too"
    );
    assert_eq!(g.list(&Query { width: Some(24), ..q() }).unwrap().items.len(), 3);
    assert_eq!(
        g.list(&Query {
            width: Some(16),
            height: Some(16),
            ..q()
        })
        .unwrap()
        .items
        .len(),
        4
    );
    assert_eq!(ids(&g.list(&Query { seed: Some(4), ..q() }).unwrap()), vec![all[4].0]);
    let now = time::now_ms();
    assert_eq!(
        g.list(&Query {
            since: Some(now - 60_000),
            ..q()
        })
        .unwrap()
        .items
        .len(),
        7
    );
    assert_eq!(
        g.list(&Query {
            until: Some(now - 60_000),
            ..q()
        })
        .unwrap()
        .items
        .len(),
        0
    );
    assert_eq!(
        g.list(&Query {
            since: Some(now + 60_000),
            ..q()
        })
        .unwrap()
        .items
        .len(),
        0
    );

    // Full-text search.
    let s = |text: &str| ids(&g.search(text, &q()).unwrap());
    assert_eq!(s("red"), vec![all[3].0, all[0].0]);
    assert_eq!(s("RED circle"), vec![all[0].0]);
    assert_eq!(s("cafe"), vec![all[2].0], "diacritics folded");
    assert_eq!(s("qui*"), vec![all[4].0], "prefix");
    assert_eq!(s("red-car"), vec![all[3].0]);
    assert_eq!(s("blurry").len(), 7, "negative prompts are searched");
    assert_eq!(s("nothing-like-this"), Vec::<i64>::new());
    for nasty in [
        "\"",
        "\"\"",
        "'",
        "NEAR(",
        "NEAR(red blue",
        "red AND",
        "OR",
        "NOT",
        "*",
        "-red",
        "prompt:red",
        "red:",
        "(((",
        ")",
        "'; DROP TABLE images; --",
        "^red",
        "{red}",
        "red + blue",
        "\u{0}\u{1b}[2J",
        "😀",
        "   ",
        "",
        &"x".repeat(10_000),
        &"a ".repeat(5000),
    ] {
        let r = g.search(nasty, &q());
        assert!(r.is_ok(), "{nasty:?}: {:?}", r.err());
    }
    assert_eq!(
        s("red ( \" NEAR( -"),
        s("red near"),
        "NEAR( is a word, not syntax; punctuation alone is dropped"
    );
    assert_eq!(s("red ) \" *"), vec![all[3].0, all[0].0]);
    assert_eq!(s("\"red\" \"circle"), vec![all[0].0]);
    // Search combines with filters and pages.
    assert_eq!(
        ids(&g
            .search(
                "red",
                &Query {
                    sampler: Some("ddim".into()),
                    ..q()
                }
            )
            .unwrap()),
        vec![all[0].0]
    );
    let p1 = g.search("a", &Query { limit: Some(2), ..q() }).unwrap();
    assert!(p1.next_cursor.is_some());
}

#[test]
fn favourites_tags_delete_restore_purge() {
    let tmp = tempfile::tempdir().unwrap();
    let (g, _) = open(tmp.path());
    let a = g.add(made("one", 1, 8, 8)).unwrap();
    let b = g.add(made("two", 2, 8, 8)).unwrap();
    let mut same = made("two", 2, 8, 8);
    same.job = Some(("j".into(), 0));
    let b2 = g.add(same).unwrap(); // same file as b

    g.set_favourite(a, true).unwrap();
    assert_eq!(
        ids(&g
            .list(&Query {
                favourite: Some(true),
                ..q()
            })
            .unwrap()),
        vec![a.0]
    );
    assert_eq!(
        g.list(&Query {
            favourite: Some(false),
            ..q()
        })
        .unwrap()
        .items
        .len(),
        2
    );
    assert!(g.set_favourite(ImageId(77), true).unwrap_err().is_not_found());

    g.set_tags(a, &["sky ".into(), "sea".into(), "sky".into()]).unwrap();
    assert_eq!(g.tags(a).unwrap(), vec!["sea", "sky"]);
    g.add_tag(b, "sky").unwrap();
    g.add_tag(b, "sky").unwrap();
    assert_eq!(
        g.list(&Query {
            tag: Some("sky".into()),
            ..q()
        })
        .unwrap()
        .items
        .len(),
        2
    );
    g.remove_tag(a, "sky").unwrap();
    assert_eq!(
        ids(&g
            .list(&Query {
                tag: Some("sky".into()),
                ..q()
            })
            .unwrap()),
        vec![b.0]
    );
    assert_eq!(g.get(a).unwrap().info.tags, vec!["sea"]);
    assert!(matches!(g.add_tag(a, "  "), Err(GalleryError::Invalid { field: "tag", .. })));
    assert!(matches!(g.add_tag(a, "a\u{1b}b"), Err(GalleryError::Invalid { field: "tag", .. })));
    assert!(g.add_tag(ImageId(77), "x").unwrap_err().is_not_found());

    g.delete(a).unwrap();
    g.delete(a).unwrap();
    assert!(g.get(a).unwrap().info.deleted);
    assert_eq!(g.list(&q()).unwrap().items.len(), 2);
    assert_eq!(
        ids(&g
            .list(&Query {
                deleted: Deleted::Only,
                ..q()
            })
            .unwrap()),
        vec![a.0]
    );
    assert_eq!(
        g.list(&Query {
            deleted: Deleted::Include,
            ..q()
        })
        .unwrap()
        .items
        .len(),
        3
    );
    assert!(g.search("one", &q()).unwrap().items.is_empty());
    g.restore(a).unwrap();
    assert_eq!(g.search("one", &q()).unwrap().items.len(), 1);

    // Purge removes rows and the files no other row shares.
    let sha_a = g.get(a).unwrap().info.sha256;
    let sha_b = g.get(b).unwrap().info.sha256;
    g.delete(a).unwrap();
    g.delete(b).unwrap();
    let r = g.purge().unwrap();
    assert_eq!(r.rows, 2);
    assert_eq!(r.files, 2, "a's image and thumbnail; b's file is b2's too");
    assert!(!tmp.path().join(IMAGES_DIR).join(format!("{sha_a}.png")).exists());
    assert!(tmp.path().join(IMAGES_DIR).join(format!("{sha_b}.png")).exists());
    assert!(g.get(a).unwrap_err().is_not_found());
    assert_eq!(g.image_bytes(b2).unwrap().len() as u64, g.get(b2).unwrap().info.bytes);
    assert_eq!(g.purge().unwrap().rows, 0);
    // Re-adding a purged picture writes its file again.
    let a3 = g.add(made("one", 1, 8, 8)).unwrap();
    assert!(g.image_bytes(a3).is_ok());
    drop(g);
    let (_, report) = open(tmp.path());
    assert!(report.is_clean(), "{report}");
}

#[test]
fn lineage_follows_parents() {
    let tmp = tempfile::tempdir().unwrap();
    let (g, _) = open(tmp.path());
    let root = g.add(made("root", 1, 8, 8)).unwrap();
    let mut e1 = made("edit one", 2, 8, 8);
    e1.parent = Some(root);
    let e1 = g.add(e1).unwrap();
    let mut e2 = made("edit two", 3, 8, 8);
    e2.parent = Some(e1);
    let e2 = g.add(e2).unwrap();
    assert_eq!(g.lineage(e2).unwrap(), vec![root, e1, e2]);
    assert_eq!(g.get(e2).unwrap().lineage, vec![root, e1, e2]);
    assert_eq!(g.get(e2).unwrap().info.parent, Some(e1));
    assert_eq!(ids(&g.list(&Query { parent: Some(root), ..q() }).unwrap()), vec![e1.0]);
    // A parent that is not there (purged meanwhile) does not lose the result.
    let mut orphan = made("late", 4, 8, 8);
    orphan.parent = Some(ImageId(12345));
    let o = g.add(orphan).unwrap();
    assert_eq!(g.get(o).unwrap().info.parent, None);
    assert!(g.lineage(ImageId(999)).unwrap_err().is_not_found());
}

#[test]
fn export_with_and_without_metadata() {
    let tmp = tempfile::tempdir().unwrap();
    let (g, _) = open(tmp.path());
    let n = made("secret prompt", 9, 16, 8);
    let stored = n.png.clone();
    let id = g.add(n).unwrap();
    let with = g.export(id, true).unwrap();
    assert_eq!(with, stored);
    let stripped = g.export(id, false).unwrap();
    let chunks = pngmeta::chunks(&stripped, "stripped").unwrap();
    assert!(pngmeta::text_chunks(&chunks, "stripped").unwrap().is_empty());
    assert!(!stripped.windows(6).any(|w| w == b"secret"));
    let a = image::load_from_memory(&with).unwrap().to_rgb8();
    let b = image::load_from_memory(&stripped).unwrap().to_rgb8();
    assert_eq!(a, b, "same pixels");
}

#[test]
fn imports_brume_and_a1111_pngs() {
    let tmp = tempfile::tempdir().unwrap();
    let (g, _) = open(&tmp.path().join("g"));
    let r = recipe("imported brume", 5, 8, 8);
    let file = tmp.path().join("in.png");
    std::fs::write(&file, png(5, 8, 8, Some(&r))).unwrap();
    let i = g.import_file(&file).unwrap();
    assert!(i.created);
    assert_eq!(g.get(i.id).unwrap().recipe_typed().unwrap(), r);
    let again = g.import_file(&file).unwrap();
    assert_eq!(again, brume_gallery::Imported { id: i.id, created: false });

    let text = "a lighthouse, \"storm\"\nNegative prompt: people\nSteps: 30, Sampler: DPM++ 2M Karras, CFG scale: 6.5, Seed: 777, Size: 8x8, Model hash: 6ce0161689, Model: v1-5-pruned, Lora hashes: \"a: 1, b: 2\"";
    for compressed in [false, true] {
        let mut png = a1111_png(text, compressed);
        if compressed {
            png = a1111_png(&format!("{text}, Version: z"), true);
        }
        let i = g.import_bytes(png, "a1111.png").unwrap();
        let d = g.get(i.id).unwrap();
        assert_eq!(d.info.prompt, "a lighthouse, \"storm\"");
        assert_eq!(d.info.negative_prompt.as_deref(), Some("people"));
        assert_eq!(d.info.steps, Some(30));
        assert_eq!(d.info.sampler.as_deref(), Some("DPM++ 2M Karras"));
        assert_eq!(d.info.guidance, Some(6.5));
        assert_eq!(d.info.seed, Some(777));
        assert_eq!(d.info.model.as_deref(), Some("v1-5-pruned"));
        assert_eq!(d.info.model_hash.as_deref(), Some("6ce0161689"));
        assert!(d.recipe.is_none());
        assert!(d.parameters.unwrap().starts_with("a lighthouse"));
    }
    assert_eq!(g.search("lighthouse", &q()).unwrap().items.len(), 2);

    // No metadata, garbage, and a zTXt bomb are clear errors.
    assert!(matches!(
        g.import_bytes(png(1, 8, 8, None), "plain.png"),
        Err(GalleryError::NoRecipe(_))
    ));
    assert!(matches!(
        g.import_bytes(b"GIF89a".to_vec(), "x.gif"),
        Err(GalleryError::BadPng { .. })
    ));
    let bomb = a1111_png(&"A".repeat(3 << 20), true);
    assert!(bomb.len() < 64 << 10, "compressed: {}", bomb.len());
    let err = g.import_bytes(bomb, "bomb.png").unwrap_err();
    assert!(matches!(err, GalleryError::Metadata { .. }), "{err}");
    assert!(err.to_string().contains("inflates to more than"), "{err}");
    assert!(g.import_file(&tmp.path().join("missing.png")).is_err());
}

#[test]
fn reconcile_repairs_both_sides() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (g, _) = open(dir);
    let keep = g.add(made("keep", 1, 8, 8)).unwrap();
    let lose = g.add(made("lose", 2, 8, 8)).unwrap();
    let lose_sha = g.get(lose).unwrap().info.sha256;
    let keep_sha = g.get(keep).unwrap().info.sha256;
    drop(g);
    let images = dir.join(IMAGES_DIR);
    // A row whose file is gone.
    std::fs::remove_file(images.join(format!("{lose_sha}.png"))).unwrap();
    // A file with a recipe and no row (a crash between file and commit).
    let r = recipe("no row yet", 3, 8, 8);
    let unrowed = png(3, 8, 8, Some(&r));
    let unrowed_sha = {
        use sha2::Digest;
        sha2::Sha256::digest(&unrowed)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    std::fs::write(images.join(format!("{unrowed_sha}.png")), &unrowed).unwrap();
    // A file without a recipe, a temp file, a stray name, a missing and a stray thumbnail.
    let plain = png(4, 8, 8, None);
    let plain_sha = {
        use sha2::Digest;
        sha2::Sha256::digest(&plain).iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    std::fs::write(images.join(format!("{plain_sha}.png")), &plain).unwrap();
    std::fs::write(images.join(".tmp-123-0-0"), b"half a png").unwrap();
    std::fs::write(images.join("notes.txt"), b"?").unwrap();
    std::fs::remove_file(dir.join(THUMBS_DIR).join(format!("{keep_sha}.png"))).unwrap();
    std::fs::write(dir.join(THUMBS_DIR).join("junk.png"), b"?").unwrap();

    let (g, report) = open(dir);
    assert_eq!(report.missing_files.len(), 1, "{report}");
    assert_eq!(report.missing_files[0].id, lose);
    assert_eq!(report.reimported.len(), 1, "{report}");
    assert_eq!(report.temp_removed, vec!["images/.tmp-123-0-0".to_string()]);
    let mut orphaned = report.orphaned.clone();
    orphaned.sort();
    assert_eq!(orphaned, vec![format!("orphans/{plain_sha}.png"), "orphans/notes.txt".to_string()]);
    assert_eq!(report.thumbs_rebuilt, 1);
    assert_eq!(report.thumbs_removed, 2, "junk.png and the lost row's");
    assert!(report.to_string().contains("re-imported"), "{report}");
    assert!(g.get(lose).unwrap_err().is_not_found());
    let re = g.get(report.reimported[0].1).unwrap();
    assert_eq!(re.info.prompt, "no row yet");
    assert!(g.thumb_bytes(keep).is_ok());
    assert!(dir.join("orphans/notes.txt").exists());
    drop(g);
    let (_, again) = open(dir);
    assert!(again.is_clean(), "{again}");
}

#[test]
fn a_second_open_does_not_reconcile_under_the_first() {
    let tmp = tempfile::tempdir().unwrap();
    let (g1, _) = open(tmp.path());
    std::fs::write(tmp.path().join(IMAGES_DIR).join(".tmp-in-flight"), b"x").unwrap();
    let (g2, report) = open(tmp.path());
    assert!(report.skipped.is_some(), "{report}");
    assert!(tmp.path().join(IMAGES_DIR).join(".tmp-in-flight").exists());
    // Both see each other's rows.
    let id = g1.add(made("shared", 1, 8, 8)).unwrap();
    assert_eq!(g2.get(id).unwrap().info.prompt, "shared");
    drop((g1, g2));
    let (_, report) = open(tmp.path());
    assert_eq!(report.temp_removed.len(), 1);
}

#[test]
fn gallery_is_send_and_sync_and_takes_concurrent_adds() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Gallery>();
    let tmp = tempfile::tempdir().unwrap();
    let (g, _) = open(tmp.path());
    let g = std::sync::Arc::new(g);
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let g = g.clone();
            std::thread::spawn(move || {
                for i in 0..5u32 {
                    let mut n: NewImage = made(&format!("thread {t} image {i}"), (t * 100 + i) as u64, 8, 8);
                    n.job = Some((format!("job{t}"), i));
                    g.add(n.clone()).unwrap();
                    g.add(n).unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(g.count(true).unwrap(), 20);
}

#[test]
fn default_data_dir_follows_the_environment() {
    // Only checks the shape (the environment is the test runner's own).
    if let Some(d) = brume_gallery::default_data_dir() {
        assert!(d.is_absolute() || std::env::var_os("BRUME_DATA_DIR").is_some());
    }
}

#[test]
fn search_text_and_terminal_escapes() {
    use brume_gallery::{escape_for_terminal, fts_query};
    assert_eq!(fts_query("red car").as_deref(), Some("\"red\" \"car\""));
    assert_eq!(fts_query("say \"hi\"").as_deref(), Some("\"say\" \"\"\"hi\"\"\""));
    assert_eq!(fts_query("cat*").as_deref(), Some("\"cat\"*"));
    assert_eq!(fts_query("a\u{0}b").as_deref(), Some("\"a\" \"b\""));
    assert_eq!(fts_query("( ) \" * -"), None);
    assert_eq!(fts_query(&"w ".repeat(100)).unwrap().matches('"').count(), 64, "at most 32 words");
    assert_eq!(escape_for_terminal("a\nb\t\u{1b}[2J\u{9b}\u{202e}x\\"), "a\\nb\\t\\u{1b}[2J\\u{9b}\\u{202e}x\\\\");
    assert_eq!(escape_for_terminal("café 😀"), "café 😀");
}
