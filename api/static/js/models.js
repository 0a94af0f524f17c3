// Models: the tenant's list with upload (file picker or drag and drop), and one model's detail
// with the form that starts a compilation.

import { api, uploadModel } from "./api.js";
import { compilationRows, COMPILATION_HEADERS } from "./compilations.js";
import { bytes, clear, empty, facts, h, link, shape, table, when } from "./dom.js";
import { problemBox } from "./problem.js";

export async function modelsPage(main, _params, { signal }) {
  const { models } = await api("/v1/models", { signal });
  const message = h("div", { id: "upload-message" });
  const progress = h("progress", { id: "upload-progress", max: 1, value: 0, hidden: true });
  const input = h("input", { type: "file", id: "upload-input", accept: ".onnx" });

  async function send(file) {
    clear(message);
    progress.hidden = false;
    progress.value = 0;
    try {
      const model = await uploadModel(file, (fraction) => (progress.value = fraction));
      location.hash = `#/models/${model.id}`;
    } catch (err) {
      progress.hidden = true;
      clear(message, problemBox(err));
    }
  }

  input.addEventListener("change", () => input.files.length && send(input.files[0]));
  const zone = h(
    "div",
    { class: "dropzone", id: "dropzone" },
    "Drop an ONNX model here, or ",
    h("label", {}, "choose a file", input),
    progress,
  );
  // Drag and drop: the default action of a dropped file is to open it in the tab, which
  // would leave the console.
  zone.addEventListener("dragover", (event) => {
    event.preventDefault();
    zone.classList.add("over");
  });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    zone.classList.remove("over");
    if (event.dataTransfer.files.length) send(event.dataTransfer.files[0]);
  });

  const rows = models
    .slice()
    .reverse()
    .map((m) =>
      h(
        "tr",
        { dataset: { model: m.id } },
        h("td", {}, link(`#/models/${m.id}`, m.name || m.id)),
        h("td", { class: "mono" }, m.id),
        h("td", { class: "num" }, bytes(m.size)),
        h("td", { class: "num" }, m.nodes),
        h("td", {}, m.inputs.map((i) => `${i.name} ${shape(i.shape)}`).join(", ")),
        h("td", {}, when(m.created)),
      ),
    );
  clear(
    main,
    h("h1", {}, "Models"),
    h("section", { class: "card" }, zone, message),
    h(
      "section",
      { class: "card" },
      rows.length
        ? table(["Name", "Id", "Size", "Nodes", "Inputs", "Uploaded"], rows, { id: "models" })
        : empty("No models yet: upload one above."),
    ),
  );
}

export async function modelPage(main, [id], { signal }) {
  const [model, { compilations }] = await Promise.all([
    api(`/v1/models/${encodeURIComponent(id)}`, { signal }),
    api("/v1/compilations", { signal }),
  ]);
  const mine = compilations.filter((c) => c.model === model.id).reverse();
  const histogram = Object.entries(model.op_histogram).sort((a, b) => b[1] - a[1]);
  const most = Math.max(1, ...histogram.map(([, n]) => n));
  const tensors = (specs) =>
    table(
      ["Name", "Type", "Shape"],
      specs.map((t) =>
        h("tr", {}, h("td", {}, t.name), h("td", {}, t.dtype), h("td", {}, shape(t.shape))),
      ),
    );

  clear(
    main,
    h("h1", {}, model.name || model.id),
    h(
      "div",
      { class: "grid2" },
      h(
        "section",
        { class: "card" },
        facts([
          ["Id", h("span", { class: "mono" }, model.id)],
          ["Digest", h("span", { class: "mono" }, model.digest)],
          ["Size", bytes(model.size)],
          ["Nodes", model.nodes],
          ["IR version", model.ir_version],
          [
            "Opsets",
            Object.entries(model.opsets)
              .map(([d, v]) => `${d || "ai.onnx"} ${v}`)
              .join(", "),
          ],
          ["Producer", model.producer],
          ["Uploaded", when(model.created)],
        ]),
        h("h2", {}, "Inputs"),
        tensors(model.inputs),
        h("h2", {}, "Outputs"),
        tensors(model.outputs),
      ),
      h(
        "section",
        { class: "card" },
        h("h2", {}, "Operators"),
        h(
          "div",
          { class: "bars", id: "op-histogram" },
          histogram.map(([op, n]) => [
            h("span", {}, op),
            h("div", {}, h("div", { class: "bar-fill", style: `width:${(100 * n) / most}%` })),
            h("span", { class: "num" }, n),
          ]),
        ),
      ),
    ),
    compileForm(model),
    h(
      "section",
      { class: "card" },
      h("h2", {}, "Compilations of this model"),
      mine.length
        ? table(COMPILATION_HEADERS, compilationRows(mine), { id: "model-compilations" })
        : empty("None yet."),
    ),
  );
}

// The form that starts a compilation: target, a shape per input (symbolic dims prefilled
// with 1), and a tuning budget in trials or seconds.
function compileForm(model) {
  const target = h("input", {
    type: "text",
    id: "compile-target",
    value: "llvm",
    list: "targets",
    size: 24,
  });
  const targets = h(
    "datalist",
    { id: "targets" },
    ["llvm", "llvm -mcpu=native", "cuda -arch=sm_90"].map((t) => h("option", { value: t })),
  );
  const shapeInputs = model.inputs.map((spec) => {
    const dims = spec.shape.map((d) => (typeof d === "number" && d > 0 ? d : 1));
    return [
      spec.name,
      h("input", { type: "text", id: `shape-${spec.name}`, value: dims.join(","), size: 16 }),
    ];
  });
  const mode = h(
    "select",
    { id: "tuning-mode" },
    h("option", { value: "none" }, "no tuning (default schedules)"),
    h("option", { value: "trials" }, "trials"),
    h("option", { value: "time_budget" }, "time budget (s)"),
  );
  const amount = h("input", { type: "number", id: "tuning-value", min: 1, value: 64, size: 8 });
  const message = h("div");
  const submit = h("button", { type: "submit", class: "primary", id: "compile-submit" }, "Compile");
  const form = h(
    "form",
    { class: "inline", id: "compile-form" },
    h("label", {}, "Target", target, targets),
    shapeInputs.map(([name, input]) => h("label", {}, `Shape of ${name}`, input)),
    h("label", {}, "Tuning", mode),
    h("label", {}, "Budget", amount),
    submit,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clear(message);
    const body = { model: model.id, target: target.value.trim() || "llvm", shapes: {} };
    for (const [name, input] of shapeInputs) {
      const text = input.value.trim();
      if (text)
        body.shapes[name] = text
          .split(/[\s,x×]+/)
          .filter(Boolean)
          .map(Number);
    }
    if (mode.value !== "none") body.tuning = { [mode.value]: Number(amount.value) };
    submit.disabled = true;
    try {
      const job = await api("/v1/compilations", { method: "POST", json: body });
      location.hash = `#/compilations/${job.id}`;
    } catch (err) {
      clear(message, problemBox(err));
    } finally {
      submit.disabled = false;
    }
  });
  return h("section", { class: "card" }, h("h2", {}, "Compile"), form, message);
}
