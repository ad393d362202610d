// posenc viewer: a panel's interventions (docs/interventions.md).  The shift and stretch sliders, a switch of each
// layer's encoding and the heads ablated (a click on a thumbnail, in ablation mode) make the posenc JSON API's
// `intervention` object; with any of them set, every request of the panel goes with baseline=true and the page
// shows the unchanged run beside the changed one, with their difference.  The numbers shown are also kept, at full
// precision, in data-* attributes (the browser test reads them).
import {isMixer, valueText} from "./layers.js";
import {drawDiff, drawThumb, maxAbs} from "./maps.js";
import {$, $$, label} from "./util.js";

// Which controls a model gets comes from its ListModels entry (`interventions`: positions, positional_off; absent
// where the model has no intervention graph); a field the worker still refuses shows its error line in the panel.
const SHIFT_MAX = 512;  // the shift slider's end for a model without a limit on positions
const SETTLE_MS = 250;  // a control's changes within this time make one request
const SMALL = 210;  // CSS pixels of the baseline and difference maps

export class Interventions {
  constructor(panel) {
    this.panel = panel;
    this.box = $(".intervene", panel.el);
    Object.assign(this, {shift: 0, stretch: 1, off: new Set(), ablated: new Set(), timer: 0});
  }

  // The controls for a prompt of T tokens: the shift slider ends where the last token would pass the model's
  // positions (max_model_len, else max_positions; SHIFT_MAX when it has no limit).
  build(T) {
    const info = this.panel.info, box = this.box, variant = info.variant, support = info.interventions;
    this.T = T;
    this.limit = info.max_model_len || info.max_positions || 0;
    const notes = [];
    const shift = $(".iv-shift", box), stretch = $(".iv-stretch", box);
    const takesPositions = Boolean(support && support.positions);
    if (!support) notes.push(`${info.name} has no intervention graph (exported with --interventions off)`);
    $$(".iv-positions", box).forEach((l) => { l.hidden = !takesPositions; });
    shift.disabled = stretch.disabled = !takesPositions;
    if (support && !takesPositions) notes.push(`${variant} takes no positions: nothing to shift or stretch`);
    this.fitShift();
    shift.oninput = () => { this.shift = Number(shift.value); this.label(); };
    stretch.oninput = () => { this.stretch = Number(stretch.value); this.fitShift(); this.label(); };
    shift.onchange = stretch.onchange = () => { shift.oninput(); stretch.oninput(); this.changed(); };  // released

    const layers = $(".iv-layers", box);
    layers.hidden = !(support && support.positional_off);
    if (support && layers.hidden) notes.push(`${variant}'s encoding is not computed inside the layers: none to switch off`);
    layers.replaceChildren(Object.assign(document.createElement("legend"), {textContent: "positions per layer"}),
      ...Array.from({length: info.n_layers}, (_, l) => {
        const tag = document.createElement("label"), tick = document.createElement("input");
        Object.assign(tick, {type: "checkbox", className: "iv-layer", checked: true});
        tick.dataset.layer = l;
        tick.onchange = () => { if (tick.checked) this.off.delete(l); else this.off.add(l); this.changed(); };
        const kind = this.panel.kinds[l];
        if (isMixer(kind)) {  // its order is its kernel's, not an encoding: the worker refuses to switch it off
          tick.disabled = true;
          tag.append(tick, ` layer ${l} (${kind.mixer})`);
          tag.title = `layer ${l} is a ${kind.mixer} mixer: its order comes from its kernel, not from a positional ` +
            "encoding, so there is none to switch off";
          return tag;
        }
        tag.append(tick, ` layer ${l}`);
        tag.title = `layer ${l}'s positional computation on (unticked: switched off, a NoPE ablation)`;
        return tag;
      }));
    $(".iv-reset", box).onclick = () => this.reset();
    $(".iv-note", box).textContent = notes.join("; ");
    this.label();
    this.panel.el.dataset.iv = "done";
    this.panel.el.dataset.intervention = "";
  }

  fitShift() {
    const shift = $(".iv-shift", this.box), top = Math.round((this.T - 1) * this.stretch);
    shift.max = this.limit ? Math.max(0, this.limit - 1 - top) : SHIFT_MAX;
    this.shift = Number(shift.value);  // the browser keeps the value within the new end
  }

  label() {
    $(".iv-shift-value", this.box).textContent = String(this.shift);
    $(".iv-stretch-value", this.box).textContent = `×${this.stretch}`;
  }

  // The request's intervention object, or null when nothing is changed.
  body() {
    const iv = {};
    if (this.shift) iv.shift = this.shift;
    if (this.stretch !== 1) iv.stretch = this.stretch;
    if (this.off.size) iv.positional_off = [...this.off].sort((a, b) => a - b);
    if (this.ablated.size) {
      const pairs = [...this.ablated].map((k) => k.split(",").map(Number));
      iv.ablate_heads = pairs.sort((a, b) => a[0] - b[0] || a[1] - b[1]).map(([layer, head]) => ({layer, head}));
    }
    return Object.keys(iv).length ? {...iv, baseline: true} : null;
  }

  get ablating() { return $(".iv-ablating", this.box).checked; }

