// posenc viewer: colours and canvas drawing.
import {clip, label} from "./util.js";

// --- colours ------------------------------------------------------------------------------------------------
export const SEQ = [[255, 255, 255], [254, 224, 182], [246, 155, 89], [214, 79, 55], [140, 30, 60], [50, 10, 60]];
export function mix(stops, t) {  // [r, g, b] at t in [0, 1] along the stops
  t = Math.max(0, Math.min(1, t)) * (stops.length - 1);
  const i = Math.min(Math.floor(t), stops.length - 2), f = t - i, a = stops[i], b = stops[i + 1];
  return a.map((v, k) => Math.round(v + f * (b[k] - v)));
}
export const ramp = (stops, t) => `rgb(${mix(stops, t).join(",")})`;
export const heat = (t) => ramp(SEQ, Math.sqrt(t));  // sqrt: small weights stay visible
export const DIV = [[33, 102, 172], [146, 197, 222], [247, 247, 247], [244, 165, 130], [178, 24, 43]];
export const diverging = (v, scale) => ramp(DIV, 0.5 + 0.5 * (scale ? v / scale : 0));

export function sized(canvas, w, h) {
  const r = window.devicePixelRatio || 1;
  canvas.width = Math.round(w * r); canvas.height = Math.round(h * r);
  canvas.style.width = `${w}px`; canvas.style.height = `${h}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(r, 0, 0, r, 0, 0);
  return ctx;
}

// One bar per rotary pair: its angle per position after the model's RoPE scaling, on a log scale (fast pairs
// left, slow right), so two models' scalings can be told apart at a glance; the note says which scaling it is.
export function frequencyBars(ctx, name, values, x0, w, H) {
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

// Each layer's rotary pairs as one strip (layers top to bottom, fast pairs left): a pair's colour is its angle per
// position on one log scale for every layer, so a local base and a global one differ at a glance; a layer without
// RoPE is a grey strip marked "none".
export function layerFrequencies(ctx, values, shape, x0, w, H) {
  const [layers, pairs] = shape, top = 16, rh = (H - top - 12) / Math.max(1, layers), cw = w / Math.max(1, pairs);
  const logs = Array.from(values, (v) => (v > 0 ? Math.log10(v) : NaN)), real = logs.filter((v) => !isNaN(v));
  const hi = Math.max(0, ...real), lo = Math.min(hi - 1, ...real);
  ctx.font = "11px system-ui, sans-serif"; ctx.textBaseline = "top";
  for (let l = 0; l < layers; l++) {
    const row = logs.slice(l * pairs, (l + 1) * pairs), y = top + l * rh;
    if (row.every((v) => isNaN(v))) {
      ctx.fillStyle = "#e8eaed"; ctx.fillRect(x0, y, w, Math.max(1, rh - 1));
      if (rh >= 10) { ctx.fillStyle = "#5f6368"; ctx.fillText("none", x0 + 2, y); }
      continue;
    }
    row.forEach((v, k) => {
      ctx.fillStyle = heat((v - lo) / (hi - lo || 1));
      ctx.fillRect(x0 + k * cw, y, Math.ceil(cw), Math.max(1, rh - 1));
    });
  }
  ctx.fillStyle = "#5f6368";
  ctx.fillText(clip(`layer_frequencies [${layers}×${pairs}]`, 40), x0, 1);
  ctx.fillText(`10^${lo.toFixed(1)}..10^${hi.toFixed(1)} rad/pos`, x0, H - 11);
}

// --- attention maps as images -------------------------------------------------------------------------------
// A map is drawn as one ImageData at the canvas's own pixel size.  Where a map has more cells than pixels, each
// pixel shows the MAX of the cells it covers: a row of attention sums to 1, so a sharp diagonal or a lone
// attended token is one cell per row, and a mean over a 4 x 4 block would fade it to a quarter; the max keeps it
// as bright as it is.  The readout under the cursor gives each cell's exact value from the full-resolution data.
const LEVELS = 1024;
const lut = (colour) => {  // colour(t) for t in [0, 1] as RGBA bytes at LEVELS steps
  const out = new Uint8ClampedArray(4 * LEVELS);
  for (let i = 0; i < LEVELS; i++) out.set([...colour(i / (LEVELS - 1)), 255], 4 * i);
  return out;
};
const HEAT = lut((t) => mix(SEQ, Math.sqrt(t)));  // heat()
const SIGNED = lut((t) => mix(DIV, t));  // diverging(), t = 0.5 + 0.5 * value / scale

// values [rows x cols] (row-major, >= 0) -> [height x width]: the max of the cells under each pixel, or the one
// cell it lies in where cells are larger than pixels.  Each cell is read once when downsampling.  Signed values (a
// mixer layer's matrix rows): the cell of largest |value| under each pixel, with its sign.
export function pool(values, rows, cols, width, height, signed = false) {
  const out = new Float32Array(width * height), c0 = new Int32Array(width), c1 = new Int32Array(width);
  for (let x = 0; x < width; x++) {
    c0[x] = Math.floor(x * cols / width);
    c1[x] = Math.max(c0[x] + 1, Math.floor((x + 1) * cols / width));
  }
  for (let y = 0; y < height; y++) {
    const r0 = Math.floor(y * rows / height), r1 = Math.max(r0 + 1, Math.floor((y + 1) * rows / height));
    const o = y * width;
    for (let r = r0; r < r1; r++) {
      const base = r * cols;
      for (let x = 0; x < width; x++) {
        let best = out[o + x];
        for (let c = c0[x]; c < c1[x]; c++) {
          const v = values[base + c];
          if (signed ? Math.abs(v) > Math.abs(best) : v > best) best = v;
        }
        out[o + x] = best;
      }
    }
  }
  return out;
}

const images = new WeakMap();  // values -> the last ImageData made of them (hovering redraws, never re-pools)

// scale null: attention weights in [0, 1] on heat(); a number: signed values on diverging(value, scale), blue below
// 0, white at 0, red above, the ends at -scale and +scale.
export function mapImage(ctx, values, rows, cols, width, height, scale = null) {
  const held = images.get(values);
  if (held && held.img.width === width && held.img.height === height && held.scale === scale) return held.img;
  const img = ctx.createImageData(width, height), px = img.data, signed = scale !== null;
  const p = pool(values, rows, cols, width, height, signed), colours = signed ? SIGNED : HEAT;
  for (let i = 0; i < p.length; i++) {
    const t = signed ? 0.5 + 0.5 * (scale ? p[i] / scale : 0) : p[i];
    const j = 4 * Math.round(Math.max(0, Math.min(1, t)) * (LEVELS - 1));
    px[4 * i] = colours[j]; px[4 * i + 1] = colours[j + 1]; px[4 * i + 2] = colours[j + 2]; px[4 * i + 3] = 255;
  }
  images.set(values, {img, scale});
  return img;
}

// The largest |value| of a map: the scale its signed picture is drawn on.
export function maxAbs(values) {
  let m = 0;
  for (const v of values) if (Math.abs(v) > m) m = Math.abs(v);
  return m;
}

// The whole map of a small canvas (thumbnails): no axes.
export function drawThumb(canvas, size, values, rows, cols, scale = null) {
  const ctx = sized(canvas, size, size);
  ctx.putImageData(mapImage(ctx, values, rows, cols, canvas.width, canvas.height, scale), 0, 0);
}

const SIDE = 440;  // CSS pixels of the large map, axes included
const niceStep = (raw) => {  // 1, 2, 5, 10, 20, ... : the first at least raw
  const p = 10 ** Math.floor(Math.log10(Math.max(raw, 1)));
  return [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw);
};

// The large map: rows start .. start + rows - 1 of the prompt (the window asked for) over every key.  Short prompts
// get a cell per token named by its piece; long ones fill the square, with positions labelled every ~50 pixels.
// Returns the geometry the cursor is read with.  scale: as mapImage's (a mixer layer's signed rows).
export function drawMap(canvas, map, pieces, query, scale = null) {
  const {values, rows, start} = map, cols = pieces.length;
  const named = Math.floor((SIDE - 78) / cols) >= 6;
  const margin = named ? 78 : 44;
  let cellW, cellH;
  if (named) {
    cellW = cellH = Math.max(6, Math.min(28, Math.floor((SIDE - margin) / cols)));
  } else {
    cellW = (SIDE - margin) / cols;
    cellH = Math.min(SIDE - margin, Math.max(cellW * rows, 6 * rows)) / rows;  // a thin window stays readable
  }
  const mapW = cellW * cols, mapH = cellH * rows, W = margin + mapW, H = margin + mapH;
  const ctx = sized(canvas, W, H), r = canvas.width / W;
  ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, H);
  ctx.putImageData(mapImage(ctx, values, rows, cols, Math.round(mapW * r), Math.round(mapH * r), scale),
                   Math.round(margin * r), Math.round(margin * r));
  if (query >= start && query < start + rows) {  // the query's row: framed, or marked in the margin when thin
    ctx.strokeStyle = ctx.fillStyle = "#c5462b"; ctx.lineWidth = 2;
    const y = margin + (query - start) * cellH;
    if (named) ctx.strokeRect(margin + 1, y + 1, mapW - 2, cellH - 2);
    else ctx.fillRect(margin - 5, y + cellH / 2 - 3, 5, 6);
  }
  ctx.fillStyle = "#1d1f21"; ctx.textBaseline = "middle";
  if (named) {
    ctx.font = `${Math.min(13, cellW)}px ui-monospace, monospace`;
    const step = Math.ceil(11 / cellW);  // thin the labels when cells are small
    for (let i = 0; i < cols; i += step) {
      if (i >= start && i < start + rows) {
        ctx.textAlign = "right";
        ctx.fillText(clip(label(pieces[i]), 9), margin - 4, margin + (i - start + 0.5) * cellH);
      }
      ctx.save();
      ctx.translate(margin + (i + 0.5) * cellW, margin - 4);
      ctx.rotate(-Math.PI / 2); ctx.textAlign = "left";
      ctx.fillText(clip(label(pieces[i]), 9), 0, 0);
      ctx.restore();
    }
  } else {
    ctx.font = "11px ui-monospace, monospace";
    const keyStep = niceStep(50 / cellW), rowStep = niceStep(24 / cellH);
    ctx.textAlign = "center";
    for (let k = 0; k < cols; k += keyStep) {
      const x = margin + (k + 0.5) * cellW, half = ctx.measureText(String(k)).width / 2;
      ctx.fillText(String(k), Math.min(x, W - half - 1), margin - 16);
      ctx.fillRect(x, margin - 6, 1, 5);
    }
    ctx.textAlign = "right";
    for (let q = Math.ceil(start / rowStep) * rowStep; q < start + rows; q += rowStep) {
      ctx.fillText(String(q), margin - 12, margin + (q - start + 0.5) * cellH);
      ctx.fillRect(margin - 10, margin + (q - start + 0.5) * cellH, 4, 1);
    }
    ctx.fillStyle = "#5f6368"; ctx.textAlign = "left"; ctx.font = "10px system-ui, sans-serif";
    ctx.fillText("query ↓ key →", 2, 8);
  }
  return {margin, cellW, cellH, W, rows, cols, start};
}

// (query, key) of the prompt under a mouse event, or null off the map.
export function cellAt(canvas, geo, e) {
  const box = canvas.getBoundingClientRect(), s = geo.W / box.width;
  const k = Math.floor(((e.clientX - box.left) * s - geo.margin) / geo.cellW);
  const i = Math.floor(((e.clientY - box.top) * s - geo.margin) / geo.cellH);
  return i >= 0 && i < geo.rows && k >= 0 && k < geo.cols ? [geo.start + i, k] : null;
}

// A signed map (intervened - baseline) on a small canvas: blue where the intervention lowered a weight, red where it
// raised it, white where it left it, on one scale symmetric about 0 (the largest |difference|).  Where a map has
// more cells than pixels, each pixel shows the cell of largest |difference| it covers, so a lone change stays seen.
export function drawDiff(canvas, size, values, rows, cols, scale) {
  const ctx = sized(canvas, size, size), W = canvas.width, H = canvas.height, img = ctx.createImageData(W, H);
  const span = (i, n, m) => [Math.floor(i * n / m), Math.max(Math.floor(i * n / m) + 1, Math.floor((i + 1) * n / m))];
  for (let y = 0; y < H; y++) {
    const [r0, r1] = span(y, rows, H);
    for (let x = 0; x < W; x++) {
      const [c0, c1] = span(x, cols, W);
      let v = 0;
      for (let r = r0; r < r1; r++) {
        for (let c = c0; c < c1; c++) if (Math.abs(values[r * cols + c]) > Math.abs(v)) v = values[r * cols + c];
      }
      img.data.set([...mix(DIV, 0.5 + 0.5 * (scale ? v / scale : 0)), 255], 4 * (y * W + x));
    }
  }
  ctx.putImageData(img, 0, 0);
}
