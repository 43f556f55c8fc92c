//! brume's job runtime: a long-lived worker that owns the loaded models (kept
//! warm between jobs), the conditioning cache and a job queue, so a service or
//! an app runs inference off its own threads with progress, previews and
//! cancellation. The CLI's `generate` and `edit` and `brume serve` all run
//! their jobs here: one code path.
//!
//! Layers, bottom up: [`job`] (what is asked), [`validate`] (refused at once,
//! naming the field), [`queue`] (who runs next), the worker (runs one job at a
//! time on the compute pool), [`event`] (what is reported). The runtime knows
//! nothing of HTTP or storage: a [`ResultSink`] given at start (the gallery,
//! in the service) stores each result before the job is reported done.

pub mod error;
pub mod event;
pub mod job;
pub mod plan;
mod queue;
pub mod registry;
pub mod validate;
mod warm;
mod worker;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

pub use error::{JobError, JobErrorKind, StartError, SubmitError};
pub use event::{CancelReason, EventKind, GeneratedImage, JobEvent, JobOutput, JobState, Timings};
pub use job::{Edit, InputImage, JobId, JobSpec, Lane, PreviewPolicy, Priority};
pub use plan::{MemoryPolicy, PlanJob, PlannedRun};
pub use registry::{ModelEntry, ModelInfo, ModelSource, UnetInfo};
pub use validate::Limits;

use queue::Queue;
use tokio::sync::broadcast;

/// Stores a job's pictures before the job is reported done (the service's
/// gallery). Called on the worker thread; an error fails the job, naming it.
pub trait ResultSink: Send + Sync {
    /// Returns one id per picture, in order.
    fn store(&self, job: &StoreContext<'_>, images: &[GeneratedImage]) -> Result<Vec<String>, String>;
}

/// What a sink learns of the job whose pictures it stores.
pub struct StoreContext<'a> {
    pub job: JobId,
    pub spec: &'a JobSpec,
    pub model: &'a str,
    pub model_hash: &'a str,
    pub unet: &'a str,
    pub timings: &'a Timings,
}

/// How a runtime is set up.
pub struct RuntimeConfig {
    /// The models served, the first is the default unless `default_model` names another.
    pub models: Vec<ModelEntry>,
    pub default_model: Option<String>,
    pub memory: MemoryPolicy,
    pub limits: Limits,
    /// Jobs waiting at most; past it a submission is refused with a retry delay.
    pub queue_limit: usize,
    /// A job running longer is cancelled at its next step (`timeout`).
    pub max_job_time: Option<Duration>,
    /// Finished jobs remembered for status queries (the last [`KEEP_OUTPUTS`]
    /// with their pictures).
    pub keep_finished: usize,
    /// Prompt encodings kept (per model) so a repeated prompt skips the text encoder.
    pub conditioning_cache: usize,
    /// Opened models kept warm between jobs, least recently used evicted first
    /// (also evicted when their mapped weights exceed the memory budget).
    pub warm_models: usize,
    pub sink: Option<Arc<dyn ResultSink>>,
}

impl RuntimeConfig {
    pub fn new(models: Vec<ModelEntry>) -> Self {
        Self {
            models,
            default_model: None,
            memory: MemoryPolicy::default(),
            limits: Limits::default(),
            queue_limit: 64,
            max_job_time: Some(Duration::from_secs(600)),
            keep_finished: 512,
            conditioning_cache: 8,
            warm_models: 4,
            sink: None,
        }
    }
}

/// A job as seen from outside: its state and, once done, its result.
#[derive(Debug, Clone)]
pub struct JobStatus {
    pub id: JobId,
    pub state: JobState,
    pub client: Option<String>,
    pub priority: Priority,
    pub submitted_at: SystemTime,
    pub output: Option<Arc<JobOutput>>,
    /// The latest step preview (PNG), while running.
    pub preview: Option<Arc<Vec<u8>>>,
    /// The job's model and prompt (A1111's progress text shows them).
    pub model: String,
    pub prompt: String,
}

/// The queue at a glance.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueInfo {
    pub running: Option<JobId>,
    pub queued: usize,
    pub limit: usize,
}

/// Finished jobs whose pictures stay in memory for status queries: a service
/// under load must not grow by every picture it made (the gallery has them).
pub const KEEP_OUTPUTS: usize = 64;

// Why the worker should stop the running job at its next step.
const STOP_NONE: u8 = 0;
const STOP_USER: u8 = 1;
const STOP_SUPERSEDED: u8 = 2;
const STOP_TIMEOUT: u8 = 3;
const STOP_SHUTDOWN: u8 = 4;
const STOP_PREEMPT: u8 = 5;

/// A running job's stop request, read by its progress callback between steps.
#[derive(Debug, Default)]
pub(crate) struct Control(AtomicU8);

