// The painting surface: a document of layers (Background, Paint) plus the mask, drawn with
// brush, eraser, rectangle, ellipse and fill; pointer events for mouse, pen (pressure) and touch
// (one finger paints, two pan and zoom); the view pans and zooms with a CSS transform so the
// document keeps its own pixel size (the model's). A stroke is drawn on a scratch canvas and
// merged when the pointer lifts, so opacity applies to the stroke as a whole and a stroke cut
// short by a second finger leaves nothing behind.

import { Mask } from './mask.js';

const MAX_ZOOM = 32;
const MIN_ZOOM = 0.1;

function makeCanvas(w, h) {
  const c = document.createElement('canvas');
  c.width = w;
  c.height = h;
  return c;
}

function ctx2d(canvas) {
  return canvas.getContext('2d', { willReadFrequently: true });
}

function hexToRgb(hex) {
  const n = parseInt(hex.slice(1), 16);
  return [(n >> 16) & 255, (n >> 8) & 255, n & 255];
}

export class Painter {
  /**
   * @param {HTMLCanvasElement} display the visible canvas ("Canvas")
   * @param {HTMLElement} stage the element that receives pointer events and clips the view
   */
  constructor(display, stage, width, height) {
    this.display = display;
    this.stage = stage;
    this.width = width;
    this.height = height;
    this.layers = [
      { name: 'Background', canvas: makeCanvas(width, height) },
      { name: 'Paint', canvas: makeCanvas(width, height) },
    ];
    this.active = 1;
    this.mask = new Mask(width, height);
    this.stroke = makeCanvas(width, height);
    this.scratch = makeCanvas(width, height);
    this.tool = 'brush';
    this.colour = '#d62828';
    this.size = 8;
    this.opacity = 1;
    this.view = { zoom: 1, x: 0, y: 0 };
    this.spaceHeld = false;
    this.pointers = new Map();
    this.gesture = null; // the stroke, shape, pan or pinch in progress
    this.renderQueued = false;
    this.version = 0; // bumped on every change of pixels, for the live scheduler
    /** Called with a label when an action completes (history, live, persistence). */
    this.onCommit = () => {};
    /** Called while a stroke is under way (live may render a long stroke before it ends). */
    this.onProgress = () => {};
    /** Called when the view (pan/zoom) changes, so overlays can follow. */
    this.onView = () => {};
    this.listen();
    this.resizeDisplay();
  }

  // ---- document -------------------------------------------------------------------------

  resizeDisplay() {
    this.display.width = this.width;
    this.display.height = this.height;
    this.display.style.width = `${this.width}px`;
    this.display.style.height = `${this.height}px`;
    for (const c of [this.stroke, this.scratch]) {
      c.width = this.width;
      c.height = this.height;
    }
    this.requestRender();
  }

  /** The document's state, for history and persistence. */
  capture() {
    return {
      width: this.width,
      height: this.height,
      layers: this.layers.map((l) => ctx2d(l.canvas).getImageData(0, 0, this.width, this.height)),
      mask: this.mask.capture(),
    };
  }

  restore(state) {
    const sized = state.width !== this.width || state.height !== this.height;
    this.width = state.width;
    this.height = state.height;
    this.layers.forEach((l, i) => {
      l.canvas.width = this.width;
      l.canvas.height = this.height;
      if (state.layers[i]) ctx2d(l.canvas).putImageData(state.layers[i], 0, 0);
    });
    this.mask.restore(state.mask, this.width, this.height);
    this.resizeDisplay();
    if (sized) this.fit();
    this.changed();
  }

  changed() {
    this.version += 1;
    this.display.dataset.version = String(this.version);
    this.requestRender();
  }

  commit(label) {
    this.changed();
    this.onCommit(label);
  }

