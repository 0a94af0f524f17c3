// Small DOM and formatting helpers. Elements are built with h() rather than innerHTML so that
// names and messages that users control (model names, error details) can never inject markup.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      el.addEventListener(name.slice(2), value);
    } else if (name === "dataset") {
      Object.assign(el.dataset, value);
    } else if (value === true) {
      el.setAttribute(name, "");
    } else {
      el.setAttribute(name, String(value));
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function clear(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

export function link(href, text, attrs = {}) {
  return h("a", { href, ...attrs }, text);
}

// A definition list of [label, value] pairs; rows whose value is null are left out.
export function facts(rows) {
  return h(
    "dl",
    { class: "facts" },
    rows
      .filter(([, value]) => value !== null && value !== undefined)
      .map(([label, value]) => [h("dt", {}, label), h("dd", {}, value)]),
  );
}

export function table(headers, rows, attrs = {}) {
  return h(
    "table",
    attrs,
    h(
      "thead",
      {},
      h(
        "tr",
        {},
        headers.map((name) => h("th", {}, name)),
      ),
    ),
    h("tbody", {}, rows),
  );
}

export function empty(text) {
  return h("p", { class: "empty" }, text);
}

// --- formatting ---------------------------------------------------------------------------

export function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

export function when(seconds) {
  if (!seconds) return "—";
  return new Date(seconds * 1000).toLocaleString();
}

export function ms(value, digits = 3) {
  return value === null || value === undefined ? "—" : `${Number(value).toFixed(digits)} ms`;
}

export function num(value, digits = 2) {
  return value === null || value === undefined ? "—" : Number(value).toFixed(digits);
}

export function shape(dims) {
  return `[${(dims || []).join(", ")}]`;
}

export function shortDigest(digest) {
  return digest ? `${digest.slice(0, 19)}…` : "—";
}

export function badge(text, kind = text) {
  return h("span", { class: `badge badge-${kind}`, dataset: { status: text } }, text);
}
