//! The `brume` command end to end on the built-in model and the fixtures.

use std::process::Command;

fn brume() -> Command {
    Command::new(env!("CARGO_BIN_EXE_brume"))
}

/// The built-in model's native size, as `brume inspect` reports it.
fn builtin_size() -> u32 {
    let out = brume().arg("inspect").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let line = text.lines().find(|l| l.starts_with("native size")).expect("inspect prints the native size");
    line.split_whitespace().last().unwrap().split('x').next().unwrap().parse().unwrap()
}

fn fixtures() -> std::path::PathBuf {
    std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures"))
}

#[test]
fn generate_with_the_builtin_model_writes_a_png_and_never_overwrites() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.png");
    let run = brume().args(["generate", "a red circle on a blue background", "--steps", "3", "--out"]).arg(&out).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let img = image::open(&out).unwrap();
    let n = builtin_size();
    assert_eq!((img.width(), img.height()), (n, n));
    // Same seed, same picture; the existing file is kept without --force.
    let again = brume().args(["generate", "--prompt", "a red circle on a blue background", "--steps", "3", "--out"]).arg(&out).output().unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    let out2 = tmp.path().join("y.png");
    let third = brume().args(["generate", "a red circle on a blue background", "--steps", "3", "--out"]).arg(&out2).output().unwrap();
    assert!(third.status.success());
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&out2).unwrap(), "same seed must give the same PNG");
}

#[test]
fn bad_requests_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.png");
    let run = brume().args(["generate", "--out"]).arg(&out).output().unwrap();
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("no prompt"));
    let run = brume().args(["generate", "cat", "--width", "100", "--out"]).arg(&out).output().unwrap();
    assert!(String::from_utf8_lossy(&run.stderr).contains("multiples of 8"), "{}", String::from_utf8_lossy(&run.stderr));
    let run = brume().args(["generate", "cat", "--model", "/nonexistent/model", "--out"]).arg(&out).output().unwrap();
    assert!(String::from_utf8_lossy(&run.stderr).contains("/nonexistent/model"));
    assert!(!out.exists());
}

#[test]
fn inspect_reports_segments() {
    let run = brume().arg("inspect").arg(fixtures().join("parity/pipeline_sd2v/model")).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let text = String::from_utf8_lossy(&run.stdout);
    for s in ["text_encoder", "vae_encoder", "unet", "vae_decoder", "VPrediction", "F32"] {
        assert!(text.contains(s), "missing {s} in\n{text}");
    }
}

#[test]
fn random_model_of_a_real_config_loads() {
    // SDXS is the smallest real preset; f16 keeps the write small and fast.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sdxs");
    let run = brume().args(["random-model", "--preset", "sdxs-512", "--out"]).arg(&dir).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let run = brume().arg("inspect").arg(&dir).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let text = String::from_utf8_lossy(&run.stdout);
    assert!(text.contains("AutoencoderTiny") && text.contains("native size  512x512"), "{text}");
    let again = brume().args(["random-model", "--preset", "sdxs-512", "--out"]).arg(&dir).output().unwrap();
    assert!(!again.status.success(), "must not overwrite an existing folder");
}

/// The steps and guidance a UNet folder of the built-in model recommends.
fn builtin_defaults(unet: &str) -> (u64, f64) {
    let path = fixtures().join(format!("../models/builtin/{unet}/sampling_defaults.json"));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    (v["num_inference_steps"].as_u64().unwrap(), v["guidance_scale"].as_f64().unwrap())
}

