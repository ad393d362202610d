// posenc viewer: talks only to this worker's JSON API (/v1/posenc/...).  No build step, no other hosts.
// Numbers shown are also kept, at full precision, in data-* attributes (the browser test reads them).
"use strict";

const TOP_K = 10;
const MAX_ENCODING = 64;  // positions drawn in the encoding picture
const $ = (sel, root = document) => root.querySelector(sel);
const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));
let served = [];  // ListModels rows

// --- API keys -----------------------------------------------------------------------------------------------
// A worker started with --api-keys-file answers 401 without `Authorization: Bearer KEY`.  The key typed into the
// page's form is kept in sessionStorage (this tab only, gone when it closes; never localStorage, a cookie or a
// URL) and sent as that header on every call.
const KEY_ITEM = "posenc.apiKey";
const heldKey = () => sessionStorage.getItem(KEY_ITEM);
class KeyNeeded extends Error {}

function askForKey(refused) {
  document.body.dataset.key = refused ? "refused" : "needed";
  $("#key-note").textContent = refused
    ? "The worker refused that API key (401). Check it and enter it again."
    : "This worker needs an API key. It is kept for this tab only and sent as an Authorization: Bearer header.";
  $("#key-held").hidden = true;
  $("#key").hidden = false;
  $("#api-key").focus();
}

function keyHeld() {
  document.body.dataset.key = heldKey() ? "held" : "none";
  $("#key").hidden = true;
  $("#key-held").hidden = !heldKey();
}

async function api(path, body) {
  const headers = body === undefined ? {} : {"content-type": "application/json"};
  const key = heldKey();
  if (key) headers.authorization = `Bearer ${key}`;
  const init = body === undefined ? {headers} : {method: "POST", headers, body: JSON.stringify(body)};
  const res = await fetch(path, init);
  if (res.status === 401) {
    if (key && key === heldKey()) sessionStorage.removeItem(KEY_ITEM);  // refused: never sent again
    askForKey(Boolean(key));
    throw new KeyNeeded(key ? "the API key was refused" : "an API key is needed");
  }
  const doc = await res.json();
  if (!res.ok) throw new Error(doc.error || `HTTP ${res.status}`);
  return doc;
}

// float32 little-endian bytes (base64 in proto JSON) -> numbers
function floats(b64) {
  const bin = atob(b64);
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  const view = new DataView(bytes.buffer), out = new Array(bytes.length / 4);
  for (let i = 0; i < out.length; i++) out[i] = view.getFloat32(4 * i, true);
  return out;
}

// --- colours ------------------------------------------------------------------------------------------------
const SEQ = [[255, 255, 255], [254, 224, 182], [246, 155, 89], [214, 79, 55], [140, 30, 60], [50, 10, 60]];
function ramp(stops, t) {
  t = Math.max(0, Math.min(1, t)) * (stops.length - 1);
  const i = Math.min(Math.floor(t), stops.length - 2), f = t - i, a = stops[i], b = stops[i + 1];
  return `rgb(${a.map((v, k) => Math.round(v + f * (b[k] - v))).join(",")})`;
}
const heat = (t) => ramp(SEQ, Math.sqrt(t));  // sqrt: small weights stay visible
const DIV = [[33, 102, 172], [146, 197, 222], [247, 247, 247], [244, 165, 130], [178, 24, 43]];
const diverging = (v, scale) => ramp(DIV, 0.5 + 0.5 * (scale ? v / scale : 0));

