// The editor page: wires the canvas, history, settings, scheduler, gallery and the service
// together, and owns what the user sees of them (status, errors, result, shortcuts).

import { api, ApiError, EventSocket, fetchBlob, imageUrl } from './api.js';
import { Painter } from './canvas.js';
import { History } from './history.js';
import { Scheduler } from './live.js';
import { Settings } from './settings.js';
import { Gallery } from './gallery.js';
import { DocumentStore } from './store.js';

const $ = (id) => document.getElementById(id);

// ---- errors and notices, in words ----------------------------------------------------------

const errorBox = $('error');
let errorTimer = null;
function showError(err) {
  const text = err instanceof ApiError ? err.describe() : String(err && err.message ? err.message : err);
  errorBox.textContent = text;
  errorBox.dataset.kind = 'error';
  errorBox.hidden = false;
  clearTimeout(errorTimer);
  errorTimer = setTimeout(() => { errorBox.hidden = true; }, 12000);
}
function showNotice(text) {
  errorBox.textContent = text;
  errorBox.dataset.kind = 'notice';
  errorBox.hidden = false;
  clearTimeout(errorTimer);
  errorTimer = setTimeout(() => { errorBox.hidden = true; }, 4000);
}
errorBox.addEventListener('click', () => { errorBox.hidden = true; });

// ---- the document --------------------------------------------------------------------------

const clientId = sessionStorage.getItem('brume.client') || `tab-${crypto.randomUUID()}`;
sessionStorage.setItem('brume.client', clientId);

const painter = new Painter($('canvas'), $('stage'), 128, 128);
const history = new History($('history'), () => painter.capture(), (s) => painter.restore(s));
const store = new DocumentStore(showError);
store.onSaved = (version) => { document.body.dataset.savedVersion = String(version); };
addEventListener('pagehide', () => store.flush(painter));
const settings = new Settings();
let parentId = null; // the gallery picture the canvas came from, if any

const resultImg = $('result');
const overlay = $('result-overlay');
let lastResult = null; // {url, galleryId, kind, version}

function syncOverlay() {
  overlay.style.width = `${painter.width}px`;
  overlay.style.height = `${painter.height}px`;
  painter.applyView(overlay);
}
painter.onView = syncOverlay;

function edited(kind = 'commit') {
  scheduler.input(kind);
  store.saveSoon(painter);
  updateButtons();
}

painter.onCommit = (label) => {
  history.push(label);
  edited();
};
painter.onProgress = () => scheduler.input('progress');
history.onChange = () => edited();

// ---- jobs ----------------------------------------------------------------------------------

const blobToDataUrl = (blob) => new Promise((resolve, reject) => {
  const r = new FileReader();
  r.onload = () => resolve(r.result);
  r.onerror = () => reject(r.error);
  r.readAsDataURL(blob);
});
const canvasToDataUrl = (canvas) => new Promise((resolve, reject) => {
  canvas.toBlob((b) => (b ? blobToDataUrl(b).then(resolve, reject) : reject(new Error('could not encode the canvas'))), 'image/png');
});

/** The mode Auto picks: inpaint where something is masked, text-to-image on a blank canvas. */
function chooseMode(v) {
  if (v.mode !== 'auto') return v.mode;
  if (!painter.mask.empty) return 'inpaint';
  return painter.isBlank() ? 'txt2img' : 'img2img';
}

async function buildJob(kind) {
  const v = settings.values();
  if (!v.prompt) throw new ApiError('write a prompt first', { field: 'prompt' });
  const mode = chooseMode(v);
  const fast = settings.fastUnet();
  const body = {
    mode,
    prompt: v.prompt,
    negative_prompt: v.negative_prompt,
    model: v.model,
    seed: kind === 'full' ? settings.seedForGenerate() : v.seed,
    batch: 1,
    client: clientId,
    priority: 'interactive',
    lane: kind === 'full' ? 'queue' : 'latest',
    preview_every: 1,
  };
  if (kind === 'live' && fast) {
    // Fast settings: the few-step UNet with its own defaults (null = the UNet's).
    Object.assign(body, { unet: fast.name, sampler: null, steps: null, guidance: null, strength: null });
  } else {
    const full = settings.fullUnet();
    Object.assign(body, { unet: full ? full.name : null, sampler: v.sampler, steps: v.steps, guidance: v.guidance });
    if (mode !== 'txt2img') body.strength = v.strength;
  }
  if (mode === 'txt2img') {
    body.width = painter.width;
    body.height = painter.height;
  } else {
    body.image = await canvasToDataUrl(painter.flatten());
    if (mode === 'inpaint') {
      body.mask = await canvasToDataUrl(painter.mask.toCanvas());
      body.feather = v.feather;
    }
  }
  if (parentId !== null) body.parent = parentId;
  return body;
}