impl Control {
    /// Asks the job to stop; a cancel overrides a preemption, never the reverse.
    fn request(&self, why: u8) {
        let _ = self.0.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
            (now == STOP_NONE || (now == STOP_PREEMPT && why != STOP_PREEMPT)).then_some(why)
        });
    }

    pub(crate) fn stop_requested(&self) -> bool {
        self.0.load(Ordering::SeqCst) != STOP_NONE
    }

    fn take(&self) -> u8 {
        self.0.swap(STOP_NONE, Ordering::SeqCst)
    }
}

fn reason_of(code: u8) -> Option<CancelReason> {
    match code {
        STOP_USER => Some(CancelReason::User),
        STOP_SUPERSEDED => Some(CancelReason::Superseded),
        STOP_TIMEOUT => Some(CancelReason::Timeout),
        STOP_SHUTDOWN => Some(CancelReason::Shutdown),
        _ => None,
    }
}

pub(crate) struct JobRecord {
    spec: Arc<JobSpec>,
    model: String,
    state: JobState,
    submitted: Instant,
    submitted_at: SystemTime,
    output: Option<Arc<JobOutput>>,
    preview: Option<Arc<Vec<u8>>>,
    control: Arc<Control>,
    preemptions: u32,
}

#[derive(Default)]
pub(crate) struct State {
    queue: Queue,
    jobs: HashMap<JobId, JobRecord>,
    finished: VecDeque<JobId>,
    running: Option<JobId>,
    next_id: u64,
    stopping: bool,
    /// Seconds per finished job, smoothed: the basis of Retry-After.
    job_secs: Option<f64>,
}

pub(crate) struct Shared {
    state: Mutex<State>,
    /// Wakes the worker when a job is queued or the runtime stops.
    work: Condvar,
    /// Wakes waiters when any job changes state.
    changed: Condvar,
    events: broadcast::Sender<Arc<JobEvent>>,
    models: Vec<ModelInfo>,
    default_model: String,
    limits: Limits,
    queue_limit: usize,
    keep_finished: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock would be a bug in this crate; the state
        // is still consistent enough to report and shut down.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn emit(&self, st: &State, job: JobId, kind: EventKind) {
        let client = st.jobs.get(&job).and_then(|r| r.spec.client.clone());
        // No receivers is fine: nobody is listening.
        let _ = self.events.send(Arc::new(JobEvent { job, client, kind }));
    }

    /// Tells every queued job its (new) place.
    fn emit_positions(&self, st: &mut State) {
        let ids: Vec<JobId> = st.queue.iter().collect();
        for (position, id) in ids.into_iter().enumerate() {
            if let Some(r) = st.jobs.get_mut(&id) {
                if r.state != (JobState::Queued { position }) {
                    r.state = JobState::Queued { position };
                    self.emit(st, id, EventKind::Queued { position });
                }
            }
        }
    }

    /// Ends a job: records its final state, remembers it for a while, tells everyone.
    fn finish(&self, st: &mut State, id: JobId, state: JobState, kind: EventKind) {
        if let Some(r) = st.jobs.get_mut(&id) {
            r.state = state;
            r.preview = None;
            // A finished edit's input pictures are not needed for its status: a
            // service that remembers hundreds of jobs must not keep their uploads.
            if !matches!(r.spec.edit, Edit::None) {
                let mut spec = (*r.spec).clone();
                spec.edit = Edit::None;
                r.spec = Arc::new(spec);
            }
            if let EventKind::Done { output } = &kind {
                r.output = Some(output.clone());
            }
        }
        self.emit(st, id, kind);
        st.finished.push_back(id);
        // Old results' pictures go (a sink has stored them); their states stay a while longer.
        if let Some(old) = st.finished.len().checked_sub(KEEP_OUTPUTS + 1).and_then(|i| st.finished.get(i).copied()) {
            if let Some(r) = st.jobs.get_mut(&old) {
                r.output = None;
            }
        }
        while st.finished.len() > self.keep_finished {
            if let Some(old) = st.finished.pop_front() {
                st.jobs.remove(&old);
            }
        }
        self.changed.notify_all();
    }

    fn model_info(&self, name: Option<&str>) -> Result<&ModelInfo, SubmitError> {
        let name = name.unwrap_or(&self.default_model);
        self.models.iter().find(|m| m.name == name).ok_or_else(|| {
            let known: Vec<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
            SubmitError::invalid("model", format!("no model named `{name}` (serving: {})", known.join(", ")))
        })
    }
}

/// The runtime: submit jobs, watch them, cancel them. Cheap to clone; the
/// worker stops when [`Runtime::shutdown`] is called or the last clone drops.
#[derive(Clone)]
pub struct Runtime {
    shared: Arc<Shared>,
    _worker: Arc<WorkerHandle>,
}

