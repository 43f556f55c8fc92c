// The gallery view over the service's gallery: a thumbnail grid that loads the next page when its
// end scrolls into view, search and filters, favourites, and a dialog per picture with its
// recipe, "Reuse settings", "Edit this", downloads with or without metadata, and delete.

import { api, imageUrl } from './api.js';

const PAGE = 30;
const $ = (id) => document.getElementById(id);

export class Gallery {
  constructor({ onReuse, onEdit, onError, onNotice }) {
    this.onReuse = onReuse;
    this.onEdit = onEdit;
    this.onError = onError;
    this.onNotice = onNotice;
    this.grid = $('gallery-grid');
    this.more = $('gallery-more');
    this.dialog = $('gallery-dialog');
    this.search = $('gallery-search');
    this.favourites = $('gallery-favourites');
    this.modelFilter = $('gallery-model');
    this.samplerFilter = $('gallery-sampler');
    this.cursor = null;
    this.done = false;
    this.loading = false;
    this.stale = true;
    this.generation = 0; // bumped by every reset, so a late page of an old search is dropped
    this.current = null;
    this.observer = new IntersectionObserver((entries) => {
      if (entries.some((e) => e.isIntersecting)) this.load();
    }, { rootMargin: '400px' });
    this.observer.observe(this.more);
    let timer = null;
    this.search.addEventListener('input', () => {
      clearTimeout(timer);
      timer = setTimeout(() => this.reset(), 250);
    });
    $('gallery-filters').addEventListener('submit', (e) => { e.preventDefault(); this.reset(); });
    for (const el of [this.favourites, this.modelFilter, this.samplerFilter]) el.addEventListener('change', () => this.reset());
    $('gallery-close').addEventListener('click', () => this.dialog.close());
    $('gallery-reuse').addEventListener('click', () => { if (this.current) { this.onReuse(this.current); this.dialog.close(); } });
    $('gallery-edit').addEventListener('click', () => this.edit());
    $('gallery-delete').addEventListener('click', () => this.remove());
    $('gallery-favourite').addEventListener('click', () => this.toggleFavourite());
  }

  /** Fills the model and sampler filters from the service's lists. */
  filters(models, samplers) {
    this.modelFilter.append(...models.map((m) => new Option(m.name, m.name)));
    this.samplerFilter.append(...samplers.map((s) => new Option(s.label || s.name, s.name)));
  }

  /** The gallery changed (a new picture): reload the next time it is shown. */
  invalidate() {
    this.stale = true;
  }

  show() {
    if (this.stale) this.reset();
  }

  reset() {
    this.stale = false;
    this.generation += 1;
    this.cursor = null;
    this.done = false;
    this.loading = false;
    this.grid.replaceChildren();
    this.load();
  }

  params() {
    const p = { limit: String(PAGE) };
    const q = this.search.value.trim();
    if (q) p.q = q;
    if (this.favourites.checked) p.favourite = 'true';
    if (this.modelFilter.value) p.model = this.modelFilter.value;
    if (this.samplerFilter.value) p.sampler = this.samplerFilter.value;
    if (this.cursor) p.cursor = this.cursor;
    return p;
  }

  async load() {
    if (this.loading || this.done || this.grid.closest('[hidden]')) return;
    this.loading = true;
    const generation = this.generation;
    this.more.textContent = 'Loading…';
    try {
      const page = await api.gallery(this.params());
      if (generation !== this.generation) return;
      for (const item of page.items || []) this.grid.append(await this.card(item));
      this.cursor = page.next_cursor || null;
      this.done = !this.cursor;
      this.more.textContent = this.done ? (this.grid.children.length ? 'No more pictures' : 'No pictures yet') : '';
    } catch (err) {
      if (generation === this.generation) {
        this.more.textContent = 'Could not load the gallery';
        this.onError(err);
      }
    } finally {
      if (generation === this.generation) this.loading = false;
    }
    // The end may still be in view (a short page): keep filling.
    if (!this.done && generation === this.generation) {
      const r = this.more.getBoundingClientRect();
      if (r.top < innerHeight + 400) this.load();
    }
  }

