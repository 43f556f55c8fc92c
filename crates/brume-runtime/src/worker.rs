//! The worker: takes the next job, runs it on the compute pool with the
//! model kept warm and the conditioning cache, reports progress, and stops at a
//! step boundary when asked (cancel, a newer job in the latest-wins lane, the
//! time limit, or an interactive job preempting a batch one).

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use brume::loading::Segment;
use brume::memory::{ReducedOutput, RunSize};
use brume::pipelines::image_io::{prepare_image, prepare_mask, rgb_to_tensor, to_rgb8};
use brume::pipelines::preview::latent_preview;
use brume::pipelines::recipe::{encode_png, Mode, Recipe};
use brume::pipelines::{img2img, inpaint, outpaint_canvas, txt2img, ConditioningCache, Flow, GenerationRequest, PasteBack, Progress};
use brume::samplers::noise_source;
use brume::RunError;
use candle_core::Tensor;

use crate::error::{JobError, JobErrorKind};
use crate::event::{CancelReason, EventKind, GeneratedImage, JobOutput, JobState, Timings};
use crate::job::{Edit, JobId, JobSpec, Priority};
use crate::plan::{MemoryPolicy, PlanJob};
use crate::registry::ModelEntry;
use crate::warm::Warm;
use crate::{Control, ResultSink, RuntimeConfig, Shared, StoreContext};

/// How a run ended short of a result.
enum Stop {
    Preempted,
    Cancelled(CancelReason),
    Failed(JobError),
}

impl From<RunError> for Stop {
    fn from(e: RunError) -> Self {
        Stop::Failed(JobError::from_run(e))
    }
}

impl From<candle_core::Error> for Stop {
    fn from(e: candle_core::Error) -> Self {
        Stop::Failed(JobError::from_run(RunError::Candle(e)))
    }
}

pub(crate) struct Worker {
    shared: Arc<Shared>,
    entries: Vec<ModelEntry>,
    memory: MemoryPolicy,
    max_job_time: Option<Duration>,
    sink: Option<Arc<dyn ResultSink>>,
    cache_capacity: usize,
    warm_limit: usize,
}

/// What the worker took from the queue.
struct Taken {
    id: JobId,
    spec: Arc<JobSpec>,
    control: Arc<Control>,
    queued_ms: f64,
    preemptions: u32,
}

impl Worker {
    pub(crate) fn new(shared: Arc<Shared>, config: &RuntimeConfig) -> Self {
        Self {
            shared,
            entries: config.models.clone(),
            memory: config.memory.clone(),
            max_job_time: config.max_job_time,
            sink: config.sink.clone(),
            cache_capacity: config.conditioning_cache,
            warm_limit: config.warm_models,
        }
    }

    /// Runs jobs until the runtime stops. The worker waits for work on its own
    /// thread and runs each job on a thread of the compute pool: a kernel called
    /// from outside the pool would hand every op to it and sleep (see
    /// `brume::runtime::on_compute_thread`), and a worker that waited inside the
    /// pool would keep one of its threads idle between jobs.
    pub(crate) fn run(self) {
        let mut local = Local { warm: Warm::new(self.warm_limit), cache: ConditioningCache::new(self.cache_capacity) };
        while let Some(job) = self.next_job() {
            let started = Instant::now();
            let outcome = brume::runtime::on_compute_thread(|| {
                let local = &mut local;
                std::panic::catch_unwind(AssertUnwindSafe(|| self.execute(&job, &mut local.warm, &mut local.cache, started)))
            });
            let outcome = outcome.unwrap_or_else(|panic| {
                // A bug, not the user's input: keep serving, with nothing half-built kept.
                local.warm.clear();
                local.cache = ConditioningCache::new(self.cache_capacity);
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                tracing::error!(job = %job.id, "the engine panicked: {what}");
                Err(Stop::Failed(JobError::new(JobErrorKind::Engine, None, format!("internal error in the engine: {what}"))))
            });
            self.conclude(&job, outcome, started.elapsed());
        }
        tracing::debug!(warm = local.warm.len(), "runtime worker stopped");
    }

