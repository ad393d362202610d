// posenc viewer: a model's attention profile (POST /v1/posenc/profile): per layer, the attention mass by distance
// in log-2 buckets and on the first position, reduced in the worker's graph, so any prompt length draws the same
// small grid.  Heads averaged, or one head; the cell under the cursor reads the exact value shown.  Under an
// intervention the baseline's grid and the difference (intervened - baseline) are drawn beside it.
import {api, floats} from "./api.js";
import {hybrid, isMixer} from "./layers.js";
import {diverging, heat, sized} from "./maps.js";
import {$} from "./util.js";

const SIDE = 440;  // CSS pixels of the grid, labels included
const LEFT = 62, TOP = 58;  // margins: layer names, column names

export class ProfileView {
  constructor(panel) {
    this.panel = panel;
    this.box = $(".profile", panel.el);
    this.canvas = $("canvas.profile-map", this.box);
    this.pick = $("select.profile-head", this.box);
    this.readout = $(".profile-readout", this.box);
    this.asked = 0;  // requests made: only the latest one's answer is drawn
  }

  async load(prompt) {
    this.box.dataset.state = "loading";
    const body = {model: this.panel.info.name, prompt: {text: prompt}}, intervention = this.panel.iv.body();
    const asked = ++this.asked, head = this.pick.value;
    if (intervention) body.intervention = intervention;
    let p;
    try {
      p = await api("/v1/posenc/profile", body);
    } catch (err) {
      if (asked !== this.asked) return;
      this.box.dataset.state = "error";
      $(".note", this.box).textContent = err.message;
      return;
    }
    if (asked !== this.asked) return;
    const [layers, heads, cols] = p.shape;
    const base = p.effect && p.effect.has_baseline ? floats(p.effect.baseline_profile) : null;
    Object.assign(this, {layers, heads, cols, values: floats(p.values), base, columns: p.columns});
    this.entropy = p.columns.indexOf("entropy");
    // drawn: every mass column (distance buckets, first, a learned sink's), not the entropy (nats)
    this.shown = p.columns.map((_, c) => c).filter((c) => c !== this.entropy);
    this.pick.replaceChildren(new Option("averaged", "mean", false, true),
                              ...Array.from({length: heads}, (_, h) => new Option(`head ${h}`, String(h))));
    if (head && Number(head) < heads) this.pick.value = head;  // the head chosen stays chosen
    this.pick.onchange = () => this.draw();
    $(".note", this.box).textContent = `${p.query_count} query rows averaged (from row ${p.query_start || 0}); ` +
      `distance d = query - key in buckets 0, 1, 2-3, 4-7, ...; "first" is the mass on position 0` +
      (hybrid(this.panel.kinds) ? "; a mixer layer's signed rows count as |m| / sum |m| (their share of the " +
        "row's weight)" : "");
    this.draw();
    this.box.dataset.state = "done";
  }

  // (layers x columns) of the chosen head, or the heads' mean, in float64 from the served float32 values (the
  // intervened run's, or the baseline's)
  grid(values = this.values) {
    const head = this.pick.value, out = new Float64Array(this.layers * this.cols);
    for (let l = 0; l < this.layers; l++) {
      for (let c = 0; c < this.cols; c++) {
        let s = 0;
        if (head === "mean") {
          for (let h = 0; h < this.heads; h++) s += values[(l * this.heads + h) * this.cols + c];
          s /= this.heads;
        } else {
          s = values[(l * this.heads + Number(head)) * this.cols + c];
        }
        out[l * this.cols + c] = s;
      }
    }
    return out;
  }

