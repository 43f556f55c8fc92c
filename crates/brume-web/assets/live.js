// The scheduling of jobs, live and not. Rules (issue 47):
// - at most one job in flight and one pending: `running` is the job the service has (or is
//   being sent), `pending` one slot saying "submit again when it ends";
// - the newest input wins: a new input while a job runs cancels it (at its next step) and fills
//   the pending slot; the pending job takes its snapshot only when it is submitted, so it is
//   always of the newest input and never queued behind a stale one;
// - adaptive debounce: none while the engine answers fast, about half a live job's time when it
//   is slow, and a maximum wait so a long stroke still renders while it is drawn;
// - a fixed seed and the model's few-step UNet while live, then one full-quality "settle"
//   render once the input has stopped changing.

import { api, ApiError } from './api.js';

const FAST_MS = 300; // a live job this quick needs no debounce
const MAX_DEBOUNCE_MS = 600;
const TYPING_MS = 250; // prompt keystrokes are gathered at least this long
const SETTLE_AFTER_MS = 700; // quiet time before the full-quality render
const POLL_MS = 250; // job polling while the event socket is down
const SAFETY_POLL_MS = 2000; // and a slow check while it is up, in case an event was lost

export class Scheduler {
  /**
   * @param {object} o
   * @param {(kind: string) => Promise<object>} o.buildJob the job body for the current input
   * @param {(body: object) => Promise<object>} o.submit sends a job; resolves to {id, state, position}
   * @param {(msg: object) => boolean} o.send sends on the event socket (false when it is down)
   * @param {() => boolean} o.socketOpen
   */
  constructor({ buildJob, submit, send, socketOpen, onStatus, onPreview, onResult, onError }) {
    this.buildJob = buildJob;
    this.submitJob = submit;
    this.send = send;
    this.socketOpen = socketOpen;
    this.onStatus = onStatus;
    this.onPreview = onPreview;
    this.onResult = onResult;
    this.onError = onError;
    this.live = false;
    this.version = 0; // bumped by every input
    this.inputAt = performance.now(); // when the newest input happened
    this.running = null;
    this.pending = null;
    this.debounceTimer = null;
    this.maxWaitTimer = null;
    this.settleTimer = null;
    this.pollTimer = null;
    this.liveMs = 0; // smoothed duration of a live job, submit to result
    this.early = new Map(); // events that arrived before the POST answered with their id
    this.stats = { submitted: 0, cancelled: 0, maxInFlight: 0, maxPending: 0 };
  }

  setLive(on) {
    this.live = on;
    this.clearTimers();
    if (on) this.request('live');
    else if (this.running && this.running.kind !== 'full') this.cancelRunning('user');
    this.status();
  }

  /** The debounce for the engine's current speed: none when fast. */
  debounceMs() {
    return this.liveMs <= FAST_MS ? 0 : Math.min(MAX_DEBOUNCE_MS, this.liveMs / 2);
  }

  /** The longest a continuous change (a long stroke) waits before it is rendered. */
  maxWaitMs() {
    return Math.max(250, Math.min(1500, this.liveMs * 1.5 || 400));
  }

  /**
   * An input changed: `kind` is "commit" (a stroke ended, a fill, an undo...), "progress" (a
   * stroke is still being drawn) or "typing" (the prompt).
   */
  input(kind, at = performance.now()) {
    if (kind !== 'progress') {
      this.version += 1;
      this.inputAt = at;
    }
    if (!this.live) return;
    clearTimeout(this.settleTimer);
    this.settleTimer = null;
    if (kind === 'progress') {
      if (!this.maxWaitTimer) this.maxWaitTimer = setTimeout(() => { this.version += 1; this.fire(); }, this.maxWaitMs());
      return;
    }
    const delay = kind === 'typing' ? Math.max(TYPING_MS, this.debounceMs()) : this.debounceMs();
    clearTimeout(this.debounceTimer);
    if (delay === 0) {
      this.fire();
      return;
    }
    this.debounceTimer = setTimeout(() => this.fire(), delay);
    if (!this.maxWaitTimer) this.maxWaitTimer = setTimeout(() => this.fire(), this.maxWaitMs());
  }

  fire() {
    this.clearTimers();
    this.request('live');
  }

  clearTimers() {
    for (const t of ['debounceTimer', 'maxWaitTimer', 'settleTimer']) {
      clearTimeout(this[t]);
      this[t] = null;
    }
  }

  /** One full-quality job of the current input (Generate). */
  generate() {
    this.clearTimers();
    this.request('full');
  }

  /** Cancel: stops the job in flight and forgets the pending one. */
  cancel() {
    this.clearTimers();
    this.pending = null;
    if (this.running) this.cancelRunning('user');
    this.status();
  }

  request(kind) {
    if (this.running) {
      const r = this.running;
      // Already computing exactly this input at least as well: nothing to do.
      if (r.version === this.version && !r.cancelling && (r.kind === kind || r.kind === 'full')) return;
      this.pending = { kind };
      this.stats.maxPending = Math.max(this.stats.maxPending, 1);
      this.cancelRunning('superseded');
      this.status();
      return;
    }
    this.submit(kind);
  }

  async submit(kind) {
    const entry = {
      id: null,
      kind,
      version: this.version,
      inputAt: this.inputAt,
      submittedAt: performance.now(),
      cancelling: false,
      state: 'sending',
      step: 0,
      total: 0,
      etaMs: null,
      position: null,
      previewAt: null,
      finished: false,
    };
    this.running = entry;
    this.stats.maxInFlight = Math.max(this.stats.maxInFlight, 1);
    this.status();
    let body;
    try {
      body = await this.buildJob(kind);
      const accepted = await this.submitJob(body);
      entry.id = String(accepted.id);
      entry.state = accepted.state || 'queued';
      entry.position = accepted.position ?? null;
      this.stats.submitted += 1;
    } catch (err) {
      this.finish(entry);
      this.onError(err instanceof ApiError ? err : new ApiError(String(err.message || err)));
      this.next();
      return;
    }
    if (entry.cancelling) this.sendCancel(entry.id);
    for (const ev of this.early.get(entry.id) || []) this.event(ev);
    this.early.clear();
    this.poll();
    this.status();
  }