    /// Blocks for the next job; `None` once the runtime stops.
    fn next_job(&self) -> Option<Taken> {
        let mut st = self.shared.lock();
        loop {
            if st.stopping {
                return None;
            }
            if let Some(id) = st.queue.pop() {
                let Some(r) = st.jobs.get_mut(&id) else { continue };
                r.state = JobState::Running { step: 0, total: 0, eta_ms: None };
                let taken = Taken {
                    id,
                    spec: r.spec.clone(),
                    control: r.control.clone(),
                    queued_ms: r.submitted.elapsed().as_secs_f64() * 1e3,
                    preemptions: r.preemptions,
                };
                // A preemption asked for during an earlier run no longer applies.
                r.control.take();
                st.running = Some(id);
                self.shared.emit(&st, id, EventKind::Started);
                self.shared.emit_positions(&mut st);
                return Some(taken);
            }
            st = self.shared.work.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn conclude(&self, job: &Taken, outcome: Result<JobOutput, Stop>, took: Duration) {
        let mut st = self.shared.lock();
        st.running = None;
        match outcome {
            Ok(output) => {
                let secs = took.as_secs_f64();
                st.job_secs = Some(st.job_secs.map_or(secs, |s| 0.8 * s + 0.2 * secs));
                let output = Arc::new(output);
                self.shared.finish(&mut st, job.id, JobState::Done, EventKind::Done { output });
            }
            Err(Stop::Preempted) if !st.stopping => {
                if let Some(r) = st.jobs.get_mut(&job.id) {
                    r.preemptions += 1;
                    r.preview = None;
                    r.state = JobState::Queued { position: usize::MAX };
                }
                st.queue.push_front(job.id, Priority::Batch);
                self.shared.emit(&st, job.id, EventKind::Preempted);
                self.shared.emit_positions(&mut st);
                self.shared.changed.notify_all();
            }
            Err(Stop::Preempted) => {
                let r = CancelReason::Shutdown;
                self.shared.finish(&mut st, job.id, JobState::Cancelled(r), EventKind::Cancelled { reason: r });
            }
            Err(Stop::Cancelled(r)) => {
                self.shared.finish(&mut st, job.id, JobState::Cancelled(r), EventKind::Cancelled { reason: r });
            }
            Err(Stop::Failed(error)) => {
                tracing::info!(job = %job.id, "job failed: {}", error.message);
                self.shared.finish(&mut st, job.id, JobState::Failed(error.clone()), EventKind::Failed { error });
            }
        }
    }

    /// Why the job must stop now, if it must.
    fn stop_reason(&self, job: &Taken) -> Option<Stop> {
        if !job.control.stop_requested() {
            return None;
        }
        let code = job.control.take();
        Some(match crate::reason_of(code) {
            Some(r) => Stop::Cancelled(r),
            None => Stop::Preempted,
        })
    }

    fn emit(&self, job: JobId, kind: EventKind) {
        let st = self.shared.lock();
        self.shared.emit(&st, job, kind);
    }

    fn execute(&self, job: &Taken, warm: &mut Warm, cache: &mut ConditioningCache, started: Instant) -> Result<JobOutput, Stop> {
        let spec = &*job.spec;
        let model_name = spec.model.clone().unwrap_or_else(|| self.shared.default_model.clone());
        let Some(entry) = self.entries.iter().find(|e| e.name == model_name) else {
            return Err(Stop::Failed(JobError::new(JobErrorKind::Invalid, Some("model"), format!("no model named `{model_name}`"))));
        };
        let unet_folder = spec.unet.clone().unwrap_or_else(|| "unet".into());
        let model = warm
            .get(entry, &unet_folder)
            .map_err(|e| Stop::Failed(JobError::new(JobErrorKind::Model, Some("model"), format!("model `{model_name}`: {e}"))))?;
        let kind = model.sampler_kind(spec.sampler)?;
        let settings = model.sampling_settings(kind, spec.steps, spec.guidance)?;
        let factor = model.vae_config.scale_factor() as u32;
        let seed = spec.seed.unwrap_or(0);
        let mode = spec.edit.mode();

        // The picture to work on (edits), its mask, and the strength.
        let input = |img: &crate::job::InputImage| prepare_image((*img.image).clone(), factor);
        let (work_image, mask, strength, feather) = match &spec.edit {
            Edit::None => (None, None, None, None),
            Edit::Img2img { image, strength } => (Some(input(image)?.tensor), None, Some(model.sampling.img2img_strength(*strength)), None),
            Edit::Inpaint { image, mask, strength, feather } => {
                let loaded = input(image)?;
                let m = prepare_mask((*mask.image).clone(), "mask", &loaded)?;
                (Some(loaded.tensor), Some(m), Some(strength.unwrap_or(1.0)), Some(*feather))
            }
            Edit::Outpaint { image, extend, feather } => {
                let loaded = input(image)?;
                let (canvas, m) = outpaint_canvas(&loaded.tensor, *extend, 8, factor as usize)?;
                (Some(canvas), Some(m), Some(1.0), Some(*feather))
            }
        };
        let (width, height) = match &work_image {
            Some(t) => {
                let (_, _, h, w) = t.dims4()?;
                (w, h)
            }
            None => {
                let size = model.default_size();
                (spec.width.unwrap_or(size), spec.height.unwrap_or(size))
            }
        };
        let req = GenerationRequest {
            prompt: spec.prompt.clone(),
            negative_prompt: spec.negative_prompt.clone(),
            steps: settings.steps,
            guidance_scale: settings.guidance_scale,
            width,
            height,
            seed,
            rng: spec.rng,
            eta: spec.eta,
            clip_skip: spec.clip_skip,
            sampler: Some(kind),
            batch: spec.batch,
        };
        req.validate(&model).map_err(|e| Stop::Failed(JobError::from_run(e)))?;
        let notices = notices(&model, spec);
        for message in &notices {
            self.emit(job.id, EventKind::Notice { message: message.clone() });
        }
        let plan_job = if work_image.is_some() { PlanJob::Edit } else { PlanJob::Generate };
        let planned = self.memory.plan(&model, &req, plan_job)?;
        self.emit(job.id, EventKind::Planned { summary: planned.plan.summary() });
        let run_model = planned.variant.as_ref().unwrap_or(&model);
        let (run_w, run_h) = if work_image.is_some() { (width, height) } else { planned.run_size(&req) };
        let run_req = GenerationRequest { width: run_w, height: run_h, ..req.clone() };

        let mut noise = noise_source(req.rng, req.seed);
        let cache_hits = cache.stats().0;
        let mut marks: Vec<(Mark, Instant)> = vec![(Mark::Start, Instant::now())];
        let mut step_times: Vec<f64> = Vec::new();
        let mut last = Instant::now();
        let mut last_preview: Option<Instant> = None;
        let limit = self.max_job_time;
        let run_start = Instant::now();
        let mut progress = |p: &Progress| -> Flow {
            match p {
                Progress::Loaded(seg) => {
                    marks.push((Mark::Loaded(*seg), Instant::now()));
                    self.emit(job.id, EventKind::Loaded { segment: seg.to_string() });
                    last = Instant::now();
                }
                Progress::Step { index, total, latents } => {
                    marks.push((Mark::Step, Instant::now()));
                    step_times.push(last.elapsed().as_secs_f64());
                    last = Instant::now();
                    let mut sorted = step_times.clone();
                    sorted.sort_by(f64::total_cmp);
                    let median = sorted[sorted.len() / 2];
                    let eta_ms = Some((median * total.saturating_sub(*index) as f64 * 1e3) as u64);
                    let preview = self.preview(spec, *index, *total, latents, &mut last_preview);
                    let mut st = self.shared.lock();
                    if let Some(r) = st.jobs.get_mut(&job.id) {
                        r.state = JobState::Running { step: *index, total: *total, eta_ms };
                        if let Some(png) = &preview {
                            r.preview = Some(png.clone());
                        }
                    }
                    self.shared.emit(&st, job.id, EventKind::Step { step: *index, total: *total, eta_ms });
                    if let Some(png) = preview {
                        self.shared.emit(&st, job.id, EventKind::Preview { step: *index, png });
                    }
                }
            }
            if limit.is_some_and(|l| run_start.elapsed() > l) {
                job.control.request(crate::STOP_TIMEOUT);
            }
            if job.control.stop_requested() {
                Flow::Cancel
            } else {
                Flow::Continue
            }
        };
        let out = match (&work_image, &mask) {
            (None, _) => txt2img(run_model, &run_req, &planned.opts, noise.as_mut(), Some(&mut *cache), &mut progress),
            (Some(img), None) => {
                img2img(run_model, &run_req, img, strength.unwrap_or(1.0), &planned.opts, noise.as_mut(), Some(&mut *cache), &mut progress)
            }
            (Some(img), Some(m)) => inpaint(
                run_model,
                &run_req,
                img,
                m,
                strength.unwrap_or(1.0),
                Some(PasteBack { feather: feather.unwrap_or(0) }),
                &planned.opts,
                noise.as_mut(),
                Some(&mut *cache),
                &mut progress,
            ),
        };
        let out = match out {
            Ok(o) => o,
            Err(RunError::Cancelled) => return Err(self.stop_reason(job).unwrap_or(Stop::Cancelled(CancelReason::User))),
            Err(e) => return Err(e.into()),
        };
        // A stop asked for during the last step comes too late to matter: the result stands.
        let images = match planned.plan.size {
            RunSize::Reduced { output: ReducedOutput::Upscaled, .. } if work_image.is_none() => resize(&out.image, (width, height))?,
            _ => out.image,
        };
        let mut recipe = Recipe::new(mode, &req, kind, &model);
        recipe.memory_plan = Some(planned.recipe_line());
        if let Some(s) = strength {
            recipe.strength = Some(s);
        }
        match &spec.edit {
            Edit::None => {}
            Edit::Img2img { image, .. } => recipe.image = image.source.clone(),
            Edit::Inpaint { image, mask, .. } => {
                recipe.image = image.source.clone();
                recipe.mask = mask.source.clone();
            }
            Edit::Outpaint { image, extend, .. } => {
                recipe.image = image.source.clone();
                recipe.extend = Some(*extend);
            }
        }
        recipe.feather = (mode != Mode::Img2img && mode != Mode::Txt2img).then(|| feather.unwrap_or(0));
        let mut generated = Vec::new();
        for i in 0..images.dim(0)? {
            let rgb = to_rgb8(&images.get(i)?.unsqueeze(0)?)?;
            let png = encode_png(&rgb, Some(&recipe))?;
            generated.push(GeneratedImage {
                png: Arc::new(png),
                width: rgb.width(),
                height: rgb.height(),
                index: i,
                recipe: recipe.clone(),
                stored_as: None,
            });
        }
        let end = Instant::now();
        let timings = timings(&marks, end, cache.stats().0 > cache_hits, job, step_times.len(), started);
        let hash = recipe.model_hash.clone();
        if let Some(sink) = &self.sink {
            let ctx = StoreContext { job: job.id, spec, model: &model_name, model_hash: &hash, unet: &unet_folder, timings: &timings };
            let ids = sink
                .store(&ctx, &generated)
                .map_err(|e| Stop::Failed(JobError::new(JobErrorKind::Storage, None, format!("the result could not be stored: {e}"))))?;
            for (g, id) in generated.iter_mut().zip(ids) {
                g.stored_as = Some(id);
            }
        }
        Ok(JobOutput { images: generated, timings, model: model_name, unet: unet_folder, seed, memory_plan: planned.recipe_line(), notices })
    }

    /// A step preview when the job's policy asks for one now: the first image's
    /// latents mapped to RGB (no VAE run), as a PNG.
    fn preview(&self, spec: &JobSpec, index: usize, total: usize, latents: &Tensor, last: &mut Option<Instant>) -> Option<Arc<Vec<u8>>> {
        let p = spec.previews;
        if p.every == 0 || index % p.every != 0 || index >= total {
            return None;
        }
        if last.is_some_and(|t| t.elapsed() < p.min_interval) {
            return None;
        }
        *last = Some(Instant::now());
        let (_, _, h, _) = latents.dims4().ok()?;
        // The picture's own size (8 pixels a latent) up to 512 on a side: big
        // enough to judge, cheap enough to encode every step.
        let scale = (512 / h.max(1)).clamp(1, 8) as u32;
        match latent_preview(latents, scale).and_then(|img| encode_png(&img, None)) {
            Ok(png) => Some(Arc::new(png)),
            Err(e) => {
                tracing::debug!("no preview: {e}");
                None
            }
        }
    }
}

/// The worker's models and prompt encodings. They hold `Rc`s (the engine's
/// models are single-threaded objects) and move between the worker's thread
/// and the compute pool's: one job at a time, the worker blocked in
/// `on_compute_thread` while the pool thread uses them, so no two threads ever
/// touch them at once and no `Rc` from them outlives the job's call (a
/// [`JobOutput`] holds only owned data and `Arc`s).
struct Local {
    warm: Warm,
    cache: ConditioningCache,
}

// SAFETY: see `Local`: access is handed over whole, never shared.
unsafe impl Send for Local {}

/// What the user should know about how the prompts were read.
fn notices(model: &brume::pipelines::SdModel, spec: &JobSpec) -> Vec<String> {
    let max = model.tokenizer.max_length();
    let mut out = Vec::new();
    for (what, text) in [("prompt", Some(&spec.prompt)), ("negative prompt", spec.negative_prompt.as_ref())] {
        if let Some(cut) = text.and_then(|t| brume::pipelines::conditioning::truncated_words(&model.tokenizer, t)) {
            out.push(format!(
                "the {what} is longer than the text encoder's {max} tokens; this end of it was cut and has no effect: \"{}\"",
                brume::output::escape_control(&cut)
            ));
        }
    }
    out
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mark {
    Start,
    Loaded(Segment),
    Step,
}

/// Splits the run's time by phase from the progress marks: a segment's phase
/// runs from the mark before its load to the mark after it (load and use), the
/// denoising from the mark before the UNet's load to the last step, decoding
/// from the last step to the end.
fn timings(marks: &[(Mark, Instant)], end: Instant, cached: bool, job: &Taken, steps: usize, started: Instant) -> Timings {
    let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
    let span = |seg: Segment| -> f64 {
        let Some(i) = marks.iter().position(|(m, _)| *m == Mark::Loaded(seg)) else { return 0.0 };
        let from = marks[i.saturating_sub(1)].1;
        let to = marks.get(i + 1).map(|m| m.1).unwrap_or(end);
        ms(from, to)
    };
    let last_step = marks.iter().rev().find(|(m, _)| *m == Mark::Step).map(|m| m.1);
    let unet_from = marks.iter().position(|(m, _)| *m == Mark::Loaded(Segment::Unet)).map(|i| marks[i.saturating_sub(1)].1);
    let denoise_ms = match (unet_from, last_step) {
        (Some(a), Some(b)) => ms(a, b),
        _ => 0.0,
    };
    Timings {
        queued_ms: job.queued_ms,
        text_encoder_ms: if cached { 0.0 } else { span(Segment::TextEncoder) },
        text_encoder_cached: cached,
        encode_ms: span(Segment::VaeEncoder),
        denoise_ms,
        decode_ms: last_step.map(|t| ms(t, end)).unwrap_or(0.0),
        total_ms: ms(started, end),
        steps,
        preemptions: job.preemptions,
    }
}

/// Resizes images [B, 3, h, w] in [0, 1] to `(width, height)` (Lanczos), for a
/// run the memory plan made smaller than asked.
fn resize(images: &Tensor, (width, height): (usize, usize)) -> Result<Tensor, Stop> {
    let mut out = Vec::new();
    for i in 0..images.dim(0)? {
        let rgb = to_rgb8(&images.get(i)?.unsqueeze(0)?)?;
        let big = image::imageops::resize(&rgb, width as u32, height as u32, image::imageops::FilterType::Lanczos3);
        out.push(((rgb_to_tensor(&big)? + 1.0)? / 2.0)?);
    }
    Ok(Tensor::cat(&out, 0)?)
}