  // One grid on a canvas: a cell per layer and column shown, coloured by colour(value), named on its margins.
  paint(canvas, g, colour) {
    const n = this.shown.length;
    const cw = Math.max(14, Math.min(48, Math.floor((SIDE - LEFT) / n)));
    const ch = Math.max(10, Math.min(28, Math.floor((SIDE - TOP) / this.layers)));
    const W = LEFT + cw * n + 2, H = TOP + ch * this.layers + 2, ctx = sized(canvas, W, H);
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, H);
    for (let l = 0; l < this.layers; l++) {
      this.shown.forEach((c, i) => {
        ctx.fillStyle = colour(g[l * this.cols + c]);
        ctx.fillRect(LEFT + i * cw, TOP + l * ch, cw, ch);
      });
    }
    ctx.fillStyle = "#1d1f21"; ctx.font = "11px ui-monospace, monospace"; ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    const step = Math.ceil(12 / ch);
    for (let l = 0; l < this.layers; l += step) ctx.fillText(`layer ${l}`, LEFT - 4, TOP + (l + 0.5) * ch);
    this.shown.forEach((c, i) => {
      ctx.save();
      ctx.translate(LEFT + (i + 0.5) * cw, TOP - 4);
      ctx.rotate(-Math.PI / 2); ctx.textAlign = "left";
      ctx.fillText(this.columns[c], 0, 0);
      ctx.restore();
    });
    canvas.dataset.values = Array.from(g).join(",");
    return {cw, ch, W};
  }

  // The baseline's grid and intervened - baseline beside the intervened one, or neither without an intervention.
  drawBaseline(g, head) {
    const box = $(".iv-profiles", this.box);
    box.hidden = !this.base;
    if (!this.base) return null;
    const b = this.grid(this.base), d = g.map((v, i) => v - b[i]), base = $(".profile-base", box);
    const diff = $(".profile-diff", box);
    let scale = 0;  // the largest |difference| of a column drawn
    for (let l = 0; l < this.layers; l++) {
      for (const c of this.shown) scale = Math.max(scale, Math.abs(d[l * this.cols + c]));
    }
    this.paint(base, b, (v) => heat(Math.max(0, Math.min(1, v))));
    this.paint(diff, d, (v) => diverging(v, scale));
    for (const c of [base, diff]) {
      Object.assign(c.dataset, {layers: this.layers, head, columns: this.shown.map((k) => this.columns[k]).join(",")});
    }
    diff.dataset.scale = String(scale);
    $(".diff-scale", box).textContent = `±${scale.toFixed(4)} of the attention: blue lower, red higher`;
    base.setAttribute("aria-label", "baseline attention by distance");
    diff.setAttribute("aria-label", `attention by distance, intervened minus baseline, largest change ${scale}`);
    return b;
  }

  draw() {
    const g = this.grid(), n = this.shown.length, canvas = this.canvas;
    const {cw, ch, W} = this.paint(canvas, g, (v) => heat(Math.max(0, Math.min(1, v))));
    const head = this.pick.value;
    const b = this.drawBaseline(g, head);
    Object.assign(canvas.dataset, {layers: this.layers, columns: this.shown.map((c) => this.columns[c]).join(","),
                                   head, grid: [LEFT, TOP, cw, ch, W].join(",")});
    canvas.setAttribute("aria-label", `attention by distance, ${this.layers} layers, ` +
      (head === "mean" ? "heads averaged" : `head ${head}`));
    canvas.onmousemove = (e) => {
      const box = canvas.getBoundingClientRect(), s = W / box.width;
      const i = Math.floor(((e.clientX - box.left) * s - LEFT) / cw);
      const l = Math.floor(((e.clientY - box.top) * s - TOP) / ch);
      if (i < 0 || i >= n || l < 0 || l >= this.layers) {
        this.readout.textContent = ""; delete this.readout.dataset.value; return;
      }
      const c = this.shown[i], v = g[l * this.cols + c], name = this.columns[c];
      Object.assign(this.readout.dataset, {layer: l, column: name, value: String(v)});
      const what = /^\d/.test(name) ? `distance ${name}` : name === "first" ? "the first position" : name;
      const kind = this.panel.kinds[l], of = isMixer(kind) ? `of the row's |m| (${kind.mixer})` : "of the attention";
      this.readout.textContent = `layer ${l}, ${what}: ${v.toFixed(4)} ${of}` +
        (b ? ` (baseline ${b[l * this.cols + c].toFixed(4)})` : "") +
        (this.entropy >= 0 ? `; row entropy ${g[l * this.cols + this.entropy].toFixed(3)} nats` : "");
      if (b) this.readout.dataset.baseline = String(b[l * this.cols + c]); else delete this.readout.dataset.baseline;
    };
  }
}
