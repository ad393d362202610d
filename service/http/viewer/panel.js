// posenc viewer: one model's panel (next tokens, encoding, attention maps).
import {api, floats} from "./api.js";
import {diverging, frequencyBars, heat, sized} from "./maps.js";
import {$, $$, clip, label} from "./util.js";

const TOP_K = 10;
const MAX_ENCODING = 64;  // positions drawn in the encoding picture

// --- one model's panel ------------------------------------------------------------------------------------------
export class Panel {
  constructor(info) {
    this.info = info;
    this.el = $("#panel").content.firstElementChild.cloneNode(true);
    this.el.dataset.model = info.name;
    this.el.dataset.state = "loading";
    $(".name", this.el).textContent = info.name;
    $(".variant", this.el).textContent = `${info.variant} · ${info.n_layers} layers × ${info.n_heads} heads`;
    this.layer = info.n_layers - 1; this.head = 0; this.query = 0;
  }

  async load(prompt) {
    const p = await api("/v1/posenc/predict", {model: this.info.name, prompt: {text: prompt}, top_k: TOP_K,
                                               attention: "ATTENTION_FULL"});
    this.pieces = p.tokens.map((t) => t.piece);
    this.T = this.pieces.length;
    this.query = this.T - 1;
    this.maps = new Map(p.attention.map((a) => [`${a.layer},${a.head}`, floats(a.data)]));
    this.layers = [...new Set(p.attention.map((a) => a.layer))];
    this.heads = [...new Set(p.attention.map((a) => a.head))];
    this.drawTop(p.top);
    this.buildPickers();
    this.buildTokens();
    this.buildThumbs();
    this.select();
    this.el.dataset.state = "done";
    this.encoding().catch((err) => { $(".note", this.el).textContent = err.message; });
  }

  drawTop(top) {
    const ol = $(".top", this.el), best = top.length ? top[0].probability : 1;
    ol.replaceChildren(...top.map((c) => {
      const li = document.createElement("li");
      Object.assign(li.dataset, {tokenId: c.token.id, piece: c.token.piece, probability: String(c.probability),
                                 logprob: String(c.logprob)});
      const piece = document.createElement("span"), bar = document.createElement("span");
      const p = document.createElement("span");
      piece.className = "piece"; piece.textContent = clip(label(c.token.piece), 12); piece.title = c.token.piece;
      bar.className = "bar"; bar.style.width = `${(100 * c.probability / best).toFixed(1)}%`;
      p.className = "p"; p.textContent = `${(100 * c.probability).toFixed(1)}%`;
      li.append(piece, bar, p);
      return li;
    }));
  }

  buildPickers() {
    const fill = (sel, values, current) => {
      sel.replaceChildren(...values.map((v) => new Option(String(v), String(v), false, v === current)));
    };
    const layer = $(".layer", this.el), head = $(".head", this.el);
    fill(layer, this.layers, this.layer); fill(head, this.heads, this.head);
    layer.onchange = () => { this.layer = Number(layer.value); this.select(); };
    head.onchange = () => { this.head = Number(head.value); this.select(); };
  }

  buildTokens() {
    const strip = $(".tokens", this.el);
    strip.replaceChildren(...this.pieces.map((piece, i) => {
      const b = document.createElement("button");
      b.type = "button"; b.className = "tok"; b.textContent = label(piece); b.dataset.index = i;
      b.dataset.piece = piece;
      b.tabIndex = i === this.query ? 0 : -1;
      b.onmouseenter = b.onfocus = b.onclick = () => this.setQuery(i);
      b.onkeydown = (e) => {
        const to = {ArrowLeft: i - 1, ArrowRight: i + 1, Home: 0, End: this.T - 1}[e.key];
        if (to === undefined || to < 0 || to >= this.T) return;
        e.preventDefault();
        strip.children[to].focus();
      };
      return b;
    }));
  }

  buildThumbs() {
    const box = $(".thumbs", this.el), size = Math.max(36, Math.min(90, Math.floor(440 / this.heads.length) - 6));
    box.style.gridTemplateColumns = `repeat(${this.heads.length}, ${size}px)`;
    const buttons = [];
    for (const l of this.layers) {
      for (const h of this.heads) {
        const b = document.createElement("button"), c = document.createElement("canvas");
        b.type = "button"; b.dataset.layer = l; b.dataset.head = h;
        b.setAttribute("aria-label", `layer ${l} head ${h}`); b.title = `layer ${l}, head ${h}`;
        const ctx = sized(c, size, size), m = this.maps.get(`${l},${h}`), cell = size / this.T;
        for (let q = 0; q < this.T; q++) {
          for (let k = 0; k < this.T; k++) {
            ctx.fillStyle = heat(m[q * this.T + k]);
            ctx.fillRect(k * cell, q * cell, Math.ceil(cell), Math.ceil(cell));
          }
        }
        b.append(c);
        b.onclick = () => { this.layer = l; this.head = h; this.buildPickers(); this.select(); };
        buttons.push(b);
      }
    }
    box.replaceChildren(...buttons);
  }

  setQuery(i) {
    this.query = i;
    $$(".tok", this.el).forEach((b, k) => { b.tabIndex = k === i ? 0 : -1; });
    this.select();
  }

  row() {
    const m = this.maps.get(`${this.layer},${this.head}`);
    return m.slice(this.query * this.T, (this.query + 1) * this.T);
  }

