//! The live pipeline's contract: queues never block a live producer and count what
//! they drop; results come out in order with bounded latency; the similarity filter
//! skips a still input at most 10 times in a row; the fixed noise makes a frame give
//! the same picture; Y4M files are read back as written.

use std::time::{Duration, Instant};

use brume_live::pipeline::{run_pipeline, run_sequential, Diffuse, Diffused, PipelineOptions};
use brume_live::queue::{DropQueue, Pushed, WhenFull};
use brume_live::source::{FrameSource, Synthetic, Y4mSource};
use brume_live::techniques::{flicker, signed_pixels, SimilarityFilter, Smoother};
use brume_live::{y4m, LiveError};
use image::{Rgb, RgbImage};

#[test]
fn drop_oldest_queue_never_blocks_the_producer_and_counts_drops() {
    let q = DropQueue::new(2, WhenFull::DropOldest);
    let t = Instant::now();
    let mut dropped = Vec::new();
    for i in 0..1000u32 {
        if let Pushed::DroppedOldest(old) = q.push(i) {
            dropped.push(old);
        }
    }
    assert!(
        t.elapsed() < Duration::from_millis(200),
        "pushing into a full queue must not wait"
    );
    assert_eq!(q.dropped(), 998);
    assert_eq!(dropped, (0..998).collect::<Vec<_>>(), "the oldest go first");
    assert_eq!(
        (q.pop(), q.pop()),
        (Some(998), Some(999)),
        "the newest are kept, in order"
    );
    q.close();
    assert_eq!(q.pop(), None);
    assert!(matches!(q.push(5), Pushed::Closed(5)));
}

#[test]
fn blocking_queue_waits_for_room() {
    let q = std::sync::Arc::new(DropQueue::new(1, WhenFull::Block));
    q.push(1);
    let q2 = q.clone();
    let h = std::thread::spawn(move || {
        let t = Instant::now();
        q2.push(2);
        t.elapsed()
    });
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(q.pop(), Some(1));
    let waited = h.join().unwrap();
    assert!(
        waited >= Duration::from_millis(30),
        "the producer waited {waited:?}"
    );
    assert_eq!(q.pop(), Some(2));
    assert_eq!(q.dropped(), 0);
}

/// A stand-in diffusion stage: takes `ms` per frame and stamps the frame's first pixel.
struct Slow {
    ms: u64,
}

impl Diffuse for Slow {
    fn diffuse(&mut self, frame: &RgbImage) -> brume_live::Result<Diffused> {
        std::thread::sleep(Duration::from_millis(self.ms));
        Ok(Diffused {
            image: frame.clone(),
            encode_ms: 0.0,
            unet_ms: self.ms as f64,
            decode_ms: 0.0,
            skipped: false,
        })
    }
}

/// Frames whose first pixel's red channel is their index.
fn numbered(count: u64, fps: Option<f64>) -> impl FrameSource {
    Synthetic::new("numbered", count, fps, |i| {
        let mut img = RgbImage::new(16, 16);
        img.put_pixel(0, 0, Rgb([i as u8, 0, 0]));
        img
    })
}

#[test]
fn frames_come_out_in_order_with_bounded_latency() {
    // Source at 200 FPS (5 ms), diffusion 20 ms a frame: most frames must be dropped,
    // and what comes out is in order and never waited behind a backlog.
    let mut src = numbered(60, Some(200.0));
    let mut seen = Vec::new();
    let mut sink = |i: u64, img: &RgbImage| -> brume_live::Result<()> {
        assert_eq!(
            img.get_pixel(0, 0).0[0] as u64,
            i % 256,
            "the result belongs to its frame"
        );
        seen.push(i);
        Ok(())
    };
    let opts = PipelineOptions {
        width: 16,
        queue: 1,
        when_full: WhenFull::DropOldest,
        pace_fps: None,
        smoothing: None,
    };
    let opts = PipelineOptions {
        pace_fps: Some(200.0),
        ..opts
    };
    let r = run_pipeline(&mut src, || Ok(Slow { ms: 20 }), &mut sink, &opts).unwrap();
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "out of order: {seen:?}"
    );
    assert_eq!(r.captured, 60);
    assert!(
        r.dropped > 20,
        "a slow stage behind a fast source drops frames: {} dropped",
        r.dropped
    );
    assert_eq!(
        r.frames.len() as u64 + r.dropped,
        60,
        "every frame is either shown or counted as dropped"
    );
    // At most one frame waits in each queue: latency stays near two diffusion times.
    let p95 = r.latency(95.0);
    assert!(
        p95 < 150.0,
        "p95 latency {p95:.1} ms: frames are queueing up"
    );
    assert!(r.table().contains("dropped"));
}