struct WorkerHandle {
    shared: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        stop(&self.shared);
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }
}

fn stop(shared: &Shared) {
    let mut st = shared.lock();
    st.stopping = true;
    if let Some(id) = st.running {
        if let Some(r) = st.jobs.get(&id) {
            r.control.request(STOP_SHUTDOWN);
        }
    }
    while let Some(id) = st.queue.pop() {
        shared.finish(&mut st, id, JobState::Cancelled(CancelReason::Shutdown), EventKind::Cancelled { reason: CancelReason::Shutdown });
    }
    shared.work.notify_all();
}

impl Runtime {
    /// Opens every model once (to check it and read its settings) and starts
    /// the worker. Returns when the worker is ready.
    pub fn start(config: RuntimeConfig) -> Result<Runtime, StartError> {
        if config.models.is_empty() {
            return Err(StartError::NoModels);
        }
        for (i, m) in config.models.iter().enumerate() {
            if config.models[..i].iter().any(|o| o.name == m.name) {
                return Err(StartError::DuplicateName(m.name.clone()));
            }
        }
        config.memory.validate().map_err(|e| StartError::Model { name: "memory policy".into(), message: e.to_string() })?;
        let default_model = config.default_model.clone().unwrap_or_else(|| config.models[0].name.clone());
        if !config.models.iter().any(|m| m.name == default_model) {
            return Err(StartError::Model { name: default_model, message: "is not among the served models".into() });
        }
        let mut infos = Vec::new();
        for m in &config.models {
            let info = ModelInfo::read(m, m.name == default_model).map_err(|message| StartError::Model { name: m.name.clone(), message })?;
            infos.push(info);
        }
        let (events, _) = broadcast::channel(1024);
        let shared = Arc::new(Shared {
            state: Mutex::new(State { next_id: 1, ..State::default() }),
            work: Condvar::new(),
            changed: Condvar::new(),
            events,
            models: infos,
            default_model,
            limits: config.limits.clone(),
            queue_limit: config.queue_limit.max(1),
            keep_finished: config.keep_finished.max(1),
        });
        let worker = worker::Worker::new(shared.clone(), &config);
        let thread = std::thread::Builder::new().name("brume-runtime".into()).spawn(move || worker.run())?;
        let handle = Arc::new(WorkerHandle { shared: shared.clone(), thread: Mutex::new(Some(thread)) });
        Ok(Runtime { shared, _worker: handle })
    }

    /// Queues a job after checking it; refused at once when a setting is out of
    /// range (naming the field) or the queue is full (with a retry delay).
    pub fn submit(&self, mut spec: JobSpec) -> Result<JobId, SubmitError> {
        // Drawn once here, so a preempted job restarts with the same noise.
        spec.seed = Some(spec.seed.unwrap_or_else(rand::random));
        let info = self.shared.model_info(spec.model.as_deref())?;
        validate::check(&spec, info, &self.shared.limits)?;
        let model = info.name.clone();
        let mut st = self.shared.lock();
        if st.stopping {
            return Err(SubmitError::Stopped);
        }
        // The latest-wins lane: this client's older jobs in the lane give way.
        let superseded: Vec<JobId> = match (&spec.client, spec.lane) {
            (Some(c), Lane::Latest) => st
                .queue
                .iter()
                .filter(|id| st.jobs.get(id).is_some_and(|r| r.spec.lane == Lane::Latest && r.spec.client.as_ref() == Some(c)))
                .collect(),
            _ => Vec::new(),
        };
        if st.queue.len() - superseded.len() >= self.shared.queue_limit {
            let per_job = st.job_secs.unwrap_or(5.0);
            let ahead = (st.queue.len() + 1 - self.shared.queue_limit) as f64;
            let secs = (per_job * ahead).clamp(1.0, 3600.0);
            return Err(SubmitError::QueueFull { limit: self.shared.queue_limit, retry_after: Duration::from_secs_f64(secs.ceil()) });
        }
        for id in &superseded {
            st.queue.remove(*id);
            self.shared.finish(&mut st, *id, JobState::Cancelled(CancelReason::Superseded), EventKind::Cancelled { reason: CancelReason::Superseded });
        }
        if let (Some(c), Lane::Latest, Some(run)) = (&spec.client, spec.lane, st.running) {
            if let Some(r) = st.jobs.get(&run) {
                if r.spec.lane == Lane::Latest && r.spec.client.as_ref() == Some(c) {
                    r.control.request(STOP_SUPERSEDED);
                }
            }
        }
        if spec.priority == Priority::Interactive {
            if let Some(run) = st.running {
                if let Some(r) = st.jobs.get(&run) {
                    if r.spec.priority == Priority::Batch {
                        r.control.request(STOP_PREEMPT);
                    }
                }
            }
        }
        let id = JobId(st.next_id);
        st.next_id += 1;
        let priority = spec.priority;
        st.jobs.insert(
            id,
            JobRecord {
                spec: Arc::new(spec),
                model,
                state: JobState::Queued { position: usize::MAX },
                submitted: Instant::now(),
                submitted_at: SystemTime::now(),
                output: None,
                preview: None,
                control: Arc::new(Control::default()),
                preemptions: 0,
            },
        );
        st.queue.push(id, priority);
        self.shared.emit_positions(&mut st);
        self.shared.work.notify_all();
        Ok(id)
    }

