//! The pipeline with diffusion itself split across the stages: capture + VAE encode,
//! UNet, VAE decode + output, each on its own thread with its own one-thread compute
//! pool. At 128 px a kernel's work is too small to gain from two cores (the same
//! frame takes about as long on one thread as on two), so the three segments are
//! better run side by side, one core each, than one after another on both.

use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use image::RgbImage;

use crate::diffuser::{DecodeStage, DenoiseStage, EncodeStage, Encoded};
use crate::error::{LiveError, Result};
use crate::pipeline::{capture, ms, pace, FrameTimes, PipelineOptions, Report};
use crate::queue::{DropQueue, Pushed};
use crate::techniques::Smoother;

struct Encoding {
    index: u64,
    at: Instant,
    width: u32,
    height: u32,
    z: Option<Tensor>,
    times: FrameTimes,
    queued: Instant,
}

/// A one-thread compute pool for a stage (the kernels' parallel loops run inline in it).
fn stage_pool(name: &'static str, threads: usize) -> Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(move |i| format!("brume-live-{name}-{i}"))
        .build()
        .map_err(|e| LiveError::Invalid(format!("cannot start the {name} stage's thread: {e}")))
}

/// Runs the split pipeline until the source ends. Each `make_*` builds its stage on
/// the thread that runs it; `threads` is each stage's compute threads (1 on 2 cores).
pub fn run_split(
    source: &mut dyn crate::source::FrameSource,
    make_encode: impl FnOnce() -> Result<EncodeStage> + Send,
    make_denoise: impl FnOnce() -> Result<DenoiseStage> + Send,
    make_decode: impl FnOnce() -> Result<DecodeStage> + Send,
    sink: &mut (dyn FnMut(u64, &RgbImage) -> Result<()> + Send),
    opts: &PipelineOptions,
    threads: usize,
) -> Result<Report> {
    let q1: Arc<DropQueue<Encoding>> = Arc::new(DropQueue::new(opts.queue, opts.when_full));
    let q2: Arc<DropQueue<Encoding>> = Arc::new(DropQueue::new(opts.queue, opts.when_full));
    let pools = [
        stage_pool("encode", threads)?,
        stage_pool("unet", threads)?,
        stage_pool("decode", threads)?,
    ];
    let start = Instant::now();
    let (r1, r2, r3) = std::thread::scope(|s| {
        let t1 = s.spawn(|| {
            let r = pools[0].install(|| -> Result<u64> {
                let mut enc = make_encode()?;
                let mut n = 0u64;
                loop {
                    pace(start, opts.pace_fps, n);
                    let at = Instant::now();
                    let Some((image, capture_ms)) = capture(source, opts.width)? else {
                        break;
                    };
                    let (z, encode_ms, skipped) = match enc.run(&image)? {
                        Encoded::Latents { z, ms } => (Some(z), ms, false),
                        Encoded::Skip => (None, 0.0, true),
                    };
                    let times = FrameTimes {
                        index: n,
                        capture_ms,
                        encode_ms,
                        skipped,
                        ..Default::default()
                    };
                    let e = Encoding {
                        index: n,
                        at,
                        width: image.width(),
                        height: image.height(),
                        z,
                        times,
                        queued: Instant::now(),
                    };
                    n += 1;
                    if let Pushed::Closed(_) = q1.push(e) {
                        break;
                    }
                }
                Ok(n)
            });
            q1.close();
            r
        });
        let t2 = s.spawn(|| {
            let r = pools[1].install(|| -> Result<()> {
                let mut den = make_denoise()?;
                while let Some(mut e) = q1.pop() {
                    let t = Instant::now();
                    e.times.queue_ms = ms(t.duration_since(e.queued));
                    if let Some(z) = e.z.take() {
                        let (latents, unet_ms) = den.run(z)?;
                        e.z = Some(latents);
                        e.times.unet_ms = unet_ms;
                    }
                    e.queued = Instant::now();
                    if let Pushed::Closed(_) = q2.push(e) {
                        break;
                    }
                }
                Ok(())
            });
            q1.close();
            q2.close();
            r
        });
        let t3 = s.spawn(|| {
            let mut frames = Vec::new();
            let r = pools[2].install(|| -> Result<()> {
                let mut dec = make_decode()?;
                let mut smoother = opts.smoothing.map(Smoother::new);
                while let Some(e) = q2.pop() {
                    let t = Instant::now();
                    let mut times = e.times;
                    times.queue_ms += ms(t.duration_since(e.queued));
                    let image = match &e.z {
                        Some(latents) => {
                            let (img, decode_ms) = dec.run(latents, e.width, e.height)?;
                            times.decode_ms = decode_ms;
                            img
                        }
                        None => match dec.last() {
                            Some(last) => last.clone(),
                            None => continue, // a skip before any result: nothing to show
                        },
                    };
                    times.diffuse_ms = times.encode_ms + times.unet_ms + times.decode_ms;
                    let o = Instant::now();
                    let shown = match &mut smoother {
                        Some(s) => s.apply(&image),
                        None => image,
                    };
                    sink(e.index, &shown)?;
                    times.output_ms = ms(o.elapsed());
                    times.latency_ms = ms(e.at.elapsed());
                    frames.push(times);
                }
                Ok(())
            });
            q2.close();
            q1.close();
            r.map(|_| frames)
        });
        let r3 = t3
            .join()
            .map_err(|_| LiveError::Thread("decode/output"))
            .and_then(|r| r);
        let r2 = t2
            .join()
            .map_err(|_| LiveError::Thread("UNet"))
            .and_then(|r| r);
        let r1 = t1
            .join()
            .map_err(|_| LiveError::Thread("capture/encode"))
            .and_then(|r| r);
        (r1, r2, r3)
    });
    let wall_s = start.elapsed().as_secs_f64();
    r2?;
    let frames = r3?;
    let captured = r1?;
    Ok(Report {
        mode: format!("split pipeline (capture+VAE-enc | UNet | VAE-dec+output, {threads} compute thread(s) each, queues of {}, {:?})", opts.queue, opts.when_full),
        frames,
        captured,
        dropped: q1.dropped() + q2.dropped(),
        wall_s,
        notes: Vec::new(),
    })
}
