// posenc viewer: the Studies section, the measured tables of the results files the worker was given
// (--studies-dir: make lengthgen's, make passkey's, the other studies' and the benchmarks'), listed from
// GET /v1/posenc/studies each time the section is opened.  Cells are shown as the results convention writes them:
// null as "–", booleans as yes/no, numbers as JavaScript prints them.
import {KeyNeeded, api} from "./api.js";
import {$} from "./util.js";

let turn = 0;  // bumped by every listing, pick and key change: an answer that comes back after a newer one is dropped

const shown = (v) => v === null ? "–" : typeof v === "boolean" ? (v ? "yes" : "no") : String(v);

function source(folder, name, meta) {
  const load = Array.isArray(meta.load)
    ? `load ${meta.load.map((x) => Number.isFinite(x) ? x.toFixed(2) : String(x)).join(" / ")}`
    : typeof meta.load === "string" ? meta.load : "load not recorded";
  return [meta.command, meta.date, meta.machine, load].filter((x) => typeof x === "string" && x).join(", ") +
    ` (${folder}/${name}.json)`;
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

async function show(folder, name) {
  const box = $("#studies"), mine = ++turn;
  box.dataset.state = "loading";
  let study;
  try {
    study = await api(`/v1/posenc/studies/${encodeURIComponent(name)}`);
  } catch (err) {
    if (mine !== turn) return;
    $("#study-tables").replaceChildren();
    $("#study-source").textContent = err instanceof KeyNeeded ? "" : `cannot read ${name}: ${err.message}`;
    box.dataset.state = err instanceof KeyNeeded ? "key" : "error";
    return;
  }
  if (mine !== turn) return;
  $("#study-source").textContent = source(folder, study.name, study.meta);
  $("#study-tables").replaceChildren(...study.tables.map(table));
  box.dataset.study = study.name;
  box.dataset.state = "shown";
}

// Each opening lists the folder again (a study may have finished since), keeping the pick where it still is.
async function open() {
  const box = $("#studies"), pick = $("#study"), note = $("#studies-note");
  if (!box.open) return;
  const mine = ++turn, kept = pick.value;
  box.dataset.state = "loading";
  let listing;
  try {
    listing = await api("/v1/posenc/studies");
  } catch (err) {
    if (mine !== turn) return;
    note.textContent = err instanceof KeyNeeded ? "" : `cannot list the studies: ${err.message}`;
    box.dataset.state = err instanceof KeyNeeded ? "key" : "error";
    return;
  }
  if (mine !== turn) return;
  const skipped = listing.skipped.map((s) => `${s.name}.json (${s.reason})`).join("; ");
  note.textContent = !listing.folder ? "This worker was started without --studies-dir: it has no results to show."
    : `${listing.studies.length} results files in ${listing.folder}` + (skipped ? `; not results files: ${skipped}` : "");
  pick.replaceChildren(...listing.studies.map((s) => Object.assign(document.createElement("option"),
    {value: s.name, textContent: `${s.name} (${s.tables.length} tables${s.meta.date ? ", " + s.meta.date : ""})`})));
  pick.disabled = !listing.studies.length;
  pick.dataset.folder = listing.folder;
  if (!listing.studies.length) {
    $("#study-tables").replaceChildren();
    $("#study-source").textContent = "";
    box.dataset.state = "empty";
    return;
  }
  const first = listing.studies.find((s) => s.name === kept) || listing.studies.find((s) => s.name === "lengthgen") ||
    listing.studies[0];
  pick.value = first.name;
  await show(listing.folder, first.name);
}

// Forget what was read with the key in use (a new key may see another answer, or none).
export function resetStudies() {
  turn++;
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
  $("#study").addEventListener("change", (e) => show(e.target.dataset.folder, e.target.value));
}