    /// Cancels a queued job at once, or a running one at its next step. False
    /// when the job is unknown or already finished.
    pub fn cancel(&self, id: JobId) -> bool {
        let mut st = self.shared.lock();
        if st.queue.remove(id) {
            self.shared.finish(&mut st, id, JobState::Cancelled(CancelReason::User), EventKind::Cancelled { reason: CancelReason::User });
            self.shared.emit_positions(&mut st);
            return true;
        }
        if st.running == Some(id) {
            if let Some(r) = st.jobs.get(&id) {
                r.control.request(STOP_USER);
                return true;
            }
        }
        false
    }

    /// Cancels the running job (A1111's interrupt); returns it.
    pub fn interrupt(&self) -> Option<JobId> {
        let running = self.shared.lock().running;
        running.filter(|&id| self.cancel(id))
    }

    /// Cancels every queued and running job of `client`.
    pub fn cancel_client(&self, client: &str) -> usize {
        let ids: Vec<JobId> = {
            let st = self.shared.lock();
            st.jobs.iter().filter(|(_, r)| !r.state.is_finished() && r.spec.client.as_deref() == Some(client)).map(|(id, _)| *id).collect()
        };
        ids.into_iter().filter(|&id| self.cancel(id)).count()
    }

    pub fn status(&self, id: JobId) -> Option<JobStatus> {
        let st = self.shared.lock();
        st.jobs.get(&id).map(|r| status_of(id, r))
    }

    /// The running job's status, if any (A1111's progress endpoint).
    pub fn running(&self) -> Option<JobStatus> {
        let st = self.shared.lock();
        st.running.and_then(|id| st.jobs.get(&id).map(|r| status_of(id, r)))
    }

    pub fn queue(&self) -> QueueInfo {
        let st = self.shared.lock();
        QueueInfo { running: st.running, queued: st.queue.len(), limit: self.shared.queue_limit }
    }

    /// Every event of every job from now on. A receiver that falls more than
    /// 1024 events behind loses the oldest (`Lagged`); [`Runtime::status`]
    /// still has each job's state.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<JobEvent>> {
        self.shared.events.subscribe()
    }

    /// Blocks until the job finishes; `None` if it is unknown (or forgotten).
    pub fn wait(&self, id: JobId) -> Option<JobStatus> {
        let mut st = self.shared.lock();
        loop {
            let r = st.jobs.get(&id)?;
            if r.state.is_finished() {
                return Some(status_of(id, r));
            }
            st = self.shared.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Waits for the job to finish without blocking an async executor.
    pub async fn finished(&self, id: JobId) -> Option<JobStatus> {
        let mut rx = self.subscribe();
        loop {
            let s = self.status(id)?;
            if s.state.is_finished() {
                return Some(s);
            }
            loop {
                match rx.recv().await {
                    Ok(e) if e.job == id && matches!(e.kind, EventKind::Done { .. } | EventKind::Failed { .. } | EventKind::Cancelled { .. }) => break,
                    Ok(_) => continue,
                    Err(broadcast::error::RecvError::Lagged(_)) => break,
                    Err(broadcast::error::RecvError::Closed) => return self.status(id),
                }
            }
        }
    }

    pub fn models(&self) -> &[ModelInfo] {
        &self.shared.models
    }

    pub fn default_model(&self) -> &str {
        &self.shared.default_model
    }

    pub fn limits(&self) -> &Limits {
        &self.shared.limits
    }

    /// Stops taking jobs, cancels the queued ones and the running one at its
    /// next step, and waits for the worker to end.
    pub fn shutdown(&self) {
        stop(&self.shared);
        if let Some(t) = self._worker.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }
}

fn status_of(id: JobId, r: &JobRecord) -> JobStatus {
    JobStatus {
        id,
        state: r.state.clone(),
        client: r.spec.client.clone(),
        priority: r.spec.priority,
        submitted_at: r.submitted_at,
        output: r.output.clone(),
        preview: r.preview.clone(),
        model: r.model.clone(),
        prompt: r.spec.prompt.clone(),
    }
}
