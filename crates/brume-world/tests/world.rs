//! End-to-end properties of the world: the held-out split and the dataset writer.

use brume_world::dataset::{dataset_record, item_seed};
use brume_world::{
    caption, held_out_prompts, held_out_scene, is_held_out, parse_caption, sample_scene, write_dataset, CaptionConfig,
    Layout, SampleConfig,
};
use std::collections::HashSet;

#[test]
fn held_out_prompts_are_distinct_held_out_and_never_in_training() {
    let held = held_out_prompts(250);
    assert_eq!(held.len(), 250);
    assert_eq!(held_out_prompts(10), held[..10].to_vec(), "prefix-stable");
    let mut keys = HashSet::new();
    for (caption, seed) in &held {
        let spec = parse_caption(caption).unwrap();
        assert!(is_held_out(&spec), "{caption}");
        assert_eq!(held_out_scene(*seed).spec(), spec);
        assert!(keys.insert(spec.key()), "duplicate spec {caption}");
    }
    // The training stream (dataset seed 0, and a second stream) never yields a held-out caption,
    // verbatim or up to paraphrase.
    let held_captions: HashSet<&str> = held.iter().map(|(c, _)| c.as_str()).collect();
    let omitting = CaptionConfig { omit_size: 0.5, omit_position: 0.5 };
    for (seed, cfg) in [(0u64, CaptionConfig::default()), (12345, CaptionConfig::default()), (7, omitting)] {
        for i in 0..30_000 {
            let rec = dataset_record(i, seed, &cfg);
            let caption = rec["caption"].as_str().unwrap();
            assert!(!held_captions.contains(caption), "{caption}");
            assert!(!is_held_out(&parse_caption(caption).unwrap()), "{caption}");
        }
    }
}

#[test]
fn dataset_writer_is_atomic_resumable_and_self_describing() {
    let dir = std::env::temp_dir().join(format!("brume-world-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(write_dataset(&dir, 6, 64, 9, &CaptionConfig::default()).unwrap(), 6);
    let jsonl = std::fs::read_to_string(dir.join("captions.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = jsonl.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 6);
    for (i, l) in lines.iter().enumerate() {
        let file = l["file"].as_str().unwrap();
        assert_eq!(file, format!("{i:07}.png"));
        let img = image::open(dir.join(file)).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (64, 64));
        let spec = parse_caption(l["caption"].as_str().unwrap()).unwrap();
        assert_eq!(spec.to_json(), l["spec"]);
    }
    let names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert!(names.iter().all(|n| !n.starts_with('.')), "temporary files left: {names:?}");
    // Rerunning renders nothing new and writes the same captions.
    assert_eq!(write_dataset(&dir, 6, 64, 9, &CaptionConfig::default()).unwrap(), 0);
    assert_eq!(std::fs::read_to_string(dir.join("captions.jsonl")).unwrap(), jsonl);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Omitting sizes and positions changes what captions say, at the rates asked for, and never the
/// picture; the default omits nothing and so reproduces earlier datasets' captions.
#[test]
fn caption_omissions_change_captions_not_pictures() {
    let cfg = CaptionConfig { omit_size: 0.3, omit_position: 0.4 };
    let (mut objects, mut unsized_objects, mut singles, mut unplaced) = (0, 0, 0, 0);
    for i in 0..4000 {
        let plain = dataset_record(i, 3, &CaptionConfig::default());
        let s = item_seed(3, i);
        assert_eq!(plain["caption"].as_str().unwrap(), caption(&sample_scene(s, &SampleConfig::default()), s));
        let rec = dataset_record(i, 3, &cfg);
        assert_eq!(rec["scene"], plain["scene"], "the picture must not depend on the captions");
        let spec = parse_caption(rec["caption"].as_str().unwrap()).unwrap();
        assert_eq!(spec.to_json(), rec["spec"]);
        let full = parse_caption(plain["caption"].as_str().unwrap()).unwrap();
        for (o, f) in spec.objects.iter().zip(&full.objects) {
            objects += 1;
            match o.size {
                None => unsized_objects += 1,
                Some(size) => assert_eq!(Some(size), f.size),
            }
            assert_eq!((o.shape, o.colour), (f.shape, f.colour));
        }
        if let Layout::Single(p) = spec.layout {
            singles += 1;
            match p {
                None => unplaced += 1,
                Some(_) => assert_eq!(spec.layout, full.layout),
            }
        }
    }
    let (size_rate, position_rate) = (unsized_objects as f64 / objects as f64, unplaced as f64 / singles as f64);
    assert!((size_rate - 0.3).abs() < 0.03, "size omitted in {size_rate:.3} of objects");
    assert!((position_rate - 0.4).abs() < 0.04, "position omitted in {position_rate:.3} of single objects");
    assert!(CaptionConfig { omit_size: 1.5, omit_position: 0.0 }.validate().unwrap_err().contains("omit_size"));
}

/// The judge must also *fail* wrong captions: mutate one attribute of a held-out spec (to a value
/// no object in the scene has) and the matching attribute must fail.
#[test]
fn judge_rejects_wrong_captions() {
    use brume_world::judge::judge;
    use brume_world::render::render;
    use brume_world::{Colour, Layout, Relation, Shape};
    let (mut tried, mut caught) = ([0usize; 3], [0usize; 3]);
    for (caption, seed) in held_out_prompts(150) {
        let spec = parse_caption(&caption).unwrap();
        let img = render(&held_out_scene(seed), 128);
        let used_shapes: Vec<Shape> = spec.objects.iter().map(|o| o.shape).collect();
        let used_colours: Vec<Colour> = spec.objects.iter().map(|o| o.colour).collect();
        // Shape.
        let mut s = spec.clone();
        s.objects[0].shape = *Shape::ALL.iter().find(|x| !used_shapes.contains(x)).unwrap();
        tried[0] += 1;
        caught[0] += !judge(&img, &s).objects[0].shape as usize;
        // Colour.
        let mut s = spec.clone();
        s.objects[0].colour =
            *Colour::ALL.iter().find(|c| !used_colours.contains(c) && **c != spec.background.colour).unwrap();
        tried[1] += 1;
        caught[1] += !judge(&img, &s).objects[0].colour as usize;
        // Relation (flipped) or position (moved).
        let mut s = spec.clone();
        s.layout = match spec.layout {
            Layout::Pair(Relation::LeftOf) => Layout::Pair(Relation::RightOf),
            Layout::Pair(Relation::RightOf) => Layout::Pair(Relation::LeftOf),
            Layout::Pair(Relation::Above) => Layout::Pair(Relation::Below),
            Layout::Pair(Relation::Below) => Layout::Pair(Relation::Above),
            Layout::Single(Some(p)) => Layout::Single(Some(
                *brume_world::Position::ALL.iter().find(|&&q| q != p).unwrap(),
            )),
            Layout::Single(None) => unreachable!(),
        };
        let v = judge(&img, &s);
        tried[2] += 1;
        caught[2] += !(v.relation.unwrap_or(true) && v.objects[0].position.unwrap_or(true)) as usize;
    }
    println!("wrong captions caught (shape, colour, layout): {caught:?} of {tried:?}");
    for k in 0..3 {
        assert!(caught[k] as f64 >= 0.98 * tried[k] as f64, "{caught:?} of {tried:?}");
    }
}