  cancelRunning(reason) {
    const r = this.running;
    if (!r || r.cancelling) return;
    r.cancelling = true;
    r.cancelReason = reason;
    this.stats.cancelled += 1;
    if (r.id) this.sendCancel(r.id);
  }

  /** Cancels over the socket when it is up (no HTTP error if the job just ended), else HTTP. */
  sendCancel(id) {
    if (this.send({ type: 'cancel', id })) return;
    api.cancel(id).catch(() => {});
  }

  /** An event from the socket (or synthesised from polling). */
  event(ev) {
    const id = ev.id === undefined ? null : String(ev.id);
    const r = this.running;
    if (!id) return;
    if (!r || r.id !== id) {
      // Sent before our POST returned? Keep it until the id is known.
      if (r && r.id === null) {
        if (!this.early.has(id)) this.early.set(id, []);
        this.early.get(id).push(ev);
      }
      return;
    }
    switch (ev.type) {
      case 'queued': r.state = 'queued'; r.position = ev.position ?? null; break;
      case 'started': r.state = 'running'; break;
      case 'step':
        r.state = 'running';
        r.step = ev.step;
        r.total = ev.total;
        r.etaMs = ev.eta_ms ?? null;
        break;
      case 'preview':
        if (!r.cancelling) {
          if (r.previewAt === null) r.previewAt = performance.now();
          this.onPreview(ev.image, r);
        }
        break;
      case 'done': {
        this.finish(r);
        const now = performance.now();
        if (r.kind === 'live') {
          const took = now - r.submittedAt;
          this.liveMs = this.liveMs ? this.liveMs * 0.7 + took * 0.3 : took;
        }
        r.doneAt = now;
        this.lastDone = r;
        this.onResult(ev.result, r);
        this.next();
        return;
      }
      case 'failed':
        this.finish(r);
        this.onError(new ApiError(ev.error?.message || 'the job failed', { field: ev.error?.field ?? null }));
        this.pending = null; // do not loop on an input the service refuses; the next edit retries
        this.next();
        return;
      case 'cancelled':
        this.finish(r);
        this.next();
        return;
      default:
        break;
    }
    this.status();
  }

  finish(r) {
    r.finished = true;
    if (this.running === r) this.running = null;
    clearTimeout(this.pollTimer);
    this.pollTimer = null;
  }

  /** After a job ends: the pending one, or the settle render once the input is quiet. */
  next() {
    if (this.pending) {
      const { kind } = this.pending;
      this.pending = null;
      this.submit(kind);
      return;
    }
    this.status();
    if (this.live && this.lastLiveDoneFor(this.version)) {
      const wait = Math.max(0, this.inputAt + SETTLE_AFTER_MS - performance.now());
      clearTimeout(this.settleTimer);
      this.settleTimer = setTimeout(() => {
        this.settleTimer = null;
        if (!this.running && this.live) this.request('settle');
      }, wait);
    }
  }

  lastLiveDoneFor(version) {
    return this.lastDone && this.lastDone.kind === 'live' && this.lastDone.version === version;
  }

  /** Polls the job in flight: often while the socket is down, rarely while it is up. */
  poll() {
    clearTimeout(this.pollTimer);
    const r = this.running;
    if (!r || !r.id) return;
    this.pollTimer = setTimeout(async () => {
      if (this.running !== r) return;
      try {
        const job = await api.job(r.id);
        if (this.running !== r || r.finished) return;
        if (job.state === 'done') this.event({ type: 'done', id: r.id, result: job.result });
        else if (job.state === 'failed') this.event({ type: 'failed', id: r.id, error: job.error });
        else if (job.state === 'cancelled') this.event({ type: 'cancelled', id: r.id, reason: job.reason });
        else {
          if (job.step !== undefined) this.event({ type: 'step', id: r.id, step: job.step, total: job.total, eta_ms: job.eta_ms });
          this.poll();
        }
      } catch (err) {
        this.onError(err);
        this.poll();
      }
    }, this.socketOpen() ? SAFETY_POLL_MS : POLL_MS);
  }

  /** The socket came back: watch the job in flight again and catch up on its state now. */
  reconnected() {
    const r = this.running;
    if (!r || !r.id) return;
    this.send({ type: 'watch', id: r.id });
    clearTimeout(this.pollTimer);
    this.pollTimer = null;
    this.poll();
  }

  status() {
    const r = this.running;
    let state = 'idle';
    let text = this.live ? 'Live: waiting for an edit' : 'Idle';
    if (r) {
      const what = { live: 'Live', settle: 'Settling', full: 'Generating' }[r.kind];
      if (r.cancelling) {
        state = 'cancelling';
        text = `${what}: stopping the stale job…`;
      } else if (r.state === 'running') {
        state = 'running';
        const eta = r.etaMs != null ? `, about ${(r.etaMs / 1000).toFixed(1)} s left` : '';
        text = r.total ? `${what}: step ${r.step}/${r.total}${eta}` : `${what}: running`;
      } else {
        state = 'queued';
        text = r.position ? `${what}: queued, position ${r.position}` : `${what}: queued`;
      }
      if (this.pending) text += ' (newer edit waiting)';
    }
    this.onStatus({ state, text, running: r, pending: this.pending });
  }
}
