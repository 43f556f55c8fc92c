//! The runtime end to end on the built-in model (its folder in the repository):
//! results, the conditioning cache, validation, cancellation, the latest-wins
//! lane, the queue bound and preemption.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use brume_runtime::*;

fn builtin() -> ModelEntry {
    let path = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/builtin"));
    ModelEntry { name: "builtin".into(), source: ModelSource::Path { path, config_dir: None, variant: None } }
}

fn start(queue_limit: usize) -> Runtime {
    let mut cfg = RuntimeConfig::new(vec![builtin()]);
    cfg.queue_limit = queue_limit;
    Runtime::start(cfg).expect("the built-in model opens")
}

fn quick(prompt: &str) -> JobSpec {
    JobSpec { steps: Some(2), seed: Some(7), previews: PreviewPolicy::OFF, ..JobSpec::txt2img(prompt) }
}

/// A job long enough to be caught running (150 DDIM steps at 128 px).
fn long(prompt: &str) -> JobSpec {
    JobSpec { steps: Some(150), seed: Some(3), ..JobSpec::txt2img(prompt) }
}

fn output(s: &JobStatus) -> Arc<JobOutput> {
    match (&s.state, &s.output) {
        (JobState::Done, Some(o)) => o.clone(),
        other => panic!("job {} did not finish with a result: {:?}", s.id, other.0),
    }
}

