// posenc viewer: talks only to this worker's JSON API (/v1/posenc/...).  No build step, no other hosts.
// Numbers shown are also kept, at full precision, in data-* attributes (the browser test reads them).
import {KEY_ITEM, KeyNeeded, api, askForKey, keyHeld} from "./api.js";
import {Panel} from "./panel.js";
import {initStudies, resetStudies} from "./studies.js";
import {$, $$, label} from "./util.js";

let served = [];  // ListModels rows

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
  resetStudies();
  init();
}

function forgetKey() {
  sessionStorage.removeItem(KEY_ITEM);
  served = [];
  $("#models").replaceChildren(Object.assign(document.createElement("legend"), {textContent: "Models"}));
  $("#panels").replaceChildren();
  $("#compare").hidden = true;
  keyHeld();
  resetStudies();
  init();  // a worker that needs a key asks for one again
}

document.addEventListener("DOMContentLoaded", () => {
  $("#ask").addEventListener("submit", run);
  $("#key").addEventListener("submit", useKey);
  $("#forget-key").addEventListener("click", forgetKey);
  initStudies();
  init();
});
