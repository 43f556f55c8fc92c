//! `brume gallery` end to end on a temporary data directory (no model needed:
//! images are imported PNGs carrying A1111 parameters).

use std::path::Path;
use std::process::{Command, Output};

fn brume(data: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_brume"))
        .arg("gallery")
        .arg("--data-dir")
        .arg(data)
        .args(args)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// An 8x8 PNG whose `parameters` chunk is `params` (as the A1111 web UI writes it).
fn a1111_png(params: &str, shade: u8) -> Vec<u8> {
    let mut img = image::RgbImage::from_pixel(8, 8, image::Rgb([shade, 20, 200]));
    img.put_pixel(0, 0, image::Rgb([1, 2, 3]));
    let mut buf = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut buf, 8, 8);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        enc.add_itxt_chunk("parameters".into(), params.into()).unwrap();
        let mut w = enc.write_header().unwrap();
        w.write_image_data(img.as_raw()).unwrap();
        w.finish().unwrap();
    }
    buf
}

#[test]
fn import_list_search_show_export_delete_purge() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let a = tmp.path().join("a.png");
    let b = tmp.path().join("b.png");
    std::fs::write(
        &a,
        a1111_png(
            "a lighthouse in a storm\nNegative prompt: people\nSteps: 30, Sampler: Euler a, CFG scale: 7, Seed: 11, Size: 8x8, Model: sd15",
            10,
        ),
    )
    .unwrap();
    // A prompt that tries to drive the terminal (clear screen, then a bidi override).
    std::fs::write(
        &b,
        a1111_png(
            "evil \u{1b}[2J prompt \u{202e}gnp.exe\nSteps: 5, Sampler: DDIM, CFG scale: 3, Seed: 12, Size: 8x8",
            90,
        ),
    )
    .unwrap();
    let notpng = tmp.path().join("c.txt");
    std::fs::write(&notpng, b"hello").unwrap();

    let o = brume(&data, &["import", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("imported") && text(&o).contains("as 1") && text(&o).contains("as 2"),
        "{}",
        text(&o)
    );
    let o = brume(&data, &["import", a.to_str().unwrap(), notpng.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(text(&o).contains("already in the gallery as 1"), "{}", text(&o));
    assert!(text(&o).contains("not a usable PNG"), "{}", text(&o));

    let o = brume(&data, &["list"]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("ID") && out.contains("PROMPT"), "{out}");
    assert!(out.contains("a lighthouse in a storm"), "{out}");
    assert!(
        !out.contains('\u{1b}') && !out.contains('\u{202e}'),
        "control characters must be escaped: {out:?}"
    );
    assert!(out.contains("\\u{1b}[2J") && out.contains("\\u{202e}"), "{out}");
    let newest_first = out.find("evil").unwrap() < out.find("lighthouse").unwrap();
    assert!(newest_first, "{out}");

    let o = brume(&data, &["search", "lighthouse"]);
    assert!(text(&o).contains("lighthouse") && !text(&o).contains("evil"), "{}", text(&o));
    let o = brume(&data, &["search", "NEAR( \"unclosed"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = brume(&data, &["list", "--sampler", "DDIM", "--size", "8x8"]);
    assert!(text(&o).contains("evil") && !text(&o).contains("lighthouse"), "{}", text(&o));
    let o = brume(&data, &["list", "--size", "8by8"]);
    assert!(!o.status.success() && text(&o).contains("--size"), "{}", text(&o));
    let o = brume(&data, &["list", "--limit", "1"]);
    assert!(text(&o).contains("more: --cursor 2"), "{}", text(&o));
    let o = brume(&data, &["list", "--limit", "1", "--cursor", "2"]);
    assert!(text(&o).contains("lighthouse") && !text(&o).contains("more:"), "{}", text(&o));

    let o = brume(&data, &["show", "1"]);
    let out = text(&o);
    assert!(
        out.contains("negative prompt: people") && out.contains("Steps: 30") && out.contains("seed:            11"),
        "{out}"
    );
    let o = brume(&data, &["show", "2", "--json"]);
    assert!(
        o.status.success() && !text(&o).contains('\u{202e}') && !text(&o).contains('\u{1b}'),
        "{}",
        text(&o)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("show --json stays valid JSON");
    assert_eq!(v["prompt"], "evil \u{1b}[2J prompt \u{202e}gnp.exe", "same values once parsed");
    let o = brume(&data, &["show", "99"]);
    assert!(!o.status.success() && text(&o).contains("99 not found"), "{}", text(&o));
    let o = brume(&data, &["show", "x"]);
    assert!(!o.status.success());

    let o = brume(&data, &["favourite", "1"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = brume(&data, &["list", "--favourites"]);
    assert!(text(&o).contains("lighthouse") && !text(&o).contains("evil"), "{}", text(&o));
    let o = brume(&data, &["tag", "1", "--add", "sea", "--add", "night"]);
    assert!(text(&o).contains("night, sea"), "{}", text(&o));
    let o = brume(&data, &["list", "--tag", "sea"]);
    assert!(text(&o).contains("lighthouse"), "{}", text(&o));

    // Export: with the recipe, stripped, and never over an existing file without --force.
    let full = tmp.path().join("full.png");
    let o = brume(&data, &["export", "1", "--out", full.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(std::fs::read(&full).unwrap(), std::fs::read(&a).unwrap());
    let o = brume(&data, &["export", "1", "--out", full.to_str().unwrap(), "--strip"]);
    assert!(!o.status.success() && text(&o).contains("--force"), "{}", text(&o));
    assert_eq!(std::fs::read(&full).unwrap(), std::fs::read(&a).unwrap(), "kept");
    let o = brume(&data, &["export", "1", "--out", full.to_str().unwrap(), "--strip", "--force"]);
    assert!(o.status.success(), "{}", text(&o));
    let stripped = std::fs::read(&full).unwrap();
    assert!(!stripped.windows(10).any(|w| w == b"lighthouse"));
    assert_eq!(
        image::load_from_memory(&stripped).unwrap().to_rgb8(),
        image::open(&a).unwrap().to_rgb8()
    );

    // Delete, restore, delete, purge.
    let o = brume(&data, &["delete", "2"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&brume(&data, &["list"])).contains("evil"));
    assert!(text(&brume(&data, &["list", "--deleted"])).contains("[deleted]"));
    assert!(brume(&data, &["restore", "2"]).status.success());
    assert!(text(&brume(&data, &["list"])).contains("evil"));
    assert!(brume(&data, &["delete", "2"]).status.success());
    let o = brume(&data, &["purge"]);
    assert!(text(&o).contains("purged 1 image(s)"), "{}", text(&o));
    assert!(!brume(&data, &["show", "2"]).status.success());
    assert!(text(&brume(&data, &["list", "--all"])).contains("lighthouse"));
}
