//! The three-stage pipeline (capture / decode -> diffuse -> encode / display), the same
//! work done frame after frame in one thread (to compare), and the per-frame report.
//!
//! Stages run on their own threads, joined by [`DropQueue`]s. The diffuse stage runs
//! on the compute pool (`brume::runtime::on_compute_thread`): a kernel called from
//! outside the pool pays a handoff per op, which at 128 px is most of an op's time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use image::RgbImage;

use crate::error::{LiveError, Result};
use crate::queue::{DropQueue, Pushed, WhenFull};
use crate::source::{fit, FrameSource};
use crate::techniques::Smoother;

/// One frame's result from a [`Diffuse`] stage.
#[derive(Debug, Clone)]
pub struct Diffused {
    pub image: RgbImage,
    pub encode_ms: f64,
    pub unet_ms: f64,
    pub decode_ms: f64,
    /// The frame was not diffused (similarity skip): `image` is the last result again.
    pub skipped: bool,
}

/// The diffusion stage: one frame in, one frame out.
pub trait Diffuse {
    fn diffuse(&mut self, frame: &RgbImage) -> Result<Diffused>;
    /// What it decided along the way (a governor's choices), for the report.
    fn notes(&mut self) -> Vec<String> {
        Vec::new()
    }
}

/// Per-frame timings, in milliseconds.
#[derive(Debug, Clone, Default)]
pub struct FrameTimes {
    pub index: u64,
    /// Reading and decoding the frame, and fitting it to the working size.
    pub capture_ms: f64,
    /// Waiting in the queue before diffusion.
    pub queue_ms: f64,
    pub encode_ms: f64,
    pub unet_ms: f64,
    pub decode_ms: f64,
    /// The whole diffuse stage for this frame (encode + UNet + decode + conversions).
    pub diffuse_ms: f64,
    /// Smoothing, encoding and writing (or showing) the result.
    pub output_ms: f64,
    /// From the frame's capture to its result written: what a viewer waits.
    pub latency_ms: f64,
    pub skipped: bool,
}

/// How the pipeline runs.
#[derive(Debug, Clone)]
pub struct PipelineOptions {
    /// Working width in pixels (frames are fitted to it, aspect kept, multiples of 8).
    pub width: u32,
    /// Frames each queue holds.
    pub queue: usize,
    /// Drop the oldest frame when a queue is full (live), or make the producer wait (every frame).
    pub when_full: WhenFull,
    /// Read frames at this rate, as a camera delivers them; `None`: as fast as the pipeline takes them.
    pub pace_fps: Option<f64>,
    /// Display smoothing weight of the new frame (`None`: off).
    pub smoothing: Option<f32>,
}

/// What a run measured.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub mode: String,
    /// Frames that came out, in order.
    pub frames: Vec<FrameTimes>,
    /// Frames read from the source.
    pub captured: u64,
    /// Frames thrown away by a full queue.
    pub dropped: u64,
    pub wall_s: f64,
    pub notes: Vec<String>,
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The `p`-th percentile (0..=100, nearest rank) of `v`; 0 when empty.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

impl Report {
    /// Results per second over the run.
    pub fn fps(&self) -> f64 {
        if self.wall_s > 0.0 {
            self.frames.len() as f64 / self.wall_s
        } else {
            0.0
        }
    }

    pub fn skipped(&self) -> u64 {
        self.frames.iter().filter(|f| f.skipped).count() as u64
    }

    pub fn latency(&self, p: f64) -> f64 {
        percentile(
            &self.frames.iter().map(|f| f.latency_ms).collect::<Vec<_>>(),
            p,
        )
    }

    /// Median of one timing over the frames that were diffused (skips excluded).
    pub fn median_of(&self, f: impl Fn(&FrameTimes) -> f64) -> f64 {
        percentile(
            &self
                .frames
                .iter()
                .filter(|t| !t.skipped)
                .map(f)
                .collect::<Vec<_>>(),
            50.0,
        )
    }