#[test]
fn generate_takes_the_models_own_settings_unless_told_otherwise() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    run_ok(&["generate", "a red circle", "--out", "a.png"], d);
    let info = run_ok(&["info", "a.png"], d);
    let (steps, g) = builtin_defaults("unet");
    assert!(info.contains(&format!("Steps: {steps}, Sampler: ddim, CFG scale: {g},")), "{info}");
    run_ok(&["generate", "a red circle", "--steps", "2", "--guidance", "7.5", "--out", "b.png"], d);
    assert!(run_ok(&["info", "b.png"], d).contains("Steps: 2, Sampler: ddim, CFG scale: 7.5,"));
    // The distilled UNet brings its own: four LCM steps at the scale it embeds.
    run_ok(&["generate", "a red circle", "--unet", "unet_lcm", "--out", "c.png"], d);
    let info = run_ok(&["info", "c.png"], d);
    let (steps, g) = builtin_defaults("unet_lcm");
    assert!(info.contains(&format!("Steps: {steps}, Sampler: lcm, CFG scale: {g},")), "{info}");
    // img2img's strength too: each UNet's own (a share of its steps), unless given.
    let strength = |unet: &str| -> f64 {
        let path = fixtures().join(format!("../models/builtin/{unet}/sampling_defaults.json"));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        v["strength"].as_f64().unwrap()
    };
    assert!(strength("unet_lcm") > strength("unet"), "four LCM steps need more strength than 25 DDIM steps");
    for (unet, args, want) in [
        ("unet", &[][..], strength("unet")),
        ("unet_lcm", &[][..], strength("unet_lcm")),
        ("unet_lcm", &["--strength", "0.5"][..], 0.5),
    ] {
        let out = run_ok(&[&["edit", "a blue circle", "--image", "c.png", "--unet", unet, "--out", "e.png", "--force"][..], args].concat(), d);
        assert!(out.contains(&format!("strength {want},")), "{unet} {args:?}: {out}");
    }
}

fn run_ok(args: &[&str], dir: &std::path::Path) -> String {
    let out = brume().args(args).current_dir(dir).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn images_carry_their_recipe_and_from_recreates_them_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    run_ok(&["generate", "a red circle", "--steps", "3", "--seed", "9", "--batch", "2", "--negative-prompt", "blur", "--out", "a.png", "--preview", "p.png"], d);
    assert!(d.join("a-2.png").exists() && d.join("p.png").exists());
    let info = run_ok(&["info", "a.png"], d);
    let n = builtin_size();
    // No --guidance: the built-in UNet's own recommendation (unet/sampling_defaults.json).
    let g = builtin_defaults("unet").1;
    assert!(info.contains(&format!("a red circle\nNegative prompt: blur\nSteps: 3, Sampler: ddim, CFG scale: {g}, Seed: 9, Size: {n}x{n}")), "{info}");
    let json = run_ok(&["info", "--json", "a.png"], d);
    assert!(json.contains("\"mode\": \"txt2img\"") && json.contains("\"batch\": 2"), "{json}");
    run_ok(&["generate", "--from", "a.png", "--out", "b.png"], d);
    assert_eq!(std::fs::read(d.join("a.png")).unwrap(), std::fs::read(d.join("b.png")).unwrap());
    assert_eq!(std::fs::read(d.join("a-2.png")).unwrap(), std::fs::read(d.join("b-2.png")).unwrap());

    // Edits: img2img, inpaint, outpaint; each re-created from its own recipe.
    // A mask of the model's size: a soft-edged square in the middle.
    let mask = d.join("m.png");
    image::GrayImage::from_fn(n, n, |x, y| {
        let inside = |v: u32| v > n / 4 && v < 3 * n / 4;
        image::Luma([if inside(x) && inside(y) { 255 } else if inside(x) || inside(y) { 100 } else { 0 }])
    })
    .save(&mask)
    .unwrap();
    run_ok(&["edit", "a blue square", "--image", "a.png", "--strength", "0.5", "--steps", "4", "--out", "e.png"], d);
    run_ok(&["edit", "a blue square", "--image", "a.png", "--mask", "m.png", "--steps", "4", "--out", "i.png"], d);
    run_ok(&["edit", "sky", "--image", "a.png", "--extend", "0,0,32,8", "--steps", "4", "--out", "o.png"], d);
    assert_eq!(image::open(d.join("o.png")).unwrap().width(), n + 32);
    assert_eq!(image::open(d.join("o.png")).unwrap().height(), n + 8);
    for f in ["e", "i", "o"] {
        run_ok(&["edit", "--from", &format!("{f}.png"), "--out", &format!("{f}2.png")], d);
        assert_eq!(std::fs::read(d.join(format!("{f}.png"))).unwrap(), std::fs::read(d.join(format!("{f}2.png"))).unwrap(), "{f}");
    }
    // Inpainting keeps the unmasked pixels.
    let (a, i, m) = (image::open(d.join("a.png")).unwrap().to_rgb8(), image::open(d.join("i.png")).unwrap().to_rgb8(), image::open(&mask).unwrap().to_luma8());
    for (x, y, p) in a.enumerate_pixels() {
        if m.get_pixel(x, y).0[0] < 128 {
            assert_eq!(i.get_pixel(x, y), p);
        }
    }
    // A changed input is refused on re-creation.
    std::fs::copy(d.join("b.png"), d.join("a.png")).unwrap();
    image::RgbImage::new(n, n).save(d.join("a.png")).unwrap();
    let out = brume().args(["edit", "--from", "e.png", "--out", "e3.png"]).current_dir(d).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("has changed"));
}

