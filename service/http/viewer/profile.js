// posenc viewer: a model's attention profile (POST /v1/posenc/profile): per layer, the attention mass by distance
// in log-2 buckets and on the first position, reduced in the worker's graph, so any prompt length draws the same
// small grid.  Heads averaged, or one head; the cell under the cursor reads the exact value shown.
import {api, floats} from "./api.js";
import {heat, sized} from "./maps.js";
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
  }

  async load(prompt) {
    this.box.dataset.state = "loading";
    let p;
    try {
      p = await api("/v1/posenc/profile", {model: this.panel.info.name, prompt: {text: prompt}});
    } catch (err) {
      this.box.dataset.state = "error";
      $(".note", this.box).textContent = err.message;
      return;
    }
    const [layers, heads, cols] = p.shape;
    Object.assign(this, {layers, heads, cols, values: floats(p.values), columns: p.columns});
    this.entropy = p.columns.indexOf("entropy");
    // drawn: every mass column (distance buckets, first, a learned sink's), not the entropy (nats)
    this.shown = p.columns.map((_, c) => c).filter((c) => c !== this.entropy);
    this.pick.replaceChildren(new Option("averaged", "mean", false, true),
                              ...Array.from({length: heads}, (_, h) => new Option(`head ${h}`, String(h))));
    this.pick.onchange = () => this.draw();
    $(".note", this.box).textContent = `${p.query_count} query rows averaged (from row ${p.query_start || 0}); ` +
      `distance d = query - key in buckets 0, 1, 2-3, 4-7, ...; "first" is the mass on position 0`;
    this.draw();
    this.box.dataset.state = "done";
  }

  // (layers x columns) of the chosen head, or the heads' mean, in float64 from the served float32 values
  grid() {
    const head = this.pick.value, out = new Float64Array(this.layers * this.cols);
    for (let l = 0; l < this.layers; l++) {
      for (let c = 0; c < this.cols; c++) {
        let s = 0;
        if (head === "mean") {
          for (let h = 0; h < this.heads; h++) s += this.values[(l * this.heads + h) * this.cols + c];
          s /= this.heads;
        } else {
          s = this.values[(l * this.heads + Number(head)) * this.cols + c];
        }
        out[l * this.cols + c] = s;
      }
    }
    return out;
  }

  draw() {
    const g = this.grid(), n = this.shown.length, canvas = this.canvas;
    const cw = Math.max(14, Math.min(48, Math.floor((SIDE - LEFT) / n)));
    const ch = Math.max(10, Math.min(28, Math.floor((SIDE - TOP) / this.layers)));
    const W = LEFT + cw * n + 2, H = TOP + ch * this.layers + 2, ctx = sized(canvas, W, H);
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, H);
    for (let l = 0; l < this.layers; l++) {
      this.shown.forEach((c, i) => {
        ctx.fillStyle = heat(Math.max(0, Math.min(1, g[l * this.cols + c])));
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
    const head = this.pick.value;
    Object.assign(canvas.dataset, {layers: this.layers, columns: this.shown.map((c) => this.columns[c]).join(","),
                                   head, values: Array.from(g).join(","), grid: [LEFT, TOP, cw, ch, W].join(",")});
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
      this.readout.textContent = `layer ${l}, ${what}: ${v.toFixed(4)} of the attention` +
        (this.entropy >= 0 ? `; row entropy ${g[l * this.cols + this.entropy].toFixed(3)} nats` : "");
    };
  }
}
