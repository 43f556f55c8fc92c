// Keeps the last canvas across reloads: each layer and the mask as PNG blobs in IndexedDB
// (localStorage would need base64 and holds only a few MiB). Saving is debounced, so a burst of
// strokes writes once; a failure is reported, never thrown into the page.

const DB = 'brume-editor';
const STORE = 'documents';
const KEY = 'last';

function openDb() {
  return new Promise((resolve, reject) => {
    const req = indexedDB.open(DB, 1);
    req.onupgradeneeded = () => req.result.createObjectStore(STORE);
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });
}

function tx(db, mode, fn) {
  return new Promise((resolve, reject) => {
    const t = db.transaction(STORE, mode);
    const req = fn(t.objectStore(STORE));
    t.oncomplete = () => resolve(req.result);
    t.onerror = () => reject(t.error);
    t.onabort = () => reject(t.error);
  });
}

const toBlob = (canvas) => new Promise((resolve) => canvas.toBlob(resolve, 'image/png'));

export class DocumentStore {
  constructor(onError) {
    this.onError = onError;
    this.timer = null;
    /** Called with the document version each successful save wrote. */
    this.onSaved = () => {};
    this.db = openDb().catch((err) => {
      onError(new Error(`the browser's storage is unavailable, the canvas will not survive a reload (${err})`));
      return null;
    });
  }

  /** Saves `painter`'s document soon (once per burst of changes). */
  saveSoon(painter, delay = 200) {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.save(painter), delay);
  }

  /** Saves now if a save is waiting (the page is being hidden or closed). */
  flush(painter) {
    if (this.timer === null) return;
    clearTimeout(this.timer);
    this.timer = null;
    this.save(painter);
  }

  async save(painter) {
    this.timer = null;
    const db = await this.db;
    if (!db) return;
    try {
      const version = painter.version;
      const layers = await Promise.all(painter.layers.map((l) => toBlob(l.canvas)));
      const mask = await toBlob(painter.mask.canvas);
      const doc = { width: painter.width, height: painter.height, layers, mask, savedAt: Date.now() };
      await tx(db, 'readwrite', (s) => s.put(doc, KEY));
      this.onSaved(version);
    } catch (err) {
      this.onError(new Error(`could not save the canvas in the browser: ${err}`));
    }
  }

  /** The saved document as {width, height, layers: [ImageBitmap], mask: ImageBitmap}, or null. */
  async load() {
    const db = await this.db;
    if (!db) return null;
    try {
      const doc = await tx(db, 'readonly', (s) => s.get(KEY));
      if (!doc || !Array.isArray(doc.layers)) return null;
      const layers = await Promise.all(doc.layers.map((b) => createImageBitmap(b)));
      const mask = doc.mask ? await createImageBitmap(doc.mask) : null;
      return { width: doc.width, height: doc.height, layers, mask };
    } catch (err) {
      this.onError(new Error(`could not read the saved canvas: ${err}`));
      return null;
    }
  }
}
