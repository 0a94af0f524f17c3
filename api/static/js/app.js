// The console's shell: sign-in, the hash router, and the page frame. Pages live in their own
// modules; each is `async (main, params, ctx)` and stops its live work when ctx.signal aborts.

import { api, onUnauthorized, session } from "./api.js";
import { clear, h } from "./dom.js";
import { compilationPage, compilationsPage } from "./compilations.js";
import { artifactPage } from "./artifacts.js";
import { deploymentPage, deploymentsPage } from "./deployments.js";
import { modelPage, modelsPage } from "./models.js";
import { problemBox } from "./problem.js";
import { tuningPage } from "./tuning.js";

// Hash routes, so that a pasted URL (…/ui/#/compilations/c-…) opens the same page and the
// api serves one index.html for all of them.
const ROUTES = [
  [/^\/models$/, modelsPage, "models", "Models"],
  [/^\/models\/([^/]+)$/, modelPage, "models", "Model"],
  [/^\/compilations$/, compilationsPage, "compilations", "Compilations"],
  [/^\/compilations\/([^/]+)$/, compilationPage, "compilations", "Compilation"],
  [/^\/artifacts\/([^/]+)$/, artifactPage, "compilations", "Artifact"],
  [/^\/deployments$/, deploymentsPage, "deployments", "Deployments"],
  [/^\/deployments\/([^/]+)$/, deploymentPage, "deployments", "Deployment"],
  [/^\/tuning$/, tuningPage, "tuning", "Tuning log"],
];

const main = document.getElementById("main");
let current = null; // the AbortController of the page on screen
let signingIn = false; // the sign-in page shows a refused key itself

function route() {
  if (current) current.abort();
  current = new AbortController();
  const path = decodeURIComponent(location.hash.replace(/^#/, "")) || "/models";
  if (!session.key) return signInPage(path);
  signingIn = false;
  showShell(true);
  for (const [pattern, page, section, title] of ROUTES) {
    const match = pattern.exec(path);
    if (!match) continue;
    document.title = `${title} · Kiln console`;
    for (const a of document.querySelectorAll("#nav a")) {
      a.classList.toggle("current", a.dataset.section === section);
    }
    const ctx = { signal: current.signal };
    clear(main, h("p", { class: "muted" }, "Loading…"));
    return page(main, match.slice(1), ctx).catch((err) => {
      if (err.name === "AbortError" || ctx.signal.aborted) return;
      clear(main, problemBox(err));
    });
  }
  document.title = "Not found · Kiln console";
  clear(main, h("div", { class: "problem", role: "alert" }, h("strong", {}, "Not found"), path));
}

function showShell(signedIn) {
  document.getElementById("nav").hidden = !signedIn;
  document.getElementById("who").hidden = !signedIn;
  if (signedIn) {
    const key = session.key;
    document.getElementById("who-key").textContent = `key …${key.slice(-4)}`;
  }
}

function signInPage(next) {
  signingIn = true;
  showShell(false);
  document.title = "Sign in · Kiln console";
  const input = h("input", {
    type: "password",
    id: "signin-key",
    autocomplete: "off",
    placeholder: "X-API-Key",
    required: true,
  });
  const message = h("div");
  const form = h(
    "form",
    { class: "card", id: "signin-form" },
    h("h1", {}, "Sign in"),
    h(
      "p",
      { class: "muted" },
      "Paste your API key. It is kept for this tab only and sent with every request.",
    ),
    h("label", {}, "API key", input),
    h("p", {}, h("button", { type: "submit", class: "primary", id: "signin-submit" }, "Sign in")),
    message,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    session.signIn(input.value.trim());
    try {
      await api("/v1/models"); // any key-scoped read tells whether the key is valid
    } catch (err) {
      session.signOut();
      clear(message, problemBox(err));
      return;
    }
    if (location.hash === `#${next}`) route();
    else location.hash = next;
  });
  clear(main, h("section", { class: "signin" }, h("div", { class: "card" }, form)));
  input.focus();
}

document.getElementById("signout").addEventListener("click", () => {
  session.signOut();
  location.hash = "#/models";
  route();
});

onUnauthorized(() => {
  // The key stopped working (revoked, or the server restarted with other keys).
  if (session.key && !signingIn) {
    session.signOut();
    route();
  }
});

window.addEventListener("hashchange", route);
route();
