// The settings panel: prompt, negative prompt, model, sampler, steps, guidance, strength, seed
// (locked or new each time), mode and size. Defaults come from the service's /api/v1/models,
// which carries each UNet's own sampling_defaults.json; the user's choices are kept in
// localStorage so a reload keeps them.

const KEY = 'brume.settings';
const $ = (id) => document.getElementById(id);

export class Settings {
  constructor() {
    this.models = [];
    this.capabilities = { max_side: 4096, max_steps: 150 };
    this.el = {
      prompt: $('prompt'),
      negative: $('negative'),
      model: $('model'),
      sampler: $('sampler'),
      steps: $('steps'),
      guidance: $('guidance'),
      strength: $('strength'),
      mode: $('mode'),
      seed: $('seed'),
      seedLock: $('seed-lock'),
      size: $('size-select'),
      feather: $('feather'),
    };
    this.onModel = () => {};
  }

  /** Fills the selects from the service and restores the saved choices (or the defaults). */
  init({ models, samplers, capabilities }) {
    this.models = models.models || [];
    if (capabilities) this.capabilities = capabilities;
    const { model, sampler, size } = this.el;
    model.replaceChildren(...this.models.map((m) => new Option(m.default ? `${m.name} (default)` : m.name, m.name)));
    const def = this.models.find((m) => m.default) || this.models[0];
    if (def) model.value = def.name;
    const names = (samplers.samplers || []).map((s) => [s.name, s.label || s.name]);
    for (const m of this.models) {
      for (const u of m.unets || []) if (u.sampler && !names.some(([n]) => n === u.sampler)) names.push([u.sampler, u.sampler]);
    }
    sampler.replaceChildren(...names.map(([n, label]) => new Option(label, n)));
    const sizes = new Set([64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 1024].filter((s) => s <= this.capabilities.max_side && s >= (this.capabilities.min_side || 8)));
    for (const m of this.models) if (m.default_size) sizes.add(m.default_size);
    size.replaceChildren(...[...sizes].sort((a, b) => a - b).map((s) => new Option(`${s}×${s}`, String(s))));
    this.el.steps.max = String(this.capabilities.max_steps || 150);
    this.applyDefaults();
    this.restore();
    model.addEventListener('change', () => {
      this.applyDefaults();
      this.onModel(this.model());
    });
  }

  model() {
    return this.models.find((m) => m.name === this.el.model.value) || this.models[0] || null;
  }

  /** The UNet a full-quality job runs: the model's first ordinary one. */
  fullUnet(model = this.model()) {
    const unets = (model && model.unets) || [];
    return unets.find((u) => !u.few_step) || unets[0] || null;
  }

  /** The few-step UNet live mode runs (e.g. the built-in `unet_lcm`), if the model has one. */
  fastUnet(model = this.model()) {
    const unets = (model && model.unets) || [];
    return unets.find((u) => u.few_step) || null;
  }

  applyDefaults() {
    const m = this.model();
    const u = this.fullUnet(m);
    if (!m || !u) return;
    this.el.steps.value = u.steps ?? '';
    this.el.guidance.value = u.guidance ?? '';
    this.el.strength.value = u.strength ?? '';
    if (u.sampler) this.el.sampler.value = u.sampler;
    if (m.default_size) this.el.size.value = String(m.default_size);
  }

  /** The settings as the job body wants them (numbers, nulls for "the UNet's default"). */
  values() {
    const num = (el) => (el.value === '' ? null : Number(el.value));
    return {
      prompt: this.el.prompt.value.trim(),
      negative_prompt: this.el.negative.value.trim() || null,
      model: this.el.model.value || null,
      sampler: this.el.sampler.value || null,
      steps: num(this.el.steps),
      guidance: num(this.el.guidance),
      strength: num(this.el.strength),
      mode: this.el.mode.value,
      seed: num(this.el.seed) ?? 0,
      seedLocked: this.el.seedLock.checked,
      size: Number(this.el.size.value) || 128,
      feather: num(this.el.feather) ?? 4,
    };
  }

  /** A new random seed unless the seed is locked; the one to use either way. */
  seedForGenerate() {
    if (!this.el.seedLock.checked) this.el.seed.value = String(Math.floor(Math.random() * 2 ** 31));
    this.save();
    return Number(this.el.seed.value) || 0;
  }

  /** "Reuse settings" from a gallery item. */
  fromItem(item) {
    const set = (el, v) => { if (v !== undefined && v !== null) el.value = String(v); };
    set(this.el.prompt, item.prompt);
    this.el.negative.value = item.negative_prompt || '';
    if (item.model && [...this.el.model.options].some((o) => o.value === item.model)) this.el.model.value = item.model;
    if (item.sampler && [...this.el.sampler.options].some((o) => o.value === item.sampler)) this.el.sampler.value = item.sampler;
    set(this.el.steps, item.steps);
    set(this.el.guidance, item.guidance);
    set(this.el.seed, item.seed);
    this.el.seedLock.checked = true;
    this.save();
  }

  save() {
    const v = this.values();
    localStorage.setItem(KEY, JSON.stringify({ ...v }));
  }

  restore() {
    let saved;
    try { saved = JSON.parse(localStorage.getItem(KEY) || 'null'); } catch { saved = null; }
    if (!saved) return;
    const set = (el, v) => { if (v !== undefined && v !== null) el.value = String(v); };
    set(this.el.prompt, saved.prompt);
    set(this.el.negative, saved.negative_prompt);
    if ([...this.el.model.options].some((o) => o.value === saved.model)) this.el.model.value = saved.model;
    if ([...this.el.sampler.options].some((o) => o.value === saved.sampler)) this.el.sampler.value = saved.sampler;
    set(this.el.steps, saved.steps);
    set(this.el.guidance, saved.guidance);
    set(this.el.strength, saved.strength);
    set(this.el.mode, saved.mode);
    set(this.el.seed, saved.seed);
    set(this.el.feather, saved.feather);
    if (typeof saved.seedLocked === 'boolean') this.el.seedLock.checked = saved.seedLocked;
  }
}