const jobStatus = $('job-status');
const cancelButton = $('cancel');

const scheduler = new Scheduler({
  buildJob,
  // Over the socket when it is up (one round trip, refusals as words); over HTTP when it is not.
  submit: (body) => (socket.open ? socket.submit(body) : api.submit(body)),
  send: (msg) => socket.send(msg),
  socketOpen: () => socket.open,
  onStatus: ({ state, text, running }) => {
    jobStatus.textContent = text;
    jobStatus.dataset.state = state;
    jobStatus.dataset.kind = running ? running.kind : '';
    cancelButton.disabled = !running;
  },
  onPreview: (image, job) => {
    resultImg.src = image;
    resultImg.dataset.kind = 'preview';
    resultImg.dataset.job = job.id;
    overlay.src = image;
  },
  onResult: async (result, job) => {
    const image = result && result.images && result.images[0];
    if (!image || !image.url) return showError('the job finished but its picture was not stored in the gallery');
    try {
      const url = await imageUrl(image.url);
      const probe = new Image();
      probe.src = url;
      await probe.decode();
      // A result that arrives after a newer one (a race with a cancel) does not replace it.
      if (lastResult && lastResult.version > job.version) return;
      resultImg.src = url;
      overlay.src = url;
      Object.assign(resultImg.dataset, {
        kind: job.kind,
        version: String(job.version),
        job: job.id,
        galleryId: String(image.gallery_id ?? ''),
      });
      lastResult = { url: image.url, galleryId: image.gallery_id ?? null, kind: job.kind, version: job.version };
      localStorage.setItem('brume.result', JSON.stringify({ url: image.url, galleryId: lastResult.galleryId }));
      const t = result.timings || {};
      const after = Math.round(performance.now() - job.inputAt);
      const what = { live: 'Live result', settle: 'Settled', full: 'Result' }[job.kind];
      $('result-caption').textContent = `${what} · ${t.steps ?? '?'} steps · seed ${image.seed ?? '?'} · ${after} ms after the edit`;
      $('apply').disabled = false;
      $('result-download').href = url;
      $('result-download').setAttribute('aria-disabled', 'false');
      gallery.invalidate();
    } catch (err) {
      showError(err);
    }
  },
  onError: (err) => {
    // The picture the canvas came from was deleted from the gallery: edit on without the link.
    if (err instanceof ApiError && err.field === 'parent') {
      parentId = null;
      showError('The gallery picture this canvas came from was deleted; the next job starts a new lineage.');
      return;
    }
    showError(err);
  },
});

// ---- the event socket ----------------------------------------------------------------------

const connection = $('connection');
let lastNotice = null;
let wasOpen = false;
const socket = new EventSocket(clientId, {
  // Jobs are submitted over HTTP; a `rejected` reply can only be a cancel or watch of a job the
  // service has already forgotten, which the scheduler's polling settles by itself.
  onEvent: (ev) => {
    // A notice (e.g. a prompt cut at the text encoder's length) is said once, in words.
    if (ev.type === 'notice' && ev.message && ev.message !== lastNotice) {
      lastNotice = ev.message;
      showNotice(ev.message);
    }
    scheduler.event(ev);
  },
  onState: (state, delay) => {
    connection.dataset.state = state;
    if (state === 'open') {
      connection.textContent = 'Connected';
      if (wasOpen && errorBox.dataset.kind === 'error' && errorBox.textContent.startsWith('Lost the connection')) errorBox.hidden = true;
      wasOpen = true;
    } else if (state === 'reconnecting') {
      connection.textContent = `Connection lost, reconnecting in ${(delay / 1000).toFixed(1)} s…`;
      if (wasOpen) showError('Lost the connection to the brume server; reconnecting by itself…');
    } else {
      connection.textContent = 'Connecting…';
    }
  },
  onOpen: () => scheduler.reconnected(),
});

// ---- controls ------------------------------------------------------------------------------

const toolButtons = [...document.querySelectorAll('button.tool')];
function setTool(tool) {
  painter.tool = tool;
  for (const b of toolButtons) b.setAttribute('aria-pressed', String(b.dataset.tool === tool));
  $('stage').dataset.tool = tool;
}
for (const b of toolButtons) b.addEventListener('click', () => setTool(b.dataset.tool));
setTool('brush');