  /** True when nothing has been painted or loaded (then Generate draws from text alone). */
  isBlank() {
    return this.layers.every((l) => {
      const d = ctx2d(l.canvas).getImageData(0, 0, this.width, this.height).data;
      for (let i = 3; i < d.length; i += 4) if (d[i] !== 0) return false;
      return true;
    });
  }

  clear() {
    for (const l of this.layers) ctx2d(l.canvas).clearRect(0, 0, this.width, this.height);
    this.commit('Clear');
  }

  /** Draws a picture into the Background layer, scaled to cover the document (centre crop). */
  async loadImage(source, label = 'Load image') {
    const bitmap = await createImageBitmap(source);
    const scale = Math.max(this.width / bitmap.width, this.height / bitmap.height);
    const w = bitmap.width * scale;
    const h = bitmap.height * scale;
    for (const l of this.layers) ctx2d(l.canvas).clearRect(0, 0, this.width, this.height);
    const c = ctx2d(this.layers[0].canvas);
    c.imageSmoothingQuality = 'high';
    c.drawImage(bitmap, (this.width - w) / 2, (this.height - h) / 2, w, h);
    bitmap.close();
    this.commit(label);
  }

  /** Makes a picture the document's next state at its own size (a result, a gallery image). */
  async replaceWith(source, label) {
    const bitmap = await createImageBitmap(source);
    if (bitmap.width !== this.width || bitmap.height !== this.height) {
      this.setSizeRaw(bitmap.width, bitmap.height, false);
    }
    for (const l of this.layers) ctx2d(l.canvas).clearRect(0, 0, this.width, this.height);
    ctx2d(this.layers[0].canvas).drawImage(bitmap, 0, 0);
    bitmap.close();
    this.commit(label);
  }

  /** Changes the size, resampling the pixels (a new model size) or not (cropping). */
  setSizeRaw(width, height, resample) {
    const copy = (canvas) => {
      const old = makeCanvas(canvas.width, canvas.height);
      old.getContext('2d').drawImage(canvas, 0, 0);
      canvas.width = width;
      canvas.height = height;
      const c = ctx2d(canvas);
      if (resample) c.drawImage(old, 0, 0, width, height);
      else c.drawImage(old, 0, 0);
    };
    this.layers.forEach((l) => copy(l.canvas));
    this.mask.resize(width, height, resample);
    this.width = width;
    this.height = height;
    this.resizeDisplay();
    this.fit();
  }

  resize(width, height) {
    if (width === this.width && height === this.height) return;
    this.setSizeRaw(width, height, true);
    this.commit(`Resize to ${width}×${height}`);
  }

  /**
   * Outpainting: grows the document by `by` pixels on one side; the new strip is masked so the
   * next inpaint fills it and everything else stays as it was.
   */
  extend(side, by, maxSide) {
    const dx = side === 'left' ? by : 0;
    const dy = side === 'top' ? by : 0;
    const w = this.width + (side === 'left' || side === 'right' ? by : 0);
    const h = this.height + (side === 'top' || side === 'bottom' ? by : 0);
    if (w > maxSide || h > maxSide) throw new Error(`the canvas would be ${w}×${h}; the server allows at most ${maxSide} a side`);
    for (const l of this.layers) {
      const old = makeCanvas(this.width, this.height);
      old.getContext('2d').drawImage(l.canvas, 0, 0);
      l.canvas.width = w;
      l.canvas.height = h;
      ctx2d(l.canvas).drawImage(old, dx, dy);
    }
    this.mask.extend(w, h, dx, dy);
    this.width = w;
    this.height = h;
    this.resizeDisplay();
    this.fit();
    this.commit(`Extend ${side} ${by}px`);
  }

  /**
   * The picture the model sees: white under the layers, with a stroke still being drawn (so a
   * long stroke renders live before it ends), never the mask's veil.
   */
  flatten() {
    const out = makeCanvas(this.width, this.height);
    this.compose(out.getContext('2d'), false);
    return out;
  }

  // ---- drawing --------------------------------------------------------------------------

