// posenc viewer: a layer's mixer's own matrices (Predict's mixer_maps, docs/mixers.md): one per channel of a short
// convolution, per head of a Mamba-2 or Gated DeltaNet layer, a Mamba-2 layer beside an attention (Falcon-H1)
// included.  The layer's maps average them by groups (or, beside an attention, are the attention's); these are
// what the mixer computes, each applied to its values giving its output.  Asked for with a button (a convolution
// has d_model of them), drawn as a strip of thumbnails on the diverging ramp, each scaled by its own max |m|;
// one clicked is drawn large in the map above, as a mixer layer's map is.
import {api, floats} from "./api.js";
import {drawThumb, maxAbs} from "./maps.js";
import {isMixer, valueText} from "./layers.js";
import {$} from "./util.js";

const MAX_DRAWN = 64;  // thumbnails drawn at most (the first ones; the note says how many there are)
const SIZE = 48;  // CSS pixels of a thumbnail

export class MixerView {
  constructor(panel) {
    this.panel = panel;
    this.key = null;  // the layer and window whose matrices are held
    this.held = new Map();  // mixer head -> {values, rows, start}
    this.chosen = null;  // the mixer head drawn large, or null: the layer's maps are
  }

  count(layer) { return (this.panel.info.layer_mixer_maps || [])[layer] || 0; }

  // What the matrices are called for the panel's layer: its mixer's name, or the mixer beside its attention.
  what(layer) {
    const kind = this.panel.kinds[layer];
    return isMixer(kind) ? kind.mixer : "mixer beside the attention";
  }

  // The section for the panel's layer and window: a button where the layer has matrices, hidden elsewhere; what
  // is held for another layer or window is let go.
  build() {
    // the key names the intervention run too: a load in flight for another run's matrices is dropped
    const p = this.panel, n = this.count(p.layer), key = `${p.layer}:${p.window.start}:${p.window.count}:${p.runs}`;
    const box = $(".mixer-maps", p.el);
    box.hidden = n === 0;
    if (key === this.key) return;
    this.key = key; this.held = new Map(); this.chosen = null;
    Object.assign(box.dataset, {layer: p.layer, count: n, state: "none"});
    $(".mixer-thumbs", p.el).replaceChildren();
    $(".mixer-note", p.el).textContent = "";
    const button = $(".mixer-load", p.el);
    button.textContent = `Show layer ${p.layer}'s ${n} ${this.what(p.layer)} matrices`;
    button.onclick = () => this.load();
  }

  // The chosen matrix as the panel draws a map ({values, rows, start}), or null.
  shown() { return this.chosen === null ? null : this.held.get(this.chosen); }

  clear() {
    this.chosen = null;
    this.mark();
  }

  async load() {
    const p = this.panel, key = this.key, {start, count} = p.window, box = $(".mixer-maps", p.el);
    const body = {model: p.info.name, prompt: {text: p.prompt}, top_k: 1, attention: "ATTENTION_FULL",
                  query_start: start, query_count: count, layers: [p.layer], heads: [0], mixer_maps: true};
    const intervention = p.iv.body();
    if (intervention) body.intervention = intervention;
    box.dataset.state = "loading";
    let r;
    try {
      r = await api("/v1/posenc/predict", body);
    } catch (err) {
      if (key !== this.key) return;
      box.dataset.state = "error";
      $(".mixer-note", p.el).textContent = err.message;
      return;
    }
    if (key !== this.key) return;  // the layer or window changed meanwhile
    const all = r.mixer_maps || [];
    all.forEach((a) => this.held.set(a.head, {values: floats(a.data), rows: a.shape[0], start: a.query_start}));
    const drawn = all.slice(0, MAX_DRAWN);
    $(".mixer-thumbs", p.el).replaceChildren(...drawn.map((a) => {
      const m = this.held.get(a.head), scale = maxAbs(m.values);
      const b = document.createElement("button"), c = document.createElement("canvas");
      b.type = "button";
      Object.assign(b.dataset, {layer: a.layer, head: a.head, scale: String(scale)});
      b.title = `layer ${a.layer}, ${this.what(a.layer)} ${a.head}: signed, max |m| = ${valueText(scale)}`;
      b.setAttribute("aria-label", b.title);
      drawThumb(c, SIZE, m.values, m.rows, p.T, scale);
      b.append(c);
      b.onclick = () => { this.chosen = a.head; this.mark(); p.select(); };
      return b;
    }));
    $(".mixer-note", p.el).textContent = `${all.length} matrices of layer ${p.layer}'s ${this.what(p.layer)}, ` +
      "each signed and scaled by its own max |m|" + (all.length > drawn.length ? `; the first ${drawn.length} drawn` : "") +
      "; click one to draw it large";
    box.dataset.state = "done";
    this.mark();
  }

  mark() {
    document.querySelectorAll(`.panel[data-model="${this.panel.info.name}"] .mixer-thumbs button`).forEach((b) => {
      b.setAttribute("aria-pressed", String(Number(b.dataset.head) === this.chosen));
    });
  }
}