  toggleHead(layer, head) {
    const k = `${layer},${head}`;
    if (!this.ablated.delete(k)) this.ablated.add(k);
    this.markThumbs();
    this.changed();
  }

  markThumbs() {
    $$(".thumbs button", this.panel.el).forEach((b) => {
      const off = this.ablated.has(`${b.dataset.layer},${b.dataset.head}`);
      b.classList.toggle("ablated", off);
      b.dataset.ablated = String(off);
      b.setAttribute("aria-label", `layer ${b.dataset.layer} head ${b.dataset.head}${off ? ", ablated" : ""}`);
    });
  }

  reset() {
    const was = this.body() !== null;
    Object.assign(this, {shift: 0, stretch: 1});
    this.off.clear(); this.ablated.clear();
    $(".iv-shift", this.box).value = 0; $(".iv-stretch", this.box).value = 1;
    $$(".iv-layer", this.box).forEach((b) => { b.checked = true; });
    $(".iv-ablating", this.box).checked = false;
    this.fitShift(); this.label(); this.markThumbs();
    if (was || this.panel.el.dataset.iv === "error") this.changed();
  }

  // A control moved: one request once they settle.
  changed() {
    this.panel.el.dataset.iv = "pending";
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.panel.rerun(), SETTLE_MS);
  }

  done() {
    const body = this.body();
    $(".iv-error", this.box).textContent = "";
    this.panel.el.dataset.intervention = body ? JSON.stringify(body) : "";
    this.panel.el.dataset.iv = "done";
  }

  // The worker refused the intervention: its error line, and the last answer stays shown.
  fail(message) {
    $(".iv-error", this.box).textContent = `${message} (the last answer stays shown)`;
    this.panel.el.dataset.iv = "error";
  }

  // The effect of an answer: the baseline's top-k beside the intervened one, KL, total variation, JS, whether the
  // most likely token changed, and the positions the intervened run used.
  showEffect(effect, drawTop) {
    const el = this.panel.el, line = $(".effect", el), has = Boolean(effect && effect.has_baseline);
    $(".run-base", el).hidden = !has;
    $$(".run-name", el).forEach((h) => { h.hidden = !has; });
    $(".tops", el).classList.toggle("both", has);
    line.hidden = !has;
    if (!has) {
      drawTop([], $(".top-base", el));
      for (const k of ["kl", "tv", "js", "top1Changed", "positions", "description"]) delete line.dataset[k];
      return;
    }
    drawTop(effect.baseline_top, $(".top-base", el));
    const positions = effect.positions.map(Number);
    Object.assign(line.dataset, {kl: String(effect.kl_divergence), tv: String(effect.total_variation),
                                 js: String(effect.js_divergence), top1Changed: String(effect.top1_changed),
                                 positions: positions.join(","), description: effect.description});
    const shown = positions.length > 8 ? `${positions.slice(0, 6).join(", ")}, …, ${positions.at(-1)}`
      : positions.join(", ");
    line.textContent = `${effect.description}: KL ${effect.kl_divergence.toFixed(4)} nats · total variation ` +
      `${effect.total_variation.toFixed(4)} · JS ${effect.js_divergence.toFixed(4)} · top-1 ` +
      `${effect.top1_changed ? "changed" : "unchanged"} · positions ${shown}`;
  }

  // The chosen layer and head's map of the baseline beside the large (intervened) one, and intervened - baseline.
  // signed: a mixer layer's map, the baseline's drawn signed on its own largest |m| as the large one is.
  drawMaps(now, base, T, where, signed) {
    const box = $(".iv-maps", this.panel.el), out = $(".attention-row", this.panel.el);
    box.hidden = !base;
    if (!base) { delete out.dataset.baselineWeights; return; }
    const diff = new Float64Array(now.values.length);
    let scale = 0;
    for (let i = 0; i < diff.length; i++) {
      diff[i] = now.values[i] - base.values[i];
      scale = Math.max(scale, Math.abs(diff[i]));
    }
    const baseCanvas = $(".map-base", box), diffCanvas = $(".map-diff", box);
    const baseScale = signed ? maxAbs(base.values) : null;
    drawThumb(baseCanvas, SMALL, base.values, base.rows, T, baseScale);
    if (signed) baseCanvas.dataset.scale = String(baseScale); else delete baseCanvas.dataset.scale;
    baseCanvas.title = signed ? `signed matrix rows, scaled by max |m| = ${valueText(baseScale)}` : "";
    drawDiff(diffCanvas, SMALL, diff, now.rows, T, scale);
    const i = where.query - now.start;
    out.dataset.baselineWeights = Array.from(base.values.subarray(i * T, (i + 1) * T)).map(String).join(",");
    for (const c of [baseCanvas, diffCanvas]) Object.assign(c.dataset, {layer: where.layer, head: where.head});
    diffCanvas.dataset.scale = String(scale);
    $(".diff-scale", box).textContent = `±${scale.toFixed(4)}: blue lower, red higher than the baseline`;
    baseCanvas.setAttribute("aria-label", `baseline attention map, layer ${where.layer} head ${where.head}`);
    diffCanvas.setAttribute("aria-label", `intervened minus baseline, layer ${where.layer} head ${where.head}, ` +
      `largest change ${scale.toFixed(4)}; query "${label(where.piece)}"`);
  }
}