function sized(canvas, w, h) {
  const r = window.devicePixelRatio || 1;
  canvas.width = Math.round(w * r); canvas.height = Math.round(h * r);
  canvas.style.width = `${w}px`; canvas.style.height = `${h}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(r, 0, 0, r, 0, 0);
  return ctx;
}

function clip(text, n) { return text.length > n ? text.slice(0, n - 1) + "…" : text; }
// What a piece looks like on screen: the byte tokenizer's visible space (U+2420) is missing from many fonts.
const label = (piece) => piece.replaceAll("\u2420", "\u00b7");

// --- one model's panel ------------------------------------------------------------------------------------------
class Panel {
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

// One bar per rotary pair: its angle per position after the model's RoPE scaling, on a log scale (fast pairs
// left, slow right), so two models' scalings can be told apart at a glance; the note says which scaling it is.
function frequencyBars(ctx, name, values, x0, w, H) {
  const logs = Array.from(values, (v) => Math.log10(Math.max(v, 1e-12)));
  const top = Math.max(0, ...logs), bottom = Math.min(top - 1, ...logs), bw = w / Math.max(1, logs.length);
  ctx.fillStyle = "#3367d6";
  logs.forEach((v, k) => {
    const h = (H - 28) * (v - bottom) / (top - bottom || 1);
    ctx.fillRect(x0 + k * bw, H - 12 - h, Math.max(1, bw - 1), h);
  });
  ctx.fillStyle = "#5f6368"; ctx.font = "11px system-ui, sans-serif"; ctx.textBaseline = "top";
  ctx.fillText(clip(`${name} [${values.length}]`, 40), x0, 1);
  ctx.fillText(`10^${bottom.toFixed(1)}..10^${top.toFixed(1)} rad/pos`, x0, H - 11);
}

// --- the page ---------------------------------------------------------------------------------------------------
function chosen() { return $$("#models input:checked").map((i) => i.value); }

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

async function compare(prompt, models) {
  const c = await api("/v1/posenc/compare", {prompt: {text: prompt}, models, top_k: 5});
  const box = $("#compare"), body = $("tbody", box);
  $(".perm", box).textContent = `"${c.tokens.map((t) => label(t.piece)).join("")}" → ` +
    `"${c.permuted_tokens.map((t) => label(t.piece)).join("")}"`;
  body.replaceChildren();
  for (const r of c.models) {
    const row = body.insertRow();
    row.dataset.model = r.model;
    cell(row, r.model); cell(row, r.variant);
    if (r.error) { cell(row, r.error, "error").colSpan = 6; continue; }
    const top = (cands) => cands.length ? `${label(cands[0].token.piece)} ${(100 * cands[0].probability).toFixed(1)}%`
      : "";
    cell(row, top(r.top)); cell(row, top(r.permuted_top));
    cell(row, r.total_variation.toFixed(4), "num").dataset.value = String(r.total_variation);
    cell(row, r.kl_divergence.toFixed(4), "num"); cell(row, r.js_divergence.toFixed(4), "num");
    cell(row, r.top1_changed ? "yes" : "no");
  }
  box.hidden = false;
}

async function run(e) {
  if (e) e.preventDefault();
  const prompt = $("#prompt").value, models = chosen(), status = $("#status");
  if (!prompt || !models.length) { status.textContent = "Type a prompt and pick at least one model."; return; }
  status.textContent = "";
  document.body.dataset.state = "running";
  const panels = models.map((name) => new Panel(served.find((m) => m.name === name)));
  $("#panels").replaceChildren(...panels.map((p) => p.el));
  const jobs = panels.map((p) => p.load(prompt).catch((err) => {
    p.el.dataset.state = "error";
    p.el.append(Object.assign(document.createElement("p"), {className: "error", textContent: err.message}));
  }));
  jobs.push(compare(prompt, models).catch((err) => { status.textContent = `compare: ${err.message}`; }));
  await Promise.all(jobs);
  document.body.dataset.state = "done";
}

async function init() {
  const box = $("#models");
  $("#status").textContent = "";
  try {
    served = (await api("/v1/posenc/models")).models || [];
  } catch (err) {
    document.body.dataset.state = err instanceof KeyNeeded ? "key" : "error";
    if (!(err instanceof KeyNeeded)) $("#status").textContent = `cannot list models: ${err.message}`;
    return;
  }
  keyHeld();
  const preferred = ["rope", "alibi"].filter((n) => served.some((m) => m.name === n));
  const checked = new Set(preferred.length ? preferred : served.slice(0, 2).map((m) => m.name));
  box.replaceChildren(Object.assign(document.createElement("legend"), {textContent: "Models"}), ...served.map((m) => {
    const label = document.createElement("label"), input = document.createElement("input");
    input.type = "checkbox"; input.name = "model"; input.value = m.name; input.checked = checked.has(m.name);
    label.append(input, ` ${m.name}`);
    label.title = `${m.variant}, ${m.n_layers} layers, ${m.n_heads} heads`;
    return label;
  }));
  document.body.dataset.state = "ready";
}

function useKey(e) {
  e.preventDefault();  // never submitted: the key stays out of every URL
  const input = $("#api-key"), key = input.value.trim();
  input.value = "";
  if (!key) { askForKey(false); return; }
  sessionStorage.setItem(KEY_ITEM, key);
  keyHeld();
  init();
}

function forgetKey() {
  sessionStorage.removeItem(KEY_ITEM);
  served = [];
  $("#models").replaceChildren(Object.assign(document.createElement("legend"), {textContent: "Models"}));
  $("#panels").replaceChildren();
  $("#compare").hidden = true;
  keyHeld();
  init();  // a worker that needs a key asks for one again
}

document.addEventListener("DOMContentLoaded", () => {
  $("#ask").addEventListener("submit", run);
  $("#key").addEventListener("submit", useKey);
  $("#forget-key").addEventListener("click", forgetKey);
  init();
});
