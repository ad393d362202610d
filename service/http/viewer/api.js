// posenc viewer: requests to this worker's JSON API (/v1/posenc/...), with the API key the page holds.
import {$} from "./util.js";

// --- API keys -----------------------------------------------------------------------------------------------
// A worker started with --api-keys-file answers 401 without `Authorization: Bearer KEY`.  The key typed into the
// page's form is kept in sessionStorage (this tab only, gone when it closes; never localStorage, a cookie or a
// URL) and sent as that header on every call.
export const KEY_ITEM = "posenc.apiKey";
export const heldKey = () => sessionStorage.getItem(KEY_ITEM);
export class KeyNeeded extends Error {}

export function askForKey(refused) {
  document.body.dataset.key = refused ? "refused" : "needed";
  $("#key-note").textContent = refused
    ? "The worker refused that API key (401). Check it and enter it again."
    : "This worker needs an API key. It is kept for this tab only and sent as an Authorization: Bearer header.";
  $("#key-held").hidden = true;
  $("#key").hidden = false;
  $("#api-key").focus();
}

export function keyHeld() {
  document.body.dataset.key = heldKey() ? "held" : "none";
  $("#key").hidden = true;
  $("#key-held").hidden = !heldKey();
}

export async function api(path, body) {
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

// float32 little-endian bytes (base64 in proto JSON) -> Float32Array
export function floats(b64) {
  const bin = atob(b64);
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  const view = new DataView(bytes.buffer), out = new Float32Array(bytes.length / 4);
  for (let i = 0; i < out.length; i++) out[i] = view.getFloat32(4 * i, true);
  return out;
}