#[test]
fn edit_errors_are_clear() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    std::fs::write(d.join("x.png"), "not an image").unwrap();
    let out = brume().args(["edit", "p", "--image", "x.png"]).current_dir(d).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("x.png"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = brume().args(["generate", "p", "--sampler", "nope"]).current_dir(d).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown sampler `nope`"));
    let out = brume().args(["info", "x.png"]).current_dir(d).output().unwrap();
    assert!(!out.status.success());
}

#[test]
fn eval_adherence_prints_the_table_and_writes_a_contact_sheet() {
    let tmp = tempfile::tempdir().unwrap();
    let sheet = tmp.path().join("sheet.png");
    let out = brume().args(["eval", "adherence", "--count", "6", "--steps", "2", "--columns", "3", "--sheet"]).arg(&sheet).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    for k in ["background_colour", "shape", "colour", "all attributes", "images/s"] {
        assert!(text.contains(k), "{k} missing in {text}");
    }
    // Every held-out caption states each object's size, so the shape rows by size
    // split the shape row's objects between them.
    // Rows read: name, accuracy %, n, then the 95 % interval "lo - hi", which holds the accuracy.
    let row_of = |name: &str| -> Vec<String> {
        let row = text.lines().find(|l| l.split_whitespace().next() == Some(name)).unwrap_or_else(|| panic!("no {name} row in {text}"));
        row.split_whitespace().map(str::to_owned).collect()
    };
    let n_of = |name: &str| -> usize { row_of(name)[2].parse().unwrap() };
    assert_eq!(n_of("shape_small") + n_of("shape_large"), n_of("shape"), "{text}");
    // The colours and shapes asked for split the colour and shape rows' objects between them.
    for what in ["colour", "shape"] {
        let header = format!("by {what} asked for");
        let section: Vec<&str> = text.lines().skip_while(|l| !l.starts_with(&header)).skip(1).take_while(|l| l.starts_with("  ")).collect();
        let n: usize = section.iter().map(|l| l.split_whitespace().nth(2).unwrap().parse::<usize>().unwrap()).sum();
        assert!(!section.is_empty() && n == n_of(what), "{what}: {section:?} in {text}");
    }
    for name in ["background_colour", "colour", "shape"] {
        let r = row_of(name);
        let num = |s: &str| -> f64 { s.trim_end_matches('%').parse().unwrap() };
        let (acc, lo, hi) = (num(&r[1]), num(&r[3]), num(&r[5]));
        assert!(r[4] == "-" && lo <= acc && acc <= hi && hi <= 100.0 && lo < hi, "{name}: {r:?}");
    }
    let img = image::open(&sheet).unwrap();
    let t = builtin_size() + 2;
    assert_eq!((img.width(), img.height()), (3 * t, 2 * t));
    assert_eq!(std::fs::read_to_string(sheet.with_extension("txt")).unwrap().lines().count(), 6);

    // --from skips the first prompts: prompts 4 and 5 of the list above, numbered as there.
    let later = tmp.path().join("later.png");
    let out = brume().args(["eval", "adherence", "--from", "4", "--count", "2", "--steps", "2", "--sheet"]).arg(&later).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("on 2 held-out prompts from #4"));
    let all = std::fs::read_to_string(sheet.with_extension("txt")).unwrap();
    let tail: Vec<&str> = all.lines().skip(4).map(|l| l.split("seed").nth(1).unwrap()).collect();
    let got: Vec<String> = std::fs::read_to_string(later.with_extension("txt")).unwrap().lines().map(str::to_owned).collect();
    assert_eq!(got.len(), 2);
    for (i, (line, want)) in got.iter().zip(&tail).enumerate() {
        assert!(line.trim_start().starts_with(&format!("{} ", 4 + i)) && line.ends_with(want), "{line} / {want}");
    }

    let show = tmp.path().join("show.png");
    let out = brume().args(["eval", "showcase", "--steps", "2", "--out"]).arg(&show).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let img = image::open(&show).unwrap();
    assert_eq!((img.width(), img.height()), (11 * t, 2 * t), "11 samplers; 5 edit tiles");
    assert!(std::fs::read_to_string(show.with_extension("txt")).unwrap().contains("outpainted"));

    // A stretch past the held-out list is refused before anything is generated.
    // (A fresh sheet name: `later.png` exists now, and an existing sheet is refused first.)
    let out = brume().args(["eval", "adherence", "--from", "99999", "--count", "2", "--sheet"]).arg(tmp.path().join("past.png")).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--from 99999 + --count 2"), "{err}");

    // A sheet named .txt would be overwritten by its own legend: refused before anything is generated.
    let txt = tmp.path().join("legend.txt");
    for cmd in [["eval", "adherence", "--sheet"], ["eval", "showcase", "--out"], ["eval", "edits", "--sheet"]] {
        let out = brume().args(cmd).arg(&txt).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(".png name"), "{err}");
    }
    assert!(!txt.exists());
}