  select() {
    $$(".thumbs button", this.el).forEach((b) => {
      b.setAttribute("aria-pressed", String(Number(b.dataset.layer) === this.layer
                                            && Number(b.dataset.head) === this.head));
    });
    const row = this.row(), out = $(".attention-row", this.el);
    Object.assign(out.dataset, {layer: this.layer, head: this.head, query: this.query,
                                weights: row.map(String).join(",")});
    let best = 0;
    row.forEach((w, k) => { if (w > row[best]) best = k; });
    out.textContent = `layer ${this.layer}, head ${this.head}: "${label(this.pieces[this.query])}" (position ` +
      `${this.query}) attends most to "${label(this.pieces[best])}" (position ${best}, ` +
      `${(100 * row[best]).toFixed(1)}%)`;
    $$(".tok", this.el).forEach((b, k) => {
      b.classList.toggle("query", k === this.query);
      b.style.background = k <= this.query ? heat(row[k]) : "#fff";
      b.style.color = row[k] > 0.45 ? "#fff" : "";
      b.title = `${(100 * row[k]).toFixed(2)}% of position ${this.query}'s attention`;
    });
    this.drawHeatmap();
  }

  drawHeatmap() {
    const canvas = $(".heatmap", this.el), T = this.T, margin = 78;
    const cell = Math.max(6, Math.min(28, Math.floor((440 - margin) / T)));
    const W = margin + cell * T, ctx = sized(canvas, W, W), m = this.maps.get(`${this.layer},${this.head}`);
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, W);
    for (let q = 0; q < T; q++) {
      for (let k = 0; k < T; k++) {
        ctx.fillStyle = heat(m[q * T + k]);
        ctx.fillRect(margin + k * cell, margin + q * cell, cell, cell);
      }
    }
    ctx.strokeStyle = "#c5462b"; ctx.lineWidth = 2;
    ctx.strokeRect(margin + 1, margin + this.query * cell + 1, cell * T - 2, cell - 2);
    ctx.fillStyle = "#1d1f21"; ctx.font = `${Math.min(13, cell)}px ui-monospace, monospace`;
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    const step = Math.ceil(11 / cell);  // thin the labels when cells are small
    for (let i = 0; i < T; i += step) {
      ctx.fillText(clip(label(this.pieces[i]), 9), margin - 4, margin + (i + 0.5) * cell);
      ctx.save();
      ctx.translate(margin + (i + 0.5) * cell, margin - 4);
      ctx.rotate(-Math.PI / 2); ctx.textAlign = "left";
      ctx.fillText(clip(label(this.pieces[i]), 9), 0, 0);
      ctx.restore();
    }
    const at = (e) => {
      const r = canvas.getBoundingClientRect(), s = W / r.width;
      const k = Math.floor(((e.clientX - r.left) * s - margin) / cell);
      const q = Math.floor(((e.clientY - r.top) * s - margin) / cell);
      return q >= 0 && q < T && k >= 0 && k < T ? [q, k] : null;
    };
    canvas.onmousemove = (e) => {
      const hit = at(e);
      const [q, k] = hit || [];
      $(".readout", this.el).textContent = hit ? `"${label(this.pieces[q])}" → "${label(this.pieces[k])}": ` +
        `${m[q * T + k].toFixed(4)}` : "";
    };
    canvas.onclick = (e) => { const hit = at(e); if (hit) this.setQuery(hit[0]); };
    canvas.setAttribute("aria-label", `attention map, layer ${this.layer} head ${this.head}, ${T} tokens`);
  }

  async encoding() {
    const cap = this.info.max_positions || MAX_ENCODING;
    const length = Math.max(1, Math.min(this.T, MAX_ENCODING, cap));
    const e = await api("/v1/posenc/encoding", {model: this.info.name, length});
    const canvas = $(".encoding", this.el);
    // RoPE's frequencies first (they say what a scaling did), then the pictures, four at most
    const tensors = [...e.tensors.filter((t) => t.shape.length === 1),
                     ...e.tensors.filter((t) => t.shape.length !== 1)].slice(0, 4);
    $(".note", this.el).textContent = e.note || (tensors.length ? "" : "no positional encoding: order comes " +
      "only from the causal mask");
    const W = 300, H = 160, gap = 6, w = tensors.length ? (W - gap * (tensors.length - 1)) / tensors.length : W;
    const ctx = sized(canvas, W, H);
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, H);
    tensors.forEach((t, i) => {
      const values = floats(t.data), shape = t.shape;
      if (shape.length === 1) { frequencyBars(ctx, t.name, values, i * (w + gap), w, H); return; }
      const [rows, cols] = shape.length >= 2 ? shape.slice(-2) : [1, shape[0]];  // 3-D: its first slice
      const scale = values.slice(0, rows * cols).reduce((a, v) => Math.max(a, Math.abs(v)), 0);
      const x0 = i * (w + gap), cw = w / cols, ch = (H - 16) / rows;
      for (let r = 0; r < rows; r++) {
        for (let c = 0; c < cols; c++) {
          ctx.fillStyle = diverging(values[r * cols + c], scale);
          ctx.fillRect(x0 + c * cw, 16 + r * ch, Math.ceil(cw), Math.ceil(ch));
        }
      }
      ctx.fillStyle = "#5f6368"; ctx.font = "11px system-ui, sans-serif"; ctx.textBaseline = "top";
      ctx.fillText(clip(`${t.name}${shape.length > 2 ? "[0]" : ""} [${shape.join("×")}]`, 40), x0, 1);
    });
    canvas.dataset.tensors = tensors.map((t) => t.name).join(",");
    canvas.setAttribute("aria-label", `encoding of ${this.info.name}: ${canvas.dataset.tensors || "none"}`);
  }
}
