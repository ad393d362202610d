// posenc viewer: the Studies section, the measured tables of the results files the worker was given
// (--studies-dir: make lengthgen's, make passkey's, the other studies' and the benchmarks'), read from
// GET /v1/posenc/studies when the section is first opened.  Cells are shown as the results convention writes them:
// null as "–", booleans as yes/no, numbers as JavaScript prints them.
import {KeyNeeded, api} from "./api.js";
import {$} from "./util.js";

let listing = null;  // GET /v1/posenc/studies, once per key

const shown = (v) => v === null ? "–" : typeof v === "boolean" ? (v ? "yes" : "no") : String(v);

function source(folder, name, meta) {
  const load = Array.isArray(meta.load) ? `load ${meta.load.map((x) => x.toFixed(2)).join(" / ")}`
    : meta.load || "load not recorded";
  return [meta.command, meta.date, meta.machine, load].filter(Boolean).join(", ") + ` (${folder}/${name}.json)`;
}

function table(t) {
  const box = document.createElement("section");
  box.className = "study-table";
  box.dataset.table = t.id;
  const head = document.createElement("h3");
  head.textContent = t.title || t.id;
  const el = document.createElement("table"), tr = el.createTHead().insertRow(), body = el.createTBody();
  for (const c of t.columns) tr.append(Object.assign(document.createElement("th"), {textContent: shown(c)}));
  for (const r of t.rows) {
    const row = body.insertRow();
    for (const c of r) row.insertCell().textContent = shown(c);
  }
  box.append(head, el);
  if (t.note) box.append(Object.assign(document.createElement("p"), {className: "note", textContent: t.note}));
  return box;
}

async function show(name) {
  const box = $("#studies");
  box.dataset.state = "loading";
  try {
    const study = await api(`/v1/posenc/studies/${encodeURIComponent(name)}`);
    $("#study-source").textContent = source(listing.folder, study.name, study.meta);
    $("#study-tables").replaceChildren(...study.tables.map(table));
    box.dataset.study = study.name;
    box.dataset.state = "shown";
  } catch (err) {
    $("#study-tables").replaceChildren();
    $("#study-source").textContent = err instanceof KeyNeeded ? "" : `cannot read ${name}: ${err.message}`;
    box.dataset.state = err instanceof KeyNeeded ? "key" : "error";
  }
}

async function open() {
  const box = $("#studies"), pick = $("#study"), note = $("#studies-note");
  if (!box.open || listing) return;
  box.dataset.state = "loading";
  try {
    listing = await api("/v1/posenc/studies");
  } catch (err) {
    note.textContent = err instanceof KeyNeeded ? "" : `cannot list the studies: ${err.message}`;
    box.dataset.state = err instanceof KeyNeeded ? "key" : "error";
    return;
  }
  const skipped = listing.skipped.map((s) => `${s.name}.json (${s.reason})`).join("; ");
  note.textContent = !listing.folder ? "This worker was started without --studies-dir: it has no results to show."
    : `${listing.studies.length} results files in ${listing.folder}` + (skipped ? `; not results files: ${skipped}` : "");
  pick.replaceChildren(...listing.studies.map((s) => Object.assign(document.createElement("option"),
    {value: s.name, textContent: `${s.name} (${s.tables.length} tables${s.meta.date ? ", " + s.meta.date : ""})`})));
  pick.disabled = !listing.studies.length;
  if (!listing.studies.length) { box.dataset.state = "empty"; return; }
  const first = listing.studies.find((s) => s.name === "lengthgen") || listing.studies[0];
  pick.value = first.name;
  await show(first.name);
}

// Forget what was read with the key in use (a new key may see another answer, or none).
export function resetStudies() {
  listing = null;
  const box = $("#studies");
  delete box.dataset.state;
  delete box.dataset.study;
  $("#study").replaceChildren();
  $("#study-tables").replaceChildren();
  $("#studies-note").textContent = $("#study-source").textContent = "";
  if (box.open) open();
}

export function initStudies() {
  $("#studies").addEventListener("toggle", open);
  $("#study").addEventListener("change", (e) => show(e.target.value));
}