#[test]
fn eval_edits_grades_img2img_and_inpainting_and_inpainting_keeps_the_rest() {
    let tmp = tempfile::tempdir().unwrap();
    let sheet = tmp.path().join("edits.png");
    let out = brume().args(["eval", "edits", "--count", "3", "--columns", "2", "--sheet"]).arg(&sheet).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let split = text.find("inpainting at strength 1").unwrap_or_else(|| panic!("no inpainting table in {text}"));
    let (recolour, replace) = text.split_at(split);
    assert!(recolour.contains("img2img at strength 0.6") && recolour.contains("guidance 3.5"), "{text}");
    // (correct, n) of a row of one section.
    let row = |section: &str, name: &str| -> (usize, usize) {
        let l = section.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no {name} row in {section}"));
        let f: Vec<&str> = l[name.len()..].split_whitespace().collect();
        let (acc, n): (f64, usize) = (f[0].trim_end_matches('%').parse().unwrap(), f[1].parse().unwrap());
        ((acc * n as f64 / 100.0).round() as usize, n)
    };
    assert!(!recolour.contains("edited shape"), "img2img keeps the shape: {recolour}");
    for (section, rows) in [(recolour, &["edited colour"][..]), (replace, &["edited colour", "edited shape"][..])] {
        for name in rows {
            let (ok, n) = row(section, name);
            assert_eq!(n, 3, "{name}: {section}");
            // The built-in model at its own settings makes these edits (it gets most of 300 right;
            // these three are among them): a pipeline that ignores the prompt, or a mask in the
            // wrong place, leaves the first object as it was and scores 0 here.
            assert!(ok >= 2, "{name} {ok}/3: {section}");
        }
        assert_eq!(row(section, "background_colour"), (3, 3), "{section}");
    }

    // The sheet: four tiles a case, two cases a row; the sources are the world's renders.
    let size = builtin_size();
    let t = size + 2;
    let img = image::open(&sheet).unwrap().to_rgb8();
    assert_eq!((img.width(), img.height()), (8 * t, 2 * t));
    let tile = |k: u32| image::imageops::crop_imm(&img, 1 + (k % 8) * t, 1 + (k / 8) * t, size, size).to_image();
    let cases = brume_world::edit_cases(0, 3);
    for (i, case) in cases.iter().enumerate() {
        let k = 4 * i as u32;
        assert!(tile(k) == brume_world::render(&case.recoloured, size), "case {i}: recoloured source");
        assert!(tile(k) != tile(k + 1), "case {i}: img2img changed nothing");
        assert!(tile(k + 2) == brume_world::render(&case.replaced, size), "case {i}: replaced source");
        // Inpainting pastes the result back: outside the mask every pixel is the source's.
        let mask = brume_world::object_mask(&case.replaced, 0, size, 0.04, 8);
        let (src, edited) = (tile(k + 2), tile(k + 3));
        let (mut inside_changed, mut outside_changed) = (0, 0);
        for (x, y, m) in mask.enumerate_pixels() {
            let changed = src.get_pixel(x, y) != edited.get_pixel(x, y);
            if m[0] == 0 {
                outside_changed += changed as usize;
            } else {
                inside_changed += changed as usize;
            }
        }
        assert_eq!(outside_changed, 0, "case {i}: inpainting touched pixels outside the mask");
        assert!(inside_changed > 0, "case {i}: inpainting changed nothing inside the mask");
    }
    assert_eq!(std::fs::read_to_string(sheet.with_extension("txt")).unwrap().lines().count(), 4);

    // A 9-channel inpainting UNet has no img2img; its inpainting is still graded.
    let nine = fixtures().join("edit/inpaint_9ch/model");
    let out = brume().args(["eval", "edits", "--count", "1", "--steps", "2", "--sheet"]).arg(tmp.path().join("nine.png")).arg("--model").arg(&nine).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("img2img: skipped") && text.contains("9-channel") && text.contains("edited shape"), "{text}");

    // Bad settings are refused before anything is generated, naming the flag.
    for (args, flag) in [
        (&["--strength", "0"][..], "--strength"),
        (&["--strength", "1.5"][..], "--strength"),
        (&["--inpaint-strength", "nan"][..], "--inpaint-strength"),
        (&["--mask-margin", "0.9"][..], "--mask-margin"),
        (&["--from", "99999", "--count", "2"][..], "--from 99999"),
    ] {
        let bad = tmp.path().join("bad.png");
        let out = brume().args(["eval", "edits", "--sheet"]).arg(&bad).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(flag), "{args:?}: {err}");
        assert!(!bad.exists());
    }
}

