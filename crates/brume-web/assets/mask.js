// The inpainting mask: a canvas whose alpha says where to repaint. It is painted and erased with
// the Mask / Unmask tools, shown as a red veil over the canvas (or hidden), inverted, and sent to
// the service as the contract's PNG: white = repaint, black = keep, the document's size. The
// feather (soft edge) is the service's: brume pastes the result back through a feathered mask,
// so the pixels outside stay exactly as they were.

function makeCanvas(w, h) {
  const c = document.createElement('canvas');
  c.width = w;
  c.height = h;
  return c;
}

export class Mask {
  constructor(width, height) {
    this.canvas = makeCanvas(width, height);
    this.tint = makeCanvas(width, height);
    this.visible = true;
    this.empty = true;
  }

  ctx() {
    return this.canvas.getContext('2d', { willReadFrequently: true });
  }

  capture() {
    return this.ctx().getImageData(0, 0, this.canvas.width, this.canvas.height);
  }

  restore(data, width, height) {
    this.canvas.width = width;
    this.canvas.height = height;
    if (data) this.ctx().putImageData(data, 0, 0);
    this.changed();
  }

  resize(width, height, resample) {
    const old = makeCanvas(this.canvas.width, this.canvas.height);
    old.getContext('2d').drawImage(this.canvas, 0, 0);
    this.canvas.width = width;
    this.canvas.height = height;
    if (resample) this.ctx().drawImage(old, 0, 0, width, height);
    else this.ctx().drawImage(old, 0, 0);
    this.changed();
  }

  /** Grows to width×height with the old mask at (dx, dy) and the new strip masked. */
  extend(width, height, dx, dy) {
    const old = makeCanvas(this.canvas.width, this.canvas.height);
    old.getContext('2d').drawImage(this.canvas, 0, 0);
    const [ow, oh] = [old.width, old.height];
    this.canvas.width = width;
    this.canvas.height = height;
    const c = this.ctx();
    c.fillStyle = '#ffffff';
    c.fillRect(0, 0, width, height);
    c.clearRect(dx, dy, ow, oh);
    c.drawImage(old, dx, dy);
    this.changed();
  }

  clear() {
    this.ctx().clearRect(0, 0, this.canvas.width, this.canvas.height);
    this.changed();
  }

  invert() {
    const img = this.capture();
    const d = img.data;
    for (let i = 0; i < d.length; i += 4) {
      d[i] = d[i + 1] = d[i + 2] = 255;
      d[i + 3] = 255 - d[i + 3];
    }
    this.ctx().putImageData(img, 0, 0);
    this.changed();
  }

  /** Recomputes whether anything is masked (Generate picks inpaint when something is). */
  changed() {
    const d = this.capture().data;
    let empty = true;
    for (let i = 3; i < d.length; i += 4) {
      if (d[i] >= 128) { empty = false; break; }
    }
    this.empty = empty;
  }

  /** The mask (plus a stroke being painted or erased) in red, for the overlay. */
  tinted(stroke, erasing) {
    const t = this.tint;
    if (t.width !== this.canvas.width || t.height !== this.canvas.height) {
      t.width = this.canvas.width;
      t.height = this.canvas.height;
    }
    const c = t.getContext('2d');
    c.globalCompositeOperation = 'copy';
    c.drawImage(this.canvas, 0, 0);
    if (stroke) {
      c.globalCompositeOperation = erasing ? 'destination-out' : 'source-over';
      c.drawImage(stroke, 0, 0);
    }
    c.globalCompositeOperation = 'source-in';
    c.fillStyle = '#ff1744';
    c.fillRect(0, 0, t.width, t.height);
    c.globalCompositeOperation = 'source-over';
    return t;
  }

  /** The contract's mask picture: opaque, white where masked (alpha >= 50 %), black elsewhere. */
  toCanvas() {
    const w = this.canvas.width;
    const h = this.canvas.height;
    const out = makeCanvas(w, h);
    const c = out.getContext('2d');
    const src = this.capture().data;
    const img = c.createImageData(w, h);
    for (let i = 0; i < src.length; i += 4) {
      const v = src[i + 3] >= 128 ? 255 : 0;
      img.data[i] = img.data[i + 1] = img.data[i + 2] = v;
      img.data[i + 3] = 255;
    }
    c.putImageData(img, 0, 0);
    return out;
  }
}
