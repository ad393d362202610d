// posenc viewer: small DOM and text helpers shared by its modules.
export const $ = (sel, root = document) => root.querySelector(sel);
export const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));

export function clip(text, n) { return text.length > n ? text.slice(0, n - 1) + "…" : text; }
// What a piece looks like on screen: the byte tokenizer's visible space (U+2420) is missing from many fonts.
export const label = (piece) => piece.replaceAll("\u2420", "\u00b7");
