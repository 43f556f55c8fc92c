// Undo and redo over whole-document snapshots, with a visible list the user can click to jump
// back or forward. A snapshot holds each layer's pixels and the size, so resizing (outpainting)
// undoes like any stroke; at the built-in 128 px a snapshot is 64 KiB a layer, and the list keeps
// the last LIMIT of them.

const LIMIT = 40;

export class History {
  /**
   * @param {HTMLOListElement} list  where the entries are shown
   * @param {() => object} capture   the document's current state
   * @param {(state: object) => void} restore  puts a state back
   */
  constructor(list, capture, restore) {
    this.list = list;
    this.capture = capture;
    this.restore = restore;
    this.entries = [];
    this.index = -1;
    this.onChange = () => {};
  }

  /** Starts over with the current state as the first entry. */
  reset(label = 'Open') {
    this.entries = [{ label, state: this.capture() }];
    this.index = 0;
    this.render();
  }

  /** Records the current state as the result of `label` (drops anything redo could reach). */
  push(label) {
    this.entries.splice(this.index + 1);
    this.entries.push({ label, state: this.capture() });
    if (this.entries.length > LIMIT) this.entries.splice(0, this.entries.length - LIMIT);
    this.index = this.entries.length - 1;
    this.render();
  }

  get canUndo() { return this.index > 0; }
  get canRedo() { return this.index < this.entries.length - 1; }

  undo() { if (this.canUndo) this.go(this.index - 1); }
  redo() { if (this.canRedo) this.go(this.index + 1); }

  go(index) {
    if (index < 0 || index >= this.entries.length || index === this.index) return;
    this.index = index;
    this.restore(this.entries[index].state);
    this.render();
    this.onChange();
  }

  render() {
    const items = this.entries.map((entry, i) => {
      const li = document.createElement('li');
      const button = document.createElement('button');
      button.type = 'button';
      button.textContent = entry.label;
      button.setAttribute('aria-label', `Step ${i + 1}: ${entry.label}`);
      button.setAttribute('aria-current', i === this.index ? 'step' : 'false');
      if (i > this.index) button.classList.add('undone');
      button.addEventListener('click', () => this.go(i));
      li.append(button);
      return li;
    });
    this.list.replaceChildren(...items);
    // Keep the current entry in view inside the list (never scroll the page itself).
    const current = this.list.children[this.index];
    if (current && this.list.scrollHeight > this.list.clientHeight) {
      this.list.scrollTop = current.offsetTop - this.list.offsetTop - this.list.clientHeight / 2;
    }
  }
}