    /// The timing table: medians per stage, latency percentiles, counters.
    pub fn table(&self) -> String {
        let mut s = String::new();
        s.push_str(&format!(
            "{}: {} frames out of {} read in {:.2} s = {:.1} FPS; dropped {}, skipped {}\n",
            self.mode,
            self.frames.len(),
            self.captured,
            self.wall_s,
            self.fps(),
            self.dropped,
            self.skipped()
        ));
        s.push_str("  median ms: capture  queue  VAE-enc   UNet  VAE-dec  diffuse  output | latency p50    p95    max\n");
        s.push_str(&format!(
            "           {:>8.1} {:>6.1} {:>8.1} {:>6.1} {:>8.1} {:>8.1} {:>7.1} | {:>11.1} {:>6.1} {:>6.1}\n",
            self.median_of(|f| f.capture_ms),
            self.median_of(|f| f.queue_ms),
            self.median_of(|f| f.encode_ms),
            self.median_of(|f| f.unet_ms),
            self.median_of(|f| f.decode_ms),
            self.median_of(|f| f.diffuse_ms),
            self.median_of(|f| f.output_ms),
            self.latency(50.0),
            self.latency(95.0),
            self.latency(100.0),
        ));
        for n in &self.notes {
            s.push_str(&format!("  {n}\n"));
        }
        s
    }
}

struct Captured {
    index: u64,
    image: RgbImage,
    at: Instant,
    capture_ms: f64,
    queued: Instant,
}

struct Done {
    index: u64,
    result: Diffused,
    at: Instant,
    times: FrameTimes,
}

/// Reads the next frame, fitted to the working width.
pub(crate) fn capture(source: &mut dyn FrameSource, width: u32) -> Result<Option<(RgbImage, f64)>> {
    let t = Instant::now();
    let Some(img) = source.next_frame()? else {
        return Ok(None);
    };
    let img = fit(&img, width);
    Ok(Some((img, ms(t.elapsed()))))
}

fn diffuse_one(d: &mut dyn Diffuse, c: Captured) -> Result<Done> {
    let start = Instant::now();
    let result = d.diffuse(&c.image)?;
    let times = FrameTimes {
        index: c.index,
        capture_ms: c.capture_ms,
        queue_ms: ms(start.duration_since(c.queued)),
        encode_ms: result.encode_ms,
        unet_ms: result.unet_ms,
        decode_ms: result.decode_ms,
        diffuse_ms: ms(start.elapsed()),
        skipped: result.skipped,
        ..Default::default()
    };
    Ok(Done {
        index: c.index,
        result,
        at: c.at,
        times,
    })
}

fn output_one(
    done: Done,
    smoother: &mut Option<Smoother>,
    sink: &mut dyn FnMut(u64, &RgbImage) -> Result<()>,
) -> Result<FrameTimes> {
    let t = Instant::now();
    let img = match smoother {
        Some(s) => s.apply(&done.result.image),
        None => done.result.image,
    };
    sink(done.index, &img)?;
    let mut times = done.times;
    times.output_ms = ms(t.elapsed());
    times.latency_ms = ms(done.at.elapsed());
    Ok(times)
}

/// Waits until frame `i` of a paced source is due.
pub(crate) fn pace(start: Instant, fps: Option<f64>, i: u64) {
    if let Some(fps) = fps.filter(|f| *f > 0.0) {
        let due = start + Duration::from_secs_f64(i as f64 / fps);
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
    }
}