#[test]
fn blocking_pipeline_keeps_every_frame_and_overlaps_stages() {
    let mut seen = Vec::new();
    let mut sink = |i: u64, _: &RgbImage| -> brume_live::Result<()> {
        std::thread::sleep(Duration::from_millis(10));
        seen.push(i);
        Ok(())
    };
    let opts = PipelineOptions {
        width: 16,
        queue: 2,
        when_full: WhenFull::Block,
        pace_fps: None,
        smoothing: None,
    };
    let r = run_pipeline(
        &mut numbered(20, None),
        || Ok(Slow { ms: 10 }),
        &mut sink,
        &opts,
    )
    .unwrap();
    assert_eq!(seen, (0..20).collect::<Vec<_>>());
    assert_eq!(r.dropped, 0);
    let mut sink2 = |_: u64, _: &RgbImage| -> brume_live::Result<()> {
        std::thread::sleep(Duration::from_millis(10));
        Ok(())
    };
    let s = run_sequential(
        &mut numbered(20, None),
        || Ok(Slow { ms: 10 }),
        &mut sink2,
        &opts,
    )
    .unwrap();
    // Sleeps overlap across threads: the pipeline approaches 2x on two equal stages.
    assert!(
        r.fps() > 1.4 * s.fps(),
        "pipeline {:.1} FPS vs sequential {:.1}",
        r.fps(),
        s.fps()
    );
}

#[test]
fn a_failing_stage_stops_the_pipeline_with_its_error() {
    struct Fails;
    impl Diffuse for Fails {
        fn diffuse(&mut self, _: &RgbImage) -> brume_live::Result<Diffused> {
            Err(LiveError::Invalid("boom".into()))
        }
    }
    let opts = PipelineOptions {
        width: 16,
        queue: 1,
        when_full: WhenFull::Block,
        pace_fps: None,
        smoothing: None,
    };
    let e = run_pipeline(
        &mut numbered(1000, None),
        || Ok(Fails),
        &mut |_, _| Ok(()),
        &opts,
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("boom"));
}

#[test]
fn similarity_skip_skips_a_still_input_and_stops_after_ten() {
    let frame = signed_pixels(&RgbImage::from_fn(32, 32, |x, y| {
        Rgb([(x * 8) as u8, (y * 8) as u8, 90])
    }));
    let mut f = SimilarityFilter::new(0.98, 10, 7);
    assert!(
        !f.should_skip(&frame),
        "the first frame is always processed"
    );
    let decisions: Vec<bool> = (0..23).map(|_| f.should_skip(&frame)).collect();
    // Identical input: skip probability 1, so exactly 10 skips, one refresh, 10 skips, ...
    let expected: Vec<bool> = (0..23).map(|i| i % 11 != 10).collect();
    assert_eq!(decisions, expected);
    // A changed input is processed.
    let other = signed_pixels(&RgbImage::from_fn(32, 32, |x, _| {
        Rgb([255 - (x * 8) as u8, 0, 200])
    }));
    let mut g = SimilarityFilter::new(0.98, 10, 7);
    g.should_skip(&frame);
    assert!(!g.should_skip(&other));
}

#[test]
fn smoothing_and_flicker() {
    let black = RgbImage::new(4, 4);
    let white = RgbImage::from_pixel(4, 4, Rgb([255, 255, 255]));
    assert_eq!(
        flicker(&[black.clone(), white.clone(), black.clone()]),
        255.0
    );
    let mut s = Smoother::new(0.5);
    let seq: Vec<RgbImage> = [&black, &white, &black, &white]
        .iter()
        .map(|i| s.apply(i))
        .collect();
    assert!(
        flicker(&seq) < 255.0 * 0.75,
        "smoothing lowers flicker: {}",
        flicker(&seq)
    );
}

#[test]
fn y4m_round_trip_of_a_generated_file() {
    let frames: Vec<RgbImage> = (0..3)
        .map(|k| {
            RgbImage::from_fn(20, 14, |x, y| {
                Rgb([(x * 12) as u8, (y * 18) as u8, (k * 100) as u8])
            })
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("clip.y4m");
    let mut bytes = Vec::new();
    y4m::write(&mut bytes, &frames, 25).unwrap();
    std::fs::write(&path, &bytes).unwrap();
    let mut src = Y4mSource::open(&path).unwrap();
    assert_eq!(src.header().width, 20);
    assert_eq!(src.header().height, 14);
    assert_eq!(src.fps(), Some(25.0));
    let mut got = Vec::new();
    while let Some(f) = src.next_frame().unwrap() {
        got.push(f);
    }
    assert_eq!(got.len(), 3);
    for (a, b) in frames.iter().zip(&got) {
        // 4:2:0 averages colour over 2x2 blocks: smooth gradients come back close.
        let mad = a
            .as_raw()
            .iter()
            .zip(b.as_raw())
            .map(|(&x, &y)| (x as f64 - y as f64).abs())
            .sum::<f64>()
            / a.as_raw().len() as f64;
        assert!(mad < 6.0, "mean abs difference {mad}");
    }
    // A cut-short file and a wrong magic are errors naming the problem.
    std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    let mut src = Y4mSource::open(&path).unwrap();
    src.next_frame().unwrap();
    src.next_frame().unwrap();
    assert!(src
        .next_frame()
        .unwrap_err()
        .to_string()
        .contains("cut short"));
    std::fs::write(&path, b"RIFF....").unwrap();
    assert!(Y4mSource::open(&path)
        .err()
        .unwrap()
        .to_string()
        .contains("YUV4MPEG2"));
    std::fs::write(&path, b"YUV4MPEG2 W16 F30:1\n").unwrap();
    assert!(Y4mSource::open(&path)
        .err()
        .unwrap()
        .to_string()
        .contains("H (height)"));
    std::fs::write(&path, b"YUV4MPEG2 W16 H16 C420p10\n").unwrap();
    assert!(Y4mSource::open(&path)
        .err()
        .unwrap()
        .to_string()
        .contains("colour space"));
}
