// posenc viewer: one model's panel (next tokens, encoding, attention maps).
import {api, floats} from "./api.js";
import {cellAt, diverging, drawMap, drawThumb, frequencyBars, heat, layerFrequencies, maxAbs, sized} from "./maps.js";
import {Interventions} from "./intervene.js";
import {MixerView} from "./mixer.js";
import {hybrid, isMixer, layerKinds, layerName, layerTip, mixerRow, scaleNote, valueText} from "./layers.js";
import {ProfileView} from "./profile.js";
import {$, $$, clip, label} from "./util.js";

const TOP_K = 10;
const MAX_ENCODING = 64;  // positions drawn in the encoding picture
const MAP_BYTES = 4 << 20;  // float32 bytes of maps one request asks for (a third more as base64 JSON)
const BAND = 16, FOOT = 12;  // CSS pixels of the encoding canvas over its pictures, and under frequency pictures

// "10^lo..10^hi rad/pos": the log scale a frequency picture is drawn on (its nonzero values, hi at least 0 and lo
// at least a decade under it), as frequencyBars and layerFrequencies scale it.
function logRange(values) {
  const logs = Array.from(values).filter((v) => v > 0).map((v) => Math.log10(v));
  const hi = Math.max(0, ...logs), lo = Math.min(hi - 1, ...logs);
  return `10^${lo.toFixed(1)}..10^${hi.toFixed(1)} rad/pos`;
}

