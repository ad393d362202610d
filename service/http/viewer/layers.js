// posenc viewer: where each layer's order comes from, and how its maps are read.  posenc.v1's ListModels names
// each layer's mixer (ModelInfo.layer_mixers, from model.json); the Encoding note says in words where each layer's
// order comes from wherever the layers differ (export/encoding.py per_layer; a model listed without layer_mixers
// has its kinds read from those words), e.g. "layers 0, 2: a gated causal convolution over 3 tokens, no attention (order from its kernel);
// layer 1: RoPE base 1e+06".  A mixer layer (model.json's layers[i].mixer other than "attention": LFM2's
// short_conv, Granite's mamba2, Qwen3-Next's gated_deltanet, or none, a layer that is its MLP alone) has no attention: its maps are its exact
// matrix rows, signed and unnormalised (docs/mixers.md), so
// the panel paints them on a diverging ramp scaled by the map's largest |m| and says so under the map.
import {clip, label} from "./util.js";

// The mixers the note names (its words for each), by model.json's name for them.  A layer the note says has "no
// attention" is a mixer whatever its words: one not in this list is named "mixer".
// The words open the layer's part: an attention layer's may name a mixer beside it ("RoPE base 1000 beside a Mamba-2
// state-space layer", Falcon-H1's), which leaves it an attention layer.
const MIXERS = [{mixer: "short_conv", words: /^a gated causal convolution over \d+ tokens/},
                {mixer: "mamba2", words: /^a Mamba-2 state-space layer/},
                {mixer: "gated_deltanet", words: /^a Gated DeltaNet layer/},
                {mixer: "none", words: /^an MLP alone, no token mixing/}];
const ATTENTION = "attention";

// One record per layer: {mixer: "attention" or the mixer's name, order: the note's words for the layer ("" where
// the note names no layer)}.
export function layerKinds(note, n, mixers = []) {
  const kinds = Array.from({length: n}, (_, l) => ({mixer: mixers[l] || ATTENTION, order: ""}));
  for (const part of (note || "").split("; ")) {
    const m = /^layers? (\d+(?:, \d+)*): (.+)$/.exec(part);
    if (!m) continue;
    const known = MIXERS.find((k) => k.words.test(m[2]));
    const mixer = known ? known.mixer : /\bno attention\b/.test(m[2]) ? "mixer" : ATTENTION;
    for (const l of m[1].split(", ").map(Number)) {
      if (l < n) kinds[l] = {mixer: mixers[l] || mixer, order: m[2]};
    }
  }
  return kinds;
}

export const isMixer = (kind) => Boolean(kind) && kind.mixer !== ATTENTION;

// A model with a mixer layer has its layers labelled by kind (a model of attention layers alone stays unlabelled).
export const hybrid = (kinds) => kinds.some(isMixer);

// The layer picker's and the grid's words for layer l: "2 · short_conv"; the tooltip says where its order comes from.
export const layerName = (kinds, l) => (hybrid(kinds) ? `${l} · ${kinds[l].mixer}` : String(l));
export function layerTip(kinds, l) {
  const k = kinds[l], what = isMixer(k) ? `${k.mixer} mixer` : "attention";
  return `layer ${l}: ${what}${k.order ? ` (${k.order})` : ""}; its maps are ` +
    (isMixer(k) ? "signed matrix rows" : "attention weights");
}

// A map's value as the readout shows it.
export const valueText = (v) => (Math.abs(v) > 0 && Math.abs(v) < 1e-3 ? v.toExponential(2) : v.toFixed(4));

// The caption under a mixer layer's map: what its colours mean.
export const scaleNote = (kind, scale) => `${kind.mixer}: signed matrix rows, scaled by max |m| = ${valueText(scale)} ` +
  "(blue negative, white 0, red positive)";

// The line over a mixer layer's map for the query's row: the key of largest |m|, with its sign.
export function mixerRow(kind, where, pieces, row) {
  let best = 0;
  row.forEach((v, k) => { if (Math.abs(v) > Math.abs(row[best])) best = k; });
  return `layer ${where.layer} (${kind.mixer}), head ${where.head}: the row of "${label(pieces[where.query])}" ` +
    `(position ${where.query}) is largest at "${clip(label(pieces[best]), 12)}" (position ${best}), ` +
    `m = ${valueText(row[best])}`;
}