$('layer').addEventListener('change', (e) => { painter.active = Number(e.target.value); });
$('colour').addEventListener('input', (e) => { painter.colour = e.target.value; });
$('size').addEventListener('input', (e) => { painter.size = Number(e.target.value); });
$('opacity').addEventListener('input', (e) => { painter.opacity = Number(e.target.value); });
painter.colour = $('colour').value;
painter.size = Number($('size').value);
painter.opacity = Number($('opacity').value);

function updateButtons() {
  $('undo').disabled = !history.canUndo;
  $('redo').disabled = !history.canRedo;
}
$('undo').addEventListener('click', () => history.undo());
$('redo').addEventListener('click', () => history.redo());
$('clear').addEventListener('click', () => painter.clear());
$('zoom-in').addEventListener('click', () => painter.zoomAt(1.25));
$('zoom-out').addEventListener('click', () => painter.zoomAt(0.8));
$('zoom-fit').addEventListener('click', () => painter.fit());

async function loadFile(file) {
  if (!file || !file.type.startsWith('image/')) return showError('that is not a picture');
  try {
    parentId = null;
    await painter.loadImage(file);
  } catch (err) {
    showError(`could not read the picture: ${err.message || err}`);
  }
}
$('load').addEventListener('change', (e) => { loadFile(e.target.files[0]); e.target.value = ''; });
$('stage').addEventListener('dragover', (e) => e.preventDefault());
$('stage').addEventListener('drop', (e) => {
  e.preventDefault();
  loadFile(e.dataTransfer.files[0]);
});
document.addEventListener('paste', (e) => {
  if (e.target.closest && e.target.closest('input, textarea')) return;
  const item = [...(e.clipboardData?.items || [])].find((i) => i.type.startsWith('image/'));
  if (item) {
    e.preventDefault();
    loadFile(item.getAsFile());
  }
});

// Mask and outpainting.
$('mask-show').addEventListener('change', (e) => { painter.mask.visible = e.target.checked; painter.requestRender(); });
$('mask-invert').addEventListener('click', () => { painter.mask.invert(); painter.commit('Invert mask'); });
$('mask-clear').addEventListener('click', () => { painter.mask.clear(); painter.commit('Clear mask'); });
$('extend').addEventListener('click', () => {
  const by = Number($('extend-by').value);
  if (!Number.isInteger(by) || by < 8 || by % 8 !== 0) return showError('Pixels: extend by a multiple of 8 (the model works in blocks of 8)');
  try {
    painter.extend($('extend-side').value, by, settings.capabilities.max_side || 4096);
  } catch (err) {
    showError(err);
  }
});

$('size-select').addEventListener('change', (e) => painter.resize(Number(e.target.value), Number(e.target.value)));
$('defaults').addEventListener('click', () => { settings.applyDefaults(); settings.save(); });
$('settings').addEventListener('change', () => settings.save());
$('prompt').addEventListener('input', () => { settings.save(); scheduler.input('typing'); });
$('negative').addEventListener('input', () => { settings.save(); scheduler.input('typing'); });

// Generate, live, cancel.
$('settings').addEventListener('submit', (e) => {
  e.preventDefault();
  scheduler.generate();
});
const liveButton = $('live');
function setLive(on) {
  liveButton.setAttribute('aria-pressed', String(on));
  scheduler.setLive(on);
}
liveButton.addEventListener('click', () => setLive(liveButton.getAttribute('aria-pressed') !== 'true'));
cancelButton.addEventListener('click', () => scheduler.cancel());

// The result: beside the canvas or over it, and "apply" makes it the canvas's next state.
$('result-over').addEventListener('change', (e) => { overlay.hidden = !e.target.checked || !lastResult; syncOverlay(); });
$('result-opacity').addEventListener('input', (e) => {
  overlay.style.opacity = e.target.value;
  resultImg.style.opacity = e.target.value;
});
$('apply').addEventListener('click', async () => {
  if (!lastResult) return;
  try {
    await painter.replaceWith(await fetchBlob(lastResult.url), 'Apply result');
    parentId = lastResult.galleryId;
  } catch (err) {
    showError(err);
  }
});

// Views.
const gallery = new Gallery({
  onReuse: (item) => { settings.fromItem(item); showView('editor'); showNotice('Settings reused'); },
  onEdit: async (item, blob) => {
    showView('editor');
    try {
      await painter.replaceWith(blob, 'Edit gallery picture');
      parentId = item.id;
      settings.fromItem(item);
    } catch (err) {
      showError(err);
    }
  },
  onError: showError,
  onNotice: showNotice,
});
function showView(name) {
  $('editor').hidden = name !== 'editor';
  $('gallery').hidden = name !== 'gallery';
  $('view-editor').setAttribute('aria-pressed', String(name === 'editor'));
  $('view-gallery').setAttribute('aria-pressed', String(name === 'gallery'));
  if (name === 'gallery') gallery.show();
  else painter.fit();
}
$('view-editor').addEventListener('click', () => showView('editor'));
$('view-gallery').addEventListener('click', () => showView('gallery'));