  targetCanvas() {
    return this.tool === 'mask' || this.tool === 'unmask' ? this.mask.canvas : this.layers[this.active].canvas;
  }

  /** Width of the brush at this pressure: pens vary it, mice and fingers draw at full size. */
  widthFor(e) {
    if (e.pointerType === 'pen') return Math.max(0.5, this.size * (e.pressure || 0.5) * 1.5);
    return this.size;
  }

  strokeTo(e, point) {
    const g = this.gesture;
    const c = this.stroke.getContext('2d');
    c.lineCap = 'round';
    c.lineJoin = 'round';
    c.strokeStyle = this.strokeColour();
    c.fillStyle = this.strokeColour();
    c.lineWidth = this.widthFor(e);
    c.beginPath();
    if (g.last) {
      c.moveTo(g.last.x, g.last.y);
      c.lineTo(point.x, point.y);
      c.stroke();
    } else {
      c.arc(point.x, point.y, c.lineWidth / 2, 0, Math.PI * 2);
      c.fill();
    }
    g.last = point;
  }

  strokeColour() {
    return this.tool === 'brush' || this.tool === 'rect' || this.tool === 'ellipse' ? this.colour : '#ffffff';
  }

  drawShape(from, to, square) {
    const c = this.stroke.getContext('2d');
    c.clearRect(0, 0, this.width, this.height);
    let w = to.x - from.x;
    let h = to.y - from.y;
    if (square) {
      const s = Math.max(Math.abs(w), Math.abs(h));
      w = Math.sign(w || 1) * s;
      h = Math.sign(h || 1) * s;
    }
    c.fillStyle = this.colour;
    c.beginPath();
    if (this.tool === 'rect') c.rect(from.x, from.y, w, h);
    else c.ellipse(from.x + w / 2, from.y + h / 2, Math.abs(w / 2), Math.abs(h / 2), 0, 0, Math.PI * 2);
    c.fill();
  }

  /** Merges the scratch stroke into its target with the tool's operation and opacity. */
  mergeStroke() {
    const target = this.targetCanvas();
    const c = target.getContext('2d');
    c.save();
    c.globalAlpha = this.tool === 'mask' || this.tool === 'unmask' ? 1 : this.opacity;
    c.globalCompositeOperation = this.tool === 'eraser' || this.tool === 'unmask' ? 'destination-out' : 'source-over';
    c.drawImage(this.stroke, 0, 0);
    c.restore();
    this.stroke.getContext('2d').clearRect(0, 0, this.width, this.height);
    if (target === this.mask.canvas) this.mask.changed();
  }

  /** Flood fill of the region the user sees (all layers) around `point`, into the active layer. */
  fill(point) {
    const x0 = Math.floor(point.x);
    const y0 = Math.floor(point.y);
    if (x0 < 0 || y0 < 0 || x0 >= this.width || y0 >= this.height) return;
    const { width: w, height: h } = this;
    const seen = this.flatten().getContext('2d').getImageData(0, 0, w, h).data;
    const target = ctx2d(this.layers[this.active].canvas);
    const out = target.getImageData(0, 0, w, h);
    const [r, g, b] = hexToRgb(this.colour);
    const a = Math.round(this.opacity * 255);
    const at = (x0 + y0 * w) * 4;
    const ref = [seen[at], seen[at + 1], seen[at + 2]];
    const tol = 48 * 48 * 3;
    const near = (i) => {
      const dr = seen[i] - ref[0];
      const dg = seen[i + 1] - ref[1];
      const db = seen[i + 2] - ref[2];
      return dr * dr + dg * dg + db * db <= tol;
    };
    const done = new Uint8Array(w * h);
    const stack = [x0 + y0 * w];
    while (stack.length) {
      const p = stack.pop();
      if (done[p]) continue;
      done[p] = 1;
      if (!near(p * 4)) continue;
      const i = p * 4;
      out.data[i] = r;
      out.data[i + 1] = g;
      out.data[i + 2] = b;
      out.data[i + 3] = Math.max(out.data[i + 3], a);
      const x = p % w;
      if (x > 0) stack.push(p - 1);
      if (x < w - 1) stack.push(p + 1);
      if (p >= w) stack.push(p - w);
      if (p < w * (h - 1)) stack.push(p + w);
    }
    target.putImageData(out, 0, 0);
    this.commit('Fill');
  }