  async card(item) {
    const li = document.createElement('li');
    li.dataset.id = String(item.id);
    const open = document.createElement('button');
    open.type = 'button';
    open.className = 'thumb';
    open.setAttribute('aria-label', `Open: ${item.prompt || 'untitled'}`);
    const img = document.createElement('img');
    img.alt = item.prompt || 'untitled';
    img.loading = 'lazy';
    img.width = 128;
    img.height = 128;
    img.src = await imageUrl(item.thumb_url);
    open.append(img);
    open.addEventListener('click', () => this.open(item.id));
    const fav = document.createElement('button');
    fav.type = 'button';
    fav.className = 'fav';
    fav.textContent = '★';
    fav.setAttribute('aria-label', 'Favourite');
    fav.setAttribute('aria-pressed', String(!!item.favourite));
    fav.addEventListener('click', async () => {
      const on = fav.getAttribute('aria-pressed') !== 'true';
      try {
        await api.patchGallery(item.id, { favourite: on });
        fav.setAttribute('aria-pressed', String(on));
      } catch (err) {
        this.onError(err);
      }
    });
    const caption = document.createElement('span');
    caption.className = 'caption';
    caption.textContent = item.prompt || '';
    li.append(open, fav, caption);
    return li;
  }

  async open(id) {
    try {
      const item = await api.galleryItem(id);
      this.current = item;
      $('gallery-title').textContent = item.prompt || 'Untitled';
      $('gallery-image').src = await imageUrl(item.image_url);
      $('gallery-image').alt = item.prompt || 'Gallery image';
      const rows = [
        ['Prompt', item.prompt], ['Negative prompt', item.negative_prompt], ['Model', item.model],
        ['Sampler', item.sampler], ['Steps', item.steps], ['Guidance', item.guidance], ['Seed', item.seed],
        ['Size', item.width && `${item.width}×${item.height}`], ['Mode', item.mode], ['Created', item.created_at],
        ['Lineage', Array.isArray(item.lineage) && item.lineage.length > 1 ? item.lineage.join(' → ') : null],
      ].filter(([, v]) => v !== null && v !== undefined && v !== '');
      $('gallery-recipe').replaceChildren(...rows.flatMap(([k, v]) => {
        const dt = document.createElement('dt');
        dt.textContent = k;
        const dd = document.createElement('dd');
        dd.textContent = String(v);
        return [dt, dd];
      }));
      $('gallery-parameters').textContent = item.parameters || (item.recipe ? JSON.stringify(item.recipe, null, 2) : '');
      $('gallery-favourite').setAttribute('aria-pressed', String(!!item.favourite));
      const withMeta = $('gallery-download');
      const plain = $('gallery-download-plain');
      withMeta.href = await imageUrl(item.image_url);
      withMeta.download = `brume-${item.id}.png`;
      const sep = item.image_url.includes('?') ? '&' : '?';
      plain.href = await imageUrl(`${item.image_url}${sep}metadata=false`);
      plain.download = `brume-${item.id}-plain.png`;
      if (!this.dialog.open) this.dialog.showModal();
    } catch (err) {
      this.onError(err);
    }
  }

  async edit() {
    const item = this.current;
    if (!item) return;
    try {
      const res = await fetch($('gallery-image').src);
      this.onEdit(item, await res.blob());
      this.dialog.close();
    } catch (err) {
      this.onError(err);
    }
  }

  async toggleFavourite() {
    const item = this.current;
    if (!item) return;
    const on = !item.favourite;
    try {
      await api.patchGallery(item.id, { favourite: on });
      item.favourite = on;
      $('gallery-favourite').setAttribute('aria-pressed', String(on));
      const card = this.grid.querySelector(`li[data-id="${CSS.escape(String(item.id))}"] .fav`);
      if (card) card.setAttribute('aria-pressed', String(on));
    } catch (err) {
      this.onError(err);
    }
  }

  async remove() {
    const item = this.current;
    if (!item) return;
    try {
      await api.deleteGallery(item.id);
      const card = this.grid.querySelector(`li[data-id="${CSS.escape(String(item.id))}"]`);
      if (card) card.remove();
      this.dialog.close();
      this.current = null;
      this.onNotice(`Deleted picture ${item.id}`);
    } catch (err) {
      this.onError(err);
    }
  }
}