// ---- keyboard shortcuts ----------------------------------------------------------------------

const KEYS = { b: 'brush', e: 'eraser', r: 'rect', o: 'ellipse', f: 'fill', m: 'mask', h: 'pan' };
document.addEventListener('keydown', (e) => {
  const typing = e.target.closest && e.target.closest('input, textarea, select');
  const mod = e.ctrlKey || e.metaKey;
  if (mod && e.key === 'Enter') {
    e.preventDefault();
    scheduler.generate();
    return;
  }
  if (typing) return;
  const key = e.key.toLowerCase();
  if (mod && key === 'z') {
    e.preventDefault();
    if (e.shiftKey) history.redo(); else history.undo();
  } else if (mod && key === 'y') {
    e.preventDefault();
    history.redo();
  } else if (mod || e.altKey) {
    // leave the browser's own shortcuts alone
  } else if (key === 'm' && e.shiftKey) {
    setTool('unmask');
  } else if (KEYS[key]) {
    setTool(KEYS[key]);
  } else if (key === 'l') {
    setLive(liveButton.getAttribute('aria-pressed') !== 'true');
  } else if (key === 'escape') {
    scheduler.cancel();
  } else if (key === ' ') {
    e.preventDefault();
    painter.spaceHeld = true;
  } else if (key === '+' || key === '=') {
    painter.zoomAt(1.25);
  } else if (key === '-') {
    painter.zoomAt(0.8);
  } else if (key === '0') {
    painter.fit();
  }
});
document.addEventListener('keyup', (e) => { if (e.key === ' ') painter.spaceHeld = false; });
addEventListener('resize', () => painter.fit());

// ---- start ---------------------------------------------------------------------------------

async function restoreDocument() {
  const doc = await store.load();
  if (!doc) return false;
  painter.setSizeRaw(doc.width, doc.height, false);
  painter.layers.forEach((l, i) => {
    const c = l.canvas.getContext('2d');
    c.clearRect(0, 0, doc.width, doc.height);
    if (doc.layers[i]) c.drawImage(doc.layers[i], 0, 0);
  });
  if (doc.mask) {
    painter.mask.ctx().clearRect(0, 0, doc.width, doc.height);
    painter.mask.ctx().drawImage(doc.mask, 0, 0);
    painter.mask.changed();
  }
  painter.changed();
  return true;
}

/** Shows the last result again after a reload (if the gallery still has it). */
async function restoreResult() {
  let saved = null;
  try { saved = JSON.parse(localStorage.getItem('brume.result') || 'null'); } catch { saved = null; }
  if (!saved || !saved.url || lastResult) return;
  try {
    const url = await imageUrl(saved.url);
    const probe = new Image();
    probe.src = url;
    await probe.decode();
    if (lastResult) return;
    resultImg.src = url;
    overlay.src = url;
    resultImg.dataset.kind = 'restored';
    lastResult = { url: saved.url, galleryId: saved.galleryId ?? null, kind: 'restored', version: -1 };
    $('result-caption').textContent = 'Last result (before the reload)';
    $('apply').disabled = false;
  } catch {
    localStorage.removeItem('brume.result'); // deleted from the gallery meanwhile
  }
}

async function connect() {
  for (;;) {
    try {
      const [models, samplers, capabilities] = await Promise.all([api.models(), api.samplers(), api.capabilities()]);
      return { models, samplers, capabilities };
    } catch (err) {
      showError(err);
      await new Promise((r) => setTimeout(r, 2000));
    }
  }
}

async function start() {
  // On a phone the sampling details start folded, so Prompt, Generate and Live sit under the result.
  if (matchMedia('(max-width: 700px)').matches) for (const d of document.querySelectorAll('#settings details')) d.open = false;
  const restored = await restoreDocument();
  const service = await connect();
  settings.init(service);
  gallery.filters(service.models.models || [], service.samplers.samplers || []);
  if (!restored) {
    const m = settings.model();
    const size = (m && m.default_size) || 128;
    painter.setSizeRaw(size, size, false);
  }
  $('size-select').value = String(painter.width);
  painter.fit();
  restoreResult();
  history.reset(restored ? 'Restored canvas' : 'New canvas');
  updateButtons();
  document.body.dataset.ready = 'true';
}

window.brume = { painter, history, scheduler, settings, gallery, socket };
start().catch(showError);