#[test]
fn convert_writes_a_model_that_generates_and_bench_precision_compares_tiers() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("int8");
    let run = brume().args(["convert", "--precision", "int8", "--out"]).arg(&out).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    assert!(String::from_utf8_lossy(&run.stdout).contains("int8"));
    let png = tmp.path().join("a.png");
    let gen = brume().args(["generate", "a red circle", "--steps", "2", "--model"]).arg(&out).arg("--out").arg(&png).output().unwrap();
    assert!(gen.status.success(), "{}", String::from_utf8_lossy(&gen.stderr));
    assert!(png.exists());
    // An existing OUT is kept without --force; its own input is refused even with it.
    let again = brume().args(["convert", "--precision", "int8", "--out"]).arg(&out).output().unwrap();
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("--force"));
    let onto_input = brume().args(["convert", "--precision", "fp16", "--force", "--model"]).arg(&out).arg("--out").arg(&out).output().unwrap();
    assert!(!onto_input.status.success() && String::from_utf8_lossy(&onto_input.stderr).contains("input model"));
    let bad = brume().args(["convert", "--precision", "int5", "--out"]).arg(tmp.path().join("z")).output().unwrap();
    assert!(String::from_utf8_lossy(&bad.stderr).contains("neither a preset"), "{}", String::from_utf8_lossy(&bad.stderr));
    // A policy file, with a bad line named.
    let policy = tmp.path().join("p.policy");
    std::fs::write(&policy, "unet/* palettize4\n* int8\n").unwrap();
    let pol = brume().args(["convert", "--precision"]).arg(&policy).arg("--out").arg(tmp.path().join("p")).output().unwrap();
    assert!(pol.status.success(), "{}", String::from_utf8_lossy(&pol.stderr));
    let record = std::fs::read_to_string(tmp.path().join("p/brume_precision.json")).unwrap();
    assert!(record.contains("unet/* palettize4"), "{record}");
    std::fs::write(&policy, "unet/* palettize5\n").unwrap();
    let bad = brume().args(["convert", "--precision"]).arg(&policy).arg("--out").arg(tmp.path().join("q")).output().unwrap();
    let e = String::from_utf8_lossy(&bad.stderr);
    assert!(e.contains("line 1") && e.contains("palettize5"), "{e}");

    let bench = brume()
        .args(["bench", "precision", "--tiers", "fp32,int8", "--steps", "2", "--adherence", "2", "--adherence-steps", "2", "--work"])
        .arg(tmp.path().join("bench"))
        .output()
        .unwrap();
    assert!(bench.status.success(), "{}", String::from_utf8_lossy(&bench.stderr));
    let table = String::from_utf8_lossy(&bench.stdout);
    for s in ["PSNR", "exact", "int8", "prompt adherence", "unet MiB"] {
        assert!(table.contains(s), "missing {s} in\n{table}");
    }
}