/// Runs the three stages on their own threads until the source ends. `make` builds the
/// diffusion stage on its own thread (model segments need not be `Send`); `sink`
/// writes or shows each result, in order.
pub fn run_pipeline<D: Diffuse>(
    source: &mut dyn FrameSource,
    make: impl FnOnce() -> Result<D> + Send,
    sink: &mut (dyn FnMut(u64, &RgbImage) -> Result<()> + Send),
    opts: &PipelineOptions,
) -> Result<Report> {
    let q_in: Arc<DropQueue<Captured>> = Arc::new(DropQueue::new(opts.queue, opts.when_full));
    let q_out: Arc<DropQueue<Done>> = Arc::new(DropQueue::new(opts.queue, opts.when_full));
    let start = Instant::now();
    let (captured, cap_err, diff_res, out_res) = std::thread::scope(|s| {
        let capture_thread = s.spawn(|| {
            let mut n = 0u64;
            let mut err = None;
            loop {
                pace(start, opts.pace_fps, n);
                let at = Instant::now();
                match capture(source, opts.width) {
                    Ok(Some((image, capture_ms))) => {
                        let c = Captured {
                            index: n,
                            image,
                            at,
                            capture_ms,
                            queued: Instant::now(),
                        };
                        n += 1;
                        if let Pushed::Closed(_) = q_in.push(c) {
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        err = Some(e);
                        break;
                    }
                }
            }
            q_in.close();
            (n, err)
        });
        let diffuse_thread = s.spawn(|| {
            let r = brume::runtime::on_compute_thread(|| -> Result<Vec<String>> {
                let mut d = make()?;
                while let Some(c) = q_in.pop() {
                    let done = diffuse_one(&mut d, c)?;
                    if let Pushed::Closed(_) = q_out.push(done) {
                        break;
                    }
                }
                Ok(d.notes())
            });
            // Either way the neighbours must stop: the source stops reading, the output drains.
            q_in.close();
            q_out.close();
            r
        });
        let output_thread = s.spawn(|| {
            let mut smoother = opts.smoothing.map(Smoother::new);
            let mut frames = Vec::new();
            let r = (|| -> Result<()> {
                while let Some(d) = q_out.pop() {
                    frames.push(output_one(d, &mut smoother, sink)?);
                }
                Ok(())
            })();
            q_out.close();
            q_in.close();
            r.map(|_| frames)
        });
        let out_res = output_thread
            .join()
            .map_err(|_| LiveError::Thread("output"))
            .and_then(|r| r);
        let diff_res = diffuse_thread
            .join()
            .map_err(|_| LiveError::Thread("diffuse"))
            .and_then(|r| r);
        let (captured, cap_err) = capture_thread
            .join()
            .unwrap_or((0, Some(LiveError::Thread("capture"))));
        (captured, cap_err, diff_res, out_res)
    });
    let wall_s = start.elapsed().as_secs_f64();
    let notes = diff_res?;
    let frames = out_res?;
    if let Some(e) = cap_err {
        return Err(e);
    }
    Ok(Report {
        mode: format!(
            "pipeline (3 threads, queues of {}, {:?})",
            opts.queue, opts.when_full
        ),
        frames,
        captured,
        dropped: q_in.dropped() + q_out.dropped(),
        wall_s,
        notes,
    })
}

/// The same work frame after frame on one thread (the compute pool's): the baseline
/// the pipeline is measured against. Pacing, when asked for, waits for each frame's
/// due time; a frame that came due while the previous one was diffused is dropped
/// (a single loop reads the camera's newest frame).
pub fn run_sequential<D: Diffuse>(
    source: &mut dyn FrameSource,
    make: impl FnOnce() -> Result<D> + Send,
    sink: &mut (dyn FnMut(u64, &RgbImage) -> Result<()> + Send),
    opts: &PipelineOptions,
) -> Result<Report> {
    brume::runtime::on_compute_thread(|| {
        let mut d = make()?;
        let mut smoother = opts.smoothing.map(Smoother::new);
        let start = Instant::now();
        let (mut frames, mut n, mut dropped) = (Vec::new(), 0u64, 0u64);
        loop {
            if let Some(fps) = opts.pace_fps.filter(|f| *f > 0.0) {
                // Frames that came due while we were busy are gone; take the newest.
                let due_now = (start.elapsed().as_secs_f64() * fps).floor() as u64;
                while n < due_now {
                    if source.next_frame()?.is_none() {
                        break;
                    }
                    n += 1;
                    dropped += 1;
                }
                pace(start, Some(fps), n);
            }
            let at = Instant::now();
            let Some((image, capture_ms)) = capture(source, opts.width)? else {
                break;
            };
            let c = Captured {
                index: n,
                image,
                at,
                capture_ms,
                queued: Instant::now(),
            };
            n += 1;
            let done = diffuse_one(&mut d, c)?;
            frames.push(output_one(done, &mut smoother, sink)?);
        }
        Ok(Report {
            mode: "sequential (1 thread)".into(),
            frames,
            captured: n,
            dropped,
            wall_s: start.elapsed().as_secs_f64(),
            notes: d.notes(),
        })
    })
}
