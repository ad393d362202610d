// posenc viewer: colours and canvas drawing.
import {clip} from "./util.js";

// --- colours ------------------------------------------------------------------------------------------------
export const SEQ = [[255, 255, 255], [254, 224, 182], [246, 155, 89], [214, 79, 55], [140, 30, 60], [50, 10, 60]];
export function ramp(stops, t) {
  t = Math.max(0, Math.min(1, t)) * (stops.length - 1);
  const i = Math.min(Math.floor(t), stops.length - 2), f = t - i, a = stops[i], b = stops[i + 1];
  return `rgb(${a.map((v, k) => Math.round(v + f * (b[k] - v))).join(",")})`;
}
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