#[test]
fn memory_budgets_are_resolved_planned_and_refused_before_loading() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.png");
    let doctor = brume().args(["doctor", "--device-tier", "a17-pro"]).output().unwrap();
    let text = String::from_utf8_lossy(&doctor.stdout);
    assert!(text.lines().any(|l| l.starts_with("budget") && l.contains("a17-pro")), "{text}");
    let bad = brume().args(["generate", "x", "--device-tier", "a15", "--out"]).arg(&out).output().unwrap();
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && err.contains("a15") && err.contains("a17-pro"), "{err}");
    let both = brume().args(["generate", "x", "--device-tier", "a16", "--memory-budget", "1GB", "--out"]).arg(&out).output().unwrap();
    assert!(!both.status.success());
    // Far too small: refused with the budget and the smallest need, nothing written.
    let tiny = brume().args(["generate", "x", "--memory-budget", "5MB", "--out"]).arg(&out).output().unwrap();
    let err = String::from_utf8_lossy(&tiny.stderr);
    assert!(!tiny.status.success() && err.contains("out of memory budget") && err.contains("--memory-budget 5MB") && err.contains("needs"), "{err}");
    assert!(!out.exists());
    // A roomy tier: the plain path, said on stderr and kept in the recipe.
    let ok = brume().args(["generate", "x", "--steps", "1", "--device-tier", "a17-pro", "--out"]).arg(&out).output().unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert!(String::from_utf8_lossy(&ok.stderr).contains("memory plan resident: runs as asked"));
    let info = brume().arg("info").arg(&out).arg("--json").output().unwrap();
    assert!(String::from_utf8_lossy(&info.stdout).contains("memory_plan"), "{}", String::from_utf8_lossy(&info.stdout));
}

#[test]
fn resolution_fallback_is_reported_or_upscaled_as_chosen() {
    let tmp = tempfile::tempdir().unwrap();
    // At 512 px the built-in model needs ~25 MiB private with every same-size fallback (its weights are mapped,
    // not counted), ~44 MiB with the planner's headroom; 44 MB (42 MiB) only fits at a lower resolution.
    let args = ["generate", "x", "--steps", "1", "--width", "512", "--height", "512", "--memory-budget", "44MB"];
    let small = tmp.path().join("small.png");
    let run = brume().args(args).args(["--resolution-fallback", "report", "--out"]).arg(&small).output().unwrap();
    let err = String::from_utf8_lossy(&run.stderr).into_owned();
    assert!(run.status.success(), "{err}");
    let line = err.lines().find(|l| l.contains("lower resolution")).unwrap_or_else(|| panic!("no fallback line in {err}"));
    let img = image::open(&small).unwrap();
    assert!(img.width() < 512 && img.width() == img.height(), "{}x{}", img.width(), img.height());
    assert!(line.contains(&format!("{0}x{0}, written at that size", img.width())), "{line}");
    let big = tmp.path().join("big.png");
    let run = brume().args(args).args(["--resolution-fallback", "upscale", "--out"]).arg(&big).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let img = image::open(&big).unwrap();
    assert_eq!((img.width(), img.height()), (512, 512));
    let off = brume().args(args).args(["--resolution-fallback", "off", "--out"]).arg(tmp.path().join("off.png")).output().unwrap();
    assert!(!off.status.success() && String::from_utf8_lossy(&off.stderr).contains("out of memory budget"));
}

#[test]
fn kernels_switch_gives_the_same_picture_and_the_bench_prints_its_table() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    run_ok(&["--kernels", "fast", "generate", "a red circle", "--steps", "3", "--out", "f.png"], d);
    run_ok(&["--kernels", "reference", "generate", "a red circle", "--steps", "3", "--out", "r.png"], d);
    let (f, r) = (image::open(d.join("f.png")).unwrap().to_rgb8(), image::open(d.join("r.png")).unwrap().to_rgb8());
    let worst = f.as_raw().iter().zip(r.as_raw()).map(|(a, b)| a.abs_diff(*b)).max().unwrap();
    assert!(worst <= 2, "fast and reference kernels differ by {worst}/255");
    let bad = brume().args(["--kernels", "turbo", "inspect"]).output().unwrap();
    assert!(!bad.status.success());
    let table = run_ok(&["bench", "kernels", "--only", "gn", "--runs", "1", "--python", "none"], d);
    for s in ["group norm 320ch 64x64 g32 + SiLU", "brume fast", "brume reference", "fast/reference", "PyTorch column left out"] {
        assert!(table.contains(s), "missing {s} in\n{table}");
    }
}