  // ---- view -------------------------------------------------------------------------------

  fit() {
    const r = this.stage.getBoundingClientRect();
    if (r.width === 0 || r.height === 0) return;
    const zoom = Math.min(r.width / this.width, r.height / this.height) * 0.96;
    this.view.zoom = zoom;
    this.view.x = (r.width - this.width * zoom) / 2;
    this.view.y = (r.height - this.height * zoom) / 2;
    this.applyView();
  }

  zoomAt(factor, clientX, clientY) {
    const r = this.stage.getBoundingClientRect();
    const sx = clientX === undefined ? r.width / 2 : clientX - r.left;
    const sy = clientY === undefined ? r.height / 2 : clientY - r.top;
    const zoom = Math.min(MAX_ZOOM, Math.max(MIN_ZOOM, this.view.zoom * factor));
    const k = zoom / this.view.zoom;
    this.view.x = sx - (sx - this.view.x) * k;
    this.view.y = sy - (sy - this.view.y) * k;
    this.view.zoom = zoom;
    this.applyView();
  }

  /** Puts the view transform on the canvas and on any element that must follow it. */
  applyView(el = this.display) {
    el.style.transform = `translate(${this.view.x}px, ${this.view.y}px) scale(${this.view.zoom})`;
    if (el === this.display) this.onView();
  }

  toDoc(e) {
    const r = this.display.getBoundingClientRect();
    return {
      x: ((e.clientX - r.left) / r.width) * this.width,
      y: ((e.clientY - r.top) / r.height) * this.height,
    };
  }

  // ---- pointers ---------------------------------------------------------------------------

  listen() {
    const s = this.stage;
    s.addEventListener('pointerdown', (e) => this.down(e));
    s.addEventListener('pointermove', (e) => this.move(e));
    s.addEventListener('pointerup', (e) => this.up(e, false));
    s.addEventListener('pointercancel', (e) => this.up(e, true));
    s.addEventListener('wheel', (e) => {
      e.preventDefault();
      this.zoomAt(Math.exp(-e.deltaY * 0.0015), e.clientX, e.clientY);
    }, { passive: false });
    s.addEventListener('contextmenu', (e) => e.preventDefault());
  }

  down(e) {
    this.stage.setPointerCapture(e.pointerId);
    this.pointers.set(e.pointerId, { x: e.clientX, y: e.clientY });
    if (this.pointers.size === 2) {
      // A second finger: whatever the first one started is dropped, the two pan and zoom.
      this.stroke.getContext('2d').clearRect(0, 0, this.width, this.height);
      const [a, b] = [...this.pointers.values()];
      this.gesture = { kind: 'pinch', dist: Math.hypot(a.x - b.x, a.y - b.y), cx: (a.x + b.x) / 2, cy: (a.y + b.y) / 2 };
      this.requestRender();
      return;
    }
    if (this.pointers.size > 2) return;
    const point = this.toDoc(e);
    if (this.tool === 'pan' || this.spaceHeld || e.button === 1) {
      this.gesture = { kind: 'pan', x: e.clientX, y: e.clientY };
      return;
    }
    if (e.button !== 0 && e.pointerType === 'mouse') return;
    if (this.tool === 'fill') {
      this.fill(point);
      return;
    }
    if (this.tool === 'rect' || this.tool === 'ellipse') {
      this.gesture = { kind: 'shape', from: point, to: point };
      this.drawShape(point, point, e.shiftKey);
    } else {
      this.gesture = { kind: 'stroke', last: null };
      this.strokeTo(e, point);
    }
    this.requestRender();
  }