/// Blocks until `id` has run at least one step.
fn wait_running(rt: &Runtime, id: JobId) {
    for _ in 0..2000 {
        if let Some(JobStatus { state: JobState::Running { step, .. }, .. }) = rt.status(id) {
            if step >= 1 {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("job {id} never ran a step");
}

#[test]
fn a_job_gives_pngs_with_recipes_and_a_repeated_prompt_skips_the_text_encoder() {
    let rt = start(8);
    let a = rt.submit(JobSpec { batch: 2, ..quick("a red circle on a blue background") }).unwrap();
    let out = output(&rt.wait(a).unwrap());
    assert_eq!(out.images.len(), 2);
    for img in &out.images {
        let decoded = image::load_from_memory(&img.png).expect("a PNG");
        assert_eq!((decoded.width(), decoded.height()), (128, 128));
        assert_eq!(img.recipe.prompt, "a red circle on a blue background");
        assert_eq!(img.recipe.seed, 7);
    }
    assert!(!out.timings.text_encoder_cached);
    assert!(out.timings.text_encoder_ms > 0.0 && out.timings.denoise_ms > 0.0 && out.timings.total_ms > 0.0);
    let b = rt.submit(JobSpec { batch: 2, seed: Some(8), ..quick("a red circle on a blue background") }).unwrap();
    let again = output(&rt.wait(b).unwrap());
    assert!(again.timings.text_encoder_cached, "the same prompt must come from the conditioning cache");
    assert_eq!(again.timings.text_encoder_ms, 0.0);
}

#[test]
fn the_runtime_gives_the_same_pixels_as_the_pipeline_called_directly() {
    let rt = start(8);
    let spec = JobSpec { steps: Some(3), seed: Some(11), ..quick("a small green square on a yellow background") };
    let out = output(&rt.wait(rt.submit(spec).unwrap()).unwrap());
    let got = image::load_from_memory(&out.images[0].png).unwrap().to_rgb8();

    let model = builtin().open(None).unwrap();
    let kind = model.sampler_kind(None).unwrap();
    let s = model.sampling_settings(kind, Some(3), None).unwrap();
    let mut req = brume::pipelines::GenerationRequest::new("a small green square on a yellow background", 128);
    req.steps = s.steps;
    req.guidance_scale = s.guidance_scale;
    req.seed = 11;
    req.sampler = Some(kind);
    let mut noise = brume::samplers::noise_source(req.rng, req.seed);
    let direct =
        brume::pipelines::txt2img(&model, &req, &Default::default(), noise.as_mut(), None, &mut |_| brume::pipelines::Flow::Continue).unwrap();
    let want = brume::pipelines::image_io::to_rgb8(&direct.image).unwrap();
    assert!(got == want, "one code path: the runtime's picture differs from the pipeline's");
}

#[test]
fn bad_settings_are_refused_at_once_naming_the_field() {
    let rt = start(8);
    let field = |spec: JobSpec| rt.submit(spec).unwrap_err().field();
    assert_eq!(field(JobSpec { steps: Some(0), ..quick("x") }), Some("steps"));
    assert_eq!(field(JobSpec { steps: Some(100_000), ..quick("x") }), Some("steps"));
    assert_eq!(field(JobSpec { width: Some(100), ..quick("x") }), Some("width"));
    assert_eq!(field(JobSpec { height: Some(8192), ..quick("x") }), Some("height"));
    assert_eq!(field(JobSpec { guidance: Some(f64::NAN), ..quick("x") }), Some("guidance"));
    assert_eq!(field(JobSpec { guidance: Some(1e9), ..quick("x") }), Some("guidance"));
    assert_eq!(field(JobSpec { eta: -1.0, ..quick("x") }), Some("eta"));
    assert_eq!(field(JobSpec { batch: 0, ..quick("x") }), Some("batch"));
    assert_eq!(field(JobSpec { clip_skip: 999, ..quick("x") }), Some("clip_skip"));
    assert_eq!(field(JobSpec { model: Some("nope".into()), ..quick("x") }), Some("model"));
    assert_eq!(field(JobSpec { unet: Some("unet_nope".into()), ..quick("x") }), Some("unet"));
    let img = |w, h| InputImage { image: Arc::new(image::DynamicImage::new_rgb8(w, h)), source: None };
    let inpaint = Edit::Inpaint { image: img(128, 128), mask: img(64, 64), strength: None, feather: 4 };
    assert_eq!(field(JobSpec { edit: inpaint, ..quick("x") }), Some("mask"));
    let strength = Edit::Img2img { image: img(128, 128), strength: Some(1.5) };
    assert_eq!(field(JobSpec { edit: strength, ..quick("x") }), Some("strength"));
    let outpaint = Edit::Outpaint { image: img(128, 128), extend: [0, 0, 9000, 0], feather: 4 };
    assert_eq!(field(JobSpec { edit: outpaint, ..quick("x") }), Some("extend"));
    // Still serving after all that.
    assert!(matches!(rt.wait(rt.submit(quick("x")).unwrap()).unwrap().state, JobState::Done));
}

#[test]
fn cancel_stops_a_running_job_at_its_next_step() {
    let rt = start(8);
    let id = rt.submit(long("a blue circle")).unwrap();
    wait_running(&rt, id);
    assert!(rt.cancel(id));
    let s = rt.wait(id).unwrap();
    assert_eq!(s.state, JobState::Cancelled(CancelReason::User));
    assert!(!rt.cancel(id), "a finished job cannot be cancelled again");
}

#[test]
fn a_newer_latest_lane_job_supersedes_the_clients_queued_and_running_ones() {
    let rt = start(8);
    let live = |prompt: &str, steps| JobSpec {
        client: Some("editor".into()),
        lane: Lane::Latest,
        priority: Priority::Interactive,
        steps: Some(steps),
        ..quick(prompt)
    };
    let other = rt.submit(JobSpec { client: Some("someone else".into()), ..quick("a yellow star") }).unwrap();
    let first = rt.submit(live("a red circle", 150)).unwrap();
    wait_running(&rt, first);
    let second = rt.submit(live("a red square", 150)).unwrap();
    let third = rt.submit(live("a red triangle", 2)).unwrap();
    assert_eq!(rt.wait(first).unwrap().state, JobState::Cancelled(CancelReason::Superseded));
    assert_eq!(rt.wait(second).unwrap().state, JobState::Cancelled(CancelReason::Superseded));
    let out = output(&rt.wait(third).unwrap());
    assert_eq!(out.images[0].recipe.prompt, "a red triangle");
    // Another client's job is untouched.
    assert_eq!(rt.wait(other).unwrap().state, JobState::Done);
}

#[test]
fn past_the_queue_limit_a_submission_is_refused_with_a_retry_delay() {
    let rt = start(2);
    let running = rt.submit(long("a circle")).unwrap();
    wait_running(&rt, running);
    let a = rt.submit(quick("a")).unwrap();
    let b = rt.submit(quick("b")).unwrap();
    match rt.submit(quick("c")) {
        Err(SubmitError::QueueFull { limit: 2, retry_after }) => assert!(retry_after >= Duration::from_secs(1)),
        other => panic!("expected QueueFull, got {other:?}"),
    }
    assert_eq!(rt.queue().queued, 2);
    for id in [running, a, b] {
        rt.cancel(id);
    }
}

#[test]
fn an_interactive_job_preempts_a_batch_job_which_then_gives_the_same_picture() {
    let rt = start(8);
    let batch = JobSpec { steps: Some(60), seed: Some(5), previews: PreviewPolicy::OFF, ..JobSpec::txt2img("a green triangle") };
    let reference = output(&rt.wait(rt.submit(batch.clone()).unwrap()).unwrap());
    let id = rt.submit(batch).unwrap();
    wait_running(&rt, id);
    let urgent = rt.submit(JobSpec { priority: Priority::Interactive, ..quick("a red circle") }).unwrap();
    let u = rt.wait(urgent).unwrap();
    assert_eq!(u.state, JobState::Done);
    let s = rt.wait(id).unwrap();
    let out = output(&s);
    assert!(out.timings.preemptions >= 1, "the batch job was not preempted");
    assert!(out.images[0].png == reference.images[0].png, "the restarted job must give the same picture");
}

#[test]
fn inpainting_leaves_the_picture_outside_the_mask_as_it_was() {
    let rt = start(8);
    let mut src = image::RgbImage::from_pixel(128, 128, image::Rgb([20, 40, 200]));
    for (x, y, p) in src.enumerate_pixels_mut() {
        if (x as i32 - 64).pow(2) + (y as i32 - 64).pow(2) < 900 {
            *p = image::Rgb([220, 30, 30]);
        }
    }
    let mut mask = image::GrayImage::new(128, 128);
    for y in 32..96 {
        for x in 32..96 {
            mask.put_pixel(x, y, image::Luma([255]));
        }
    }
    let edit = Edit::Inpaint {
        image: InputImage { image: Arc::new(image::DynamicImage::ImageRgb8(src.clone())), source: None },
        mask: InputImage { image: Arc::new(image::DynamicImage::ImageLuma8(mask)), source: None },
        strength: None,
        feather: 4,
    };
    let out = output(&rt.wait(rt.submit(JobSpec { edit, ..quick("a yellow square on a blue background") }).unwrap()).unwrap());
    let got = image::load_from_memory(&out.images[0].png).unwrap().to_rgb8();
    for (x, y, p) in got.enumerate_pixels() {
        if !(28..100).contains(&x) || !(28..100).contains(&y) {
            assert_eq!(*p, *src.get_pixel(x, y), "pixel ({x}, {y}) outside the mask changed");
        }
    }
    assert_eq!(out.images[0].recipe.mode, brume::pipelines::recipe::Mode::Inpaint);
}

#[test]
fn idle_runtimes_leave_the_compute_pool_free() {
    // An idle worker waits on its own thread: three runtimes side by side (more
    // than the pool's threads on a 2-core machine) all finish their jobs.
    let rts: Vec<Runtime> = (0..3).map(|_| start(4)).collect();
    let ids: Vec<JobId> = rts.iter().map(|rt| rt.submit(quick("a circle")).unwrap()).collect();
    for (rt, id) in rts.iter().zip(ids) {
        assert_eq!(rt.wait(id).unwrap().state, JobState::Done);
    }
}

#[test]
fn old_results_drop_their_pictures_but_keep_their_state() {
    let rt = start(200);
    let ids: Vec<JobId> = (0..KEEP_OUTPUTS + 3).map(|i| rt.submit(JobSpec { steps: Some(1), ..quick(&format!("p{i}")) }).unwrap()).collect();
    let last = *ids.last().unwrap();
    assert_eq!(rt.wait(last).unwrap().state, JobState::Done);
    let first = rt.status(ids[0]).unwrap();
    assert_eq!(first.state, JobState::Done);
    assert!(first.output.is_none(), "the oldest result should have let its pictures go");
    assert!(rt.status(last).unwrap().output.is_some());
}
