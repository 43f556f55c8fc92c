//! The frame diffuser on the built-in model's LCM UNet (from the repository's
//! models/builtin): the fixed noise makes the same frame give the same picture,
//! a still input is skipped by the similarity filter, and the governor lowers the
//! resolution when a target cannot be met.

use std::path::Path;

use brume::pipelines::{OpenOptions, SdModel};
use brume_live::diffuser::{DiffuserConfig, FrameDiffuser};
use brume_live::governor::{Governed, Governor};
use brume_live::pipeline::Diffuse;
use brume_live::techniques::Techniques;
use image::{Rgb, RgbImage};

fn model() -> SdModel {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/builtin");
    SdModel::open(
        &root,
        &OpenOptions {
            unet: Some("unet_lcm".into()),
            ..Default::default()
        },
    )
    .unwrap()
}

fn frame(shift: u32) -> RgbImage {
    RgbImage::from_fn(64, 64, |x, y| {
        let dx = x as i32 - 20 - shift as i32;
        let dy = y as i32 - 32;
        if dx * dx + dy * dy < 144 {
            Rgb([220, 30, 30])
        } else {
            Rgb([30, 60, 200])
        }
    })
}

#[test]
fn fixed_noise_same_frame_same_output_and_skip_on_still_input() {
    brume::runtime::on_compute_thread(|| {
        let cfg = DiffuserConfig {
            strength: 0.6,
            ..DiffuserConfig::new("a large red circle on the left on a blue background")
        };
        let mut d = FrameDiffuser::new(model(), cfg).unwrap();
        let a = d.process(&frame(0)).unwrap();
        let b = d.process(&frame(10)).unwrap();
        let c = d.process(&frame(0)).unwrap();
        assert!(!a.skipped && !b.skipped && !c.skipped);
        assert_eq!(a.image.dimensions(), (64, 64));
        assert_eq!(a.image, c.image, "the same frame gives the same picture");
        assert_ne!(a.image, b.image, "a changed frame changes the picture");

        d.set_techniques(Techniques {
            similarity_skip: true,
            ..Techniques::NONE
        });
        let first = d.process(&frame(0)).unwrap();
        assert!(!first.skipped);
        let skips: Vec<bool> = (0..12)
            .map(|_| d.process(&frame(0)).unwrap().skipped)
            .collect();
        assert_eq!(&skips[..10], &[true; 10], "a still input is skipped...");
        assert!(!skips[10], "...but not more than 10 times in a row");
        assert_eq!(
            d.process(&frame(0)).unwrap().image,
            first.image,
            "a skip shows the last result"
        );
    });
}

#[test]
fn governor_lowers_the_resolution_for_an_impossible_target() {
    brume::runtime::on_compute_thread(|| {
        let d = FrameDiffuser::new(model(), DiffuserConfig::new("a small green square")).unwrap();
        let mut g = Governed::new(d, Governor::new(0.5, vec![64, 32], 2));
        for _ in 0..12 {
            g.diffuse(&frame(0)).unwrap();
        }
        let s = g.governor.current();
        assert_eq!((s.width, s.steps), (32, 1), "{:?}", g.governor.decisions());
        let notes = g.notes();
        assert!(
            notes.iter().any(|n| n.contains("-> 32 px x 1 step")),
            "{notes:?}"
        );
    });
}

#[test]
fn split_pipeline_gives_the_one_thread_results_in_order() {
    use brume_live::diffuser::{DecodeStage, DenoiseStage, EncodeStage};
    use brume_live::pipeline::{run_sequential, PipelineOptions};
    use brume_live::source::Synthetic;
    use brume_live::split::run_split;
    use brume_live::WhenFull;
    let cfg = DiffuserConfig {
        strength: 0.5,
        techniques: Techniques {
            latent_blend: true,
            ..Techniques::NONE
        },
        ..DiffuserConfig::new("a red circle")
    };
    let opts = PipelineOptions {
        width: 64,
        queue: 1,
        when_full: WhenFull::Block,
        pace_fps: None,
        smoothing: None,
    };
    let frames = || Synthetic::new("pan", 6, None, |i| frame(i as u32 * 3));
    let mut one = Vec::new();
    let c = cfg.clone();
    run_sequential(
        &mut frames(),
        move || FrameDiffuser::new(model(), c),
        &mut |_, img| {
            one.push(img.clone());
            Ok(())
        },
        &opts,
    )
    .unwrap();
    let mut split = Vec::new();
    let (c1, c2) = (cfg.clone(), cfg.clone());
    let r = run_split(
        &mut frames(),
        || EncodeStage::new(&model(), &c1),
        || DenoiseStage::new(model(), &c2),
        || DecodeStage::new(&model()),
        &mut |i, img| {
            split.push((i, img.clone()));
            Ok(())
        },
        &opts,
        1,
    )
    .unwrap();
    assert_eq!(r.frames.len(), 6);
    assert_eq!(
        split.iter().map(|s| s.0).collect::<Vec<_>>(),
        (0..6).collect::<Vec<_>>()
    );
    for (a, (_, b)) in one.iter().zip(&split) {
        assert_eq!(
            a, b,
            "the split stages compute what one thread does (blending included)"
        );
    }
}