  move(e) {
    if (!this.pointers.has(e.pointerId)) return;
    this.pointers.set(e.pointerId, { x: e.clientX, y: e.clientY });
    const g = this.gesture;
    if (!g) return;
    if (g.kind === 'pinch') {
      const [a, b] = [...this.pointers.values()];
      const dist = Math.hypot(a.x - b.x, a.y - b.y);
      const cx = (a.x + b.x) / 2;
      const cy = (a.y + b.y) / 2;
      this.view.x += cx - g.cx;
      this.view.y += cy - g.cy;
      if (g.dist > 0) this.zoomAt(dist / g.dist, cx, cy);
      else this.applyView();
      Object.assign(g, { dist, cx, cy });
    } else if (g.kind === 'pan') {
      this.view.x += e.clientX - g.x;
      this.view.y += e.clientY - g.y;
      g.x = e.clientX;
      g.y = e.clientY;
      this.applyView();
    } else if (g.kind === 'shape') {
      g.to = this.toDoc(e);
      this.drawShape(g.from, g.to, e.shiftKey);
      this.requestRender();
    } else if (g.kind === 'stroke') {
      const events = e.getCoalescedEvents ? e.getCoalescedEvents() : [];
      for (const ce of events.length ? events : [e]) this.strokeTo(ce, this.toDoc(ce));
      this.requestRender();
      this.onProgress();
    }
  }

  up(e, cancelled) {
    if (!this.pointers.delete(e.pointerId)) return;
    const g = this.gesture;
    if (!g) return;
    if (g.kind === 'pinch') {
      if (this.pointers.size === 0) this.gesture = null;
      return;
    }
    this.gesture = null;
    if (g.kind === 'pan') return;
    if (cancelled) {
      this.stroke.getContext('2d').clearRect(0, 0, this.width, this.height);
      this.requestRender();
      return;
    }
    this.mergeStroke();
    const labels = { brush: 'Brush', eraser: 'Eraser', rect: 'Rectangle', ellipse: 'Ellipse', mask: 'Mask', unmask: 'Unmask' };
    this.commit(labels[this.tool] || 'Stroke');
  }

  // ---- rendering --------------------------------------------------------------------------

  requestRender() {
    if (this.renderQueued) return;
    this.renderQueued = true;
    requestAnimationFrame(() => {
      this.renderQueued = false;
      this.render();
    });
  }

  render() {
    this.compose(this.display.getContext('2d'), this.mask.visible);
  }

  compose(c, withMask) {
    c.globalCompositeOperation = 'source-over';
    c.globalAlpha = 1;
    c.fillStyle = '#ffffff';
    c.fillRect(0, 0, this.width, this.height);
    const stroking = this.gesture && (this.gesture.kind === 'stroke' || this.gesture.kind === 'shape');
    const onMask = this.tool === 'mask' || this.tool === 'unmask';
    this.layers.forEach((l, i) => {
      if (stroking && !onMask && i === this.active) {
        const s = this.scratch.getContext('2d');
        s.globalCompositeOperation = 'copy';
        s.globalAlpha = 1;
        s.drawImage(l.canvas, 0, 0);
        s.globalCompositeOperation = this.tool === 'eraser' ? 'destination-out' : 'source-over';
        s.globalAlpha = this.opacity;
        s.drawImage(this.stroke, 0, 0);
        c.drawImage(this.scratch, 0, 0);
      } else {
        c.drawImage(l.canvas, 0, 0);
      }
    });
    if (withMask) {
      c.globalAlpha = 0.45;
      c.drawImage(this.mask.tinted(stroking && onMask ? this.stroke : null, this.tool === 'unmask'), 0, 0);
      c.globalAlpha = 1;
    }
  }
}