// A row of captions beside the encoding canvas, one per picture: a grid whose columns are the canvas's slots (the
// 6-unit gaps of its 300 units are 2% of its width), so each caption sits over or under its own picture and wraps
// within it (after each "_" or ".." first), whatever the number of pictures and the length of their names.
function captions(canvas, cls, texts, side) {
  let row = canvas.parentElement.querySelector(`.${cls}`);
  if (!row) {
    row = Object.assign(document.createElement("div"), {className: `${cls} captions`});
    if (side === "before") canvas.before(row); else canvas.after(row);
  }
  row.hidden = !texts.some(Boolean);
  row.style.width = canvas.style.width;  // as wide as the canvas drawn (narrower where the column is)
  row.style.gridTemplateColumns = `repeat(${Math.max(1, texts.length)}, minmax(0, 1fr))`;
  row.replaceChildren(...texts.map((text) => {
    const cell = document.createElement("span");
    text.split(/(?<=_|\.\.)/).forEach((part, k) => {
      if (k) cell.append(document.createElement("wbr"));
      cell.append(part);
    });
    if (text) cell.title = text;
    return cell;
  }));
}

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
    this.kinds = layerKinds("", info.n_layers, info.layer_mixers);  // each layer's kind; the note's words once read
    this.iv = new Interventions(this);
    this.mixer = new MixerView(this);  // the chosen layer's mixer's own matrices, on request
    this.asked = 0; this.runs = 0;  // maps requests and intervention runs made: only the latest one's answer is kept
  }

  // The prompt's tokens first (no model run), so the maps are asked for in the one Predict: all of them when a
  // whole set is small, else the chosen layer and head over a window of query rows that fits MAP_BYTES.  The
  // Encoding is asked for beside them: its note says which layers are mixers, whose maps are painted signed.
  async load(prompt) {
    const t = await api("/v1/posenc/tokenize", {model: this.info.name, text: prompt});
    this.prompt = prompt;
    this.pieces = t.tokens.map((x) => x.piece);
    this.T = this.pieces.length;
    this.query = this.T - 1;
    this.all = 4 * this.info.n_layers * this.info.n_heads * this.T * this.T <= MAP_BYTES;
    const rows = this.all ? this.T : Math.max(1, Math.min(this.T, Math.floor(MAP_BYTES / (4 * this.T))));
    this.window = {start: this.T - rows, count: rows};
    this.buildTokens();
    const length = Math.max(1, Math.min(this.T, MAX_ENCODING, this.info.max_positions || MAX_ENCODING));
    const [p, e] = await Promise.all([this.fetchMaps(), api("/v1/posenc/encoding", {model: this.info.name, length})
      .catch((err) => ({error: err.message}))]);
    this.kinds = layerKinds(e.note, this.info.n_layers, this.info.layer_mixers);
    this.el.dataset.mixers = this.kinds.map((k) => k.mixer).join(",");
    this.drawTop(p.top);
    this.buildPickers();
    this.buildThumbs();
    this.mixer.build();
    this.select();
    this.iv.build(this.T);
    this.el.dataset.state = "done";
    if (e.error) $(".note", this.el).textContent = e.error; else this.encoding(e);
    this.profile = new ProfileView(this);
    await this.profile.load(prompt);
  }

  // The interventions changed: the next tokens, maps and profile again, with the baseline beside them when any is set.
  async rerun() {
    const run = ++this.runs;
    this.el.dataset.iv = "loading";
    try {
      let p = null;
      while (!p && run === this.runs) p = await this.fetchMaps();  // again when a layer's maps were asked meanwhile
      if (run !== this.runs) return;
      this.drawTop(p.top);
      this.iv.showEffect(p.effect, (top, ol) => this.drawTop(top, ol));
      this.buildThumbs();
      this.mixer.build();  // the matrices held were the other intervention's: its key names the run
      this.select();
      await this.profile.load(this.prompt);
      if (run === this.runs) this.iv.done();
    } catch (err) {
      if (run === this.runs) this.iv.fail(err.message);
    }
  }

  // One Predict for the maps shown, under the panel's interventions; its answer replaces the maps held (null: a later
  // request's answer is the one kept).
  async fetchMaps() {
    const {start, count} = this.window, body = {model: this.info.name, prompt: {text: this.prompt}, top_k: TOP_K,
                                                attention: "ATTENTION_FULL", query_start: start, query_count: count};
    if (!this.all) Object.assign(body, {layers: [this.layer], heads: [this.head]});
    const intervention = this.iv.body(), asked = ++this.asked;
    if (intervention) body.intervention = intervention;
    this.el.dataset.maps = "loading";
    const p = await api("/v1/posenc/predict", body);
    if (asked !== this.asked) return null;
    const held = (maps) => new Map(maps.map((a) => [`${a.layer},${a.head}`, {values: floats(a.data), rows: a.shape[0],
                                                                           start: a.query_start,
                                                                           sinks: a.sink_mass || null}]));
    this.maps = held(p.attention);
    this.baseMaps = p.effect && p.effect.has_baseline ? held(p.effect.baseline_attention) : null;
    this.el.dataset.maps = "done";
    return p;
  }

  // A layer, head or window not held: ask for it, then draw.
  async show() {
    this.mixer.build();
    if (!this.maps.has(`${this.layer},${this.head}`) || this.window.start !== this.held().start) {
      try {
        if (!await this.fetchMaps()) return;
      } catch (err) {
        this.el.dataset.maps = "error";
        $(".readout", this.el).textContent = err.message;
        return;
      }
    }
    this.select();
  }

  held() { return this.maps.values().next().value; }

  drawTop(top, ol = $(".top", this.el)) {
    const best = top.length ? top[0].probability : 1;
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
    const fill = (sel, n, current, text = String) => {
      sel.replaceChildren(...Array.from({length: n}, (_, v) => new Option(text(v), String(v), false, v === current)));
    };
    const layer = $(".layer", this.el), head = $(".head", this.el), from = $(".q-start", this.el);
    const count = $(".q-count", this.el);
    fill(layer, this.info.n_layers, this.layer, (l) => layerName(this.kinds, l)); fill(head, this.info.n_heads, this.head);
    if (hybrid(this.kinds)) Array.from(layer.options).forEach((o, l) => { o.title = layerTip(this.kinds, l); });
    layer.onchange = () => { this.layer = Number(layer.value); this.show(); };
    head.onchange = () => { this.head = Number(head.value); this.mixer.clear(); this.show(); };
    Object.assign(from, {max: this.T - 1, value: this.window.start});
    Object.assign(count, {max: this.T, value: this.window.count});
    from.onchange = count.onchange = () => {  // a window inside the prompt, at most MAP_BYTES of map
      const most = Math.max(1, Math.floor(MAP_BYTES / (4 * this.T)));
      const n = Math.max(1, Math.min(this.T, most, Math.round(Number(count.value)) || 1));
      const s = Math.max(0, Math.min(this.T - n, Math.round(Number(from.value)) || 0));
      from.value = s; count.value = n;
      this.moveWindow(s, n);
    };
  }

  moveWindow(start, count) {
    this.window = {start, count};
    this.all = this.all && start === 0 && count === this.T;
    this.maps = new Map();
    if (this.query < start || this.query >= start + count) this.query = start + count - 1;
    this.show();
  }

  buildTokens() {
    const strip = $(".tokens", this.el);
    strip.replaceChildren(...this.pieces.map((piece, i) => {
      const b = document.createElement("button");
      b.type = "button"; b.className = "tok"; b.textContent = label(piece); b.dataset.index = i;
      b.dataset.piece = piece;
      b.tabIndex = i === this.query ? 0 : -1;
      b.onfocus = b.onclick = () => this.setQuery(i);
      b.onmouseenter = () => this.setQuery(i, false);  // passing over tokens never asks for other rows
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
    const box = $(".thumbs", this.el);
    if (!this.all) {  // a long prompt: only the chosen layer and head are asked for
      box.style.gridTemplateColumns = "";
      box.replaceChildren(Object.assign(document.createElement("p"), {className: "note", textContent:
        `Every layer and head is drawn where their maps take at most ${MAP_BYTES >> 20} MiB; this prompt's ` +
        `${this.T} tokens take more: pick a layer, head and rows above.`}));
      return;
    }
    const heads = this.info.n_heads, size = Math.max(36, Math.min(90, Math.floor(440 / heads) - 6));
    const named = hybrid(this.kinds);  // a row header per layer: its number and kind
    box.style.gridTemplateColumns = `${named ? "auto " : ""}repeat(${heads}, ${size}px)`;
    const buttons = [];
    for (let l = 0; l < this.info.n_layers; l++) {
      if (named) {
        buttons.push(Object.assign(document.createElement("span"), {className: "layer-kind",
                                                                    textContent: layerName(this.kinds, l),
                                                                    title: layerTip(this.kinds, l)}));
        Object.assign(buttons.at(-1).dataset, {layer: l, mixer: this.kinds[l].mixer});
      }
      for (let h = 0; h < heads; h++) {
        const b = document.createElement("button"), c = document.createElement("canvas");
        b.type = "button"; b.dataset.layer = l; b.dataset.head = h;
        b.setAttribute("aria-label", `layer ${l} head ${h}`); b.title = `layer ${l}, head ${h}`;
        const m = this.maps.get(`${l},${h}`), scale = isMixer(this.kinds[l]) ? maxAbs(m.values) : null;
        if (scale !== null) b.title += ` (${this.kinds[l].mixer}: signed, max |m| = ${valueText(scale)})`;
        drawThumb(c, size, m.values, m.rows, this.T, scale);
        b.append(c);
        b.onclick = () => {  // in ablation mode the head is ablated (or back), else shown large
          if (this.iv.ablating) { this.iv.toggleHead(l, h); return; }
          this.layer = l; this.head = h; this.mixer.clear(); this.buildPickers(); this.show();
        };
        buttons.push(b);
      }
    }
    box.replaceChildren(...buttons);
    this.iv.markThumbs();
  }

  setQuery(i, move = true) {
    const {start, count} = this.window, outside = i < start || i >= start + count;
    if (outside && !move) return;
    this.query = i;
    $$(".tok", this.el).forEach((b, k) => { b.tabIndex = k === i ? 0 : -1; });
    if (outside) {  // outside the rows held: the window moves to hold it
      const s = Math.max(0, Math.min(this.T - count, i - Math.floor(count / 2)));
      Object.assign($(".q-start", this.el), {value: s});
      this.window = {start: s, count};
      this.all = false;
      this.maps = new Map();
      this.show();
      return;
    }
    this.select();
  }

  map() { return this.mixer.shown() || this.maps.get(`${this.layer},${this.head}`); }

  row() {
    const m = this.map(), i = this.query - m.start;
    return Array.from(m.values.subarray(i * this.T, (i + 1) * this.T));
  }

  select() {
    $$(".thumbs button", this.el).forEach((b) => {
      b.setAttribute("aria-pressed", String(Number(b.dataset.layer) === this.layer
                                            && Number(b.dataset.head) === this.head));
    });
    const mixed = this.mixer.shown() !== null;  // a mixer's own matrix, chosen under the grid
    const row = this.row(), out = $(".attention-row", this.el), m = this.map();
    const kind = mixed ? {mixer: this.mixer.what(this.layer)} : this.kinds[this.layer];
    const where = {layer: this.layer, head: mixed ? this.mixer.chosen : this.head, query: this.query,
                   piece: this.pieces[this.query]};
    const scale = isMixer(kind) || mixed ? maxAbs(m.values) : null;  // signed rows: drawn from -scale to +scale
    Object.assign(out.dataset, {layer: this.layer, head: where.head, query: this.query,
                                weights: row.map(String).join(",")});
    const sink = m.sinks ? m.sinks[this.query - m.start] : undefined;
    if (scale !== null) {  // no "attends", no percentages
      out.textContent = mixerRow(kind, where, this.pieces, row);
    } else {
      let best = 0;
      row.forEach((w, k) => { if (w > row[best]) best = k; });
      out.textContent = `layer ${this.layer}, head ${this.head}: "${label(this.pieces[this.query])}" (position ` +
        `${this.query}) attends most to "${label(this.pieces[best])}" (position ${best}, ` +
        `${(100 * row[best]).toFixed(1)}%)`;
    }
    if (sink === undefined) {
      delete out.dataset.sink;
    } else {  // a model with attention sinks: the row sums to 1 - what the sink took
      out.dataset.sink = String(sink);
      out.textContent += `; the head's sink took ${(100 * sink).toFixed(1)}%`;
    }
    $$(".tok", this.el).forEach((b, k) => {
      b.classList.toggle("query", k === this.query);
      b.style.background = k > this.query ? "#fff" : scale === null ? heat(row[k]) : diverging(row[k], scale);
      b.style.color = (scale === null ? row[k] > 0.45 : Math.abs(row[k]) > 0.6 * scale) ? "#fff" : "";
      b.title = scale === null ? `${(100 * row[k]).toFixed(2)}% of position ${this.query}'s attention`
        : `m = ${valueText(row[k])} in position ${this.query}'s row (${kind.mixer})`;
    });
    this.drawHeatmap(scale, kind, where.head, mixed);
    this.iv.drawMaps(m, !mixed && this.baseMaps && this.baseMaps.get(`${this.layer},${this.head}`), this.T, where,
                     scale !== null);
  }

  // The large map: attention weights on the heat ramp (scale null), or a mixer layer's signed rows on the diverging
  // ramp from -scale to +scale, its caption saying so.
  // kind: the layer's ({mixer}), head: the map's head or the mixer's matrix drawn (mixed).
  drawHeatmap(scale, kind, head, mixed) {
    const canvas = $(".heatmap", this.el), m = this.map(), T = this.T;
    const geo = drawMap(canvas, m, this.pieces, this.query, scale), readout = $(".readout", this.el);
    const caption = $(".map-scale", this.el);
    Object.assign(canvas.dataset, {layer: this.layer, head, start: m.start, rows: m.rows, keys: T,
                                   paint: scale === null ? "attention" : "signed", source: mixed ? "mixer" : "maps",
                                   geometry: [geo.margin, geo.cellW, geo.cellH].join(",")});
    if (scale === null) delete canvas.dataset.scale; else canvas.dataset.scale = String(scale);
    caption.hidden = scale === null;
    caption.textContent = scale === null ? "" : scaleNote(kind, scale);
    canvas.onmousemove = (e) => {
      const hit = cellAt(canvas, geo, e);
      if (!hit) { readout.textContent = ""; delete readout.dataset.value; return; }
      const [q, k] = hit, v = m.values[(q - m.start) * T + k];  // the exact value, not the pooled pixel
      Object.assign(readout.dataset, {query: q, key: k, value: String(v)});
      readout.textContent = `query ${q} "${clip(label(this.pieces[q]), 12)}" → key ${k} ` +
        `"${clip(label(this.pieces[k]), 12)}": ${valueText(v)}`;
    };
    canvas.onclick = (e) => { const hit = cellAt(canvas, geo, e); if (hit) this.setQuery(hit[0]); };
    canvas.setAttribute("aria-label", `${scale === null ? "attention map" : `${kind.mixer} map (signed matrix rows)`}, ` +
      `layer ${this.layer} ${mixed ? "matrix" : "head"} ${head}, query rows ${m.start} to ${m.start + m.rows - 1} of ${T} tokens` +
      (scale === null ? "" : `, scaled by max |m| = ${valueText(scale)}`));
  }

  // The Encoding's answer drawn: its pictures and note.
  encoding(e) {
    const canvas = $(".encoding", this.el);
    // RoPE's frequencies first (they say what a scaling did; each layer's where the layers differ), then the
    // pictures, four at most
    const perLayer = e.tensors.find((t) => t.name === "layer_frequencies");
    const rest = e.tensors.filter((t) => t !== perLayer && !(perLayer && t.name === "rotary_frequencies"));
    const tensors = [...(perLayer ? [perLayer] : []), ...rest.filter((t) => t.shape.length === 1),
                     ...rest.filter((t) => t.shape.length !== 1)].slice(0, 4);
    $(".note", this.el).textContent = e.note || (tensors.length ? "" : "no positional encoding: order comes " +
      "only from the causal mask");
    const W = 300, H = 160, gap = 6, w = tensors.length ? (W - gap * (tensors.length - 1)) / tensors.length : W;
    const ctx = sized(canvas, W, H), titles = [], ranges = [];
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, H);
    tensors.forEach((t, i) => {
      const values = floats(t.data), shape = t.shape, x0 = i * (w + gap);
      titles.push(`${t.name}${shape.length > 2 ? "[0]" : ""} [${shape.join("×")}]`);
      ranges.push(shape.length === 1 || t === perLayer ? logRange(values) : "");
      if (shape.length === 1 || t === perLayer) {
        // the frequency pictures' own bands above and below them hold text a slot is too narrow for: the
        // captions around the canvas carry it, so only the picture between the bands is drawn
        ctx.save(); ctx.beginPath(); ctx.rect(x0, BAND, w, H - BAND - FOOT); ctx.clip();
        if (shape.length === 1) frequencyBars(ctx, t.name, values, x0, w, H);
        else layerFrequencies(ctx, values, shape, x0, w, H);
        ctx.restore();
        return;
      }
      const [rows, cols] = shape.length >= 2 ? shape.slice(-2) : [1, shape[0]];  // 3-D: its first slice
      const scale = values.slice(0, rows * cols).reduce((a, v) => Math.max(a, Math.abs(v)), 0);
      const cw = w / cols, ch = (H - BAND) / rows;
      for (let r = 0; r < rows; r++) {
        for (let c = 0; c < cols; c++) {
          ctx.fillStyle = diverging(values[r * cols + c], scale);
          ctx.fillRect(x0 + c * cw, BAND + r * ch, Math.ceil(cw), Math.ceil(ch));
        }
      }
    });
    captions(canvas, "encoding-titles", titles, "before");
    captions(canvas, "encoding-ranges", ranges, "after");
    canvas.dataset.tensors = tensors.map((t) => t.name).join(",");
    canvas.setAttribute("aria-label", `encoding of ${this.info.name}: ${canvas.dataset.tensors || "none"}`);
  }
}
