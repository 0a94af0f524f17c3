// Deployments: status, versions, load/unload, request count and latency quantiles from the
// runtime server's metrics (through the api), and a "try it" panel that sends an inference.

import { api } from "./api.js";
import { badge, clear, empty, facts, h, link, ms, shape, shortDigest, table, when } from "./dom.js";
import { parseNpy } from "./npy.js";
import { problemBox } from "./problem.js";

const STATS_EVERY_MS = 5000;

// numpy dtype names (the manifest's) -> KServe v2 datatypes (what the runtime server takes).
const DATATYPES = {
  bool: "BOOL",
  uint8: "UINT8",
  uint16: "UINT16",
  uint32: "UINT32",
  uint64: "UINT64",
  int8: "INT8",
  int16: "INT16",
  int32: "INT32",
  int64: "INT64",
  float16: "FP16",
  float32: "FP32",
  float64: "FP64",
};

// A quantile from histogram buckets is only as fine as its bucket: show the bound with it.
function quantile(value, bucket) {
  if (value === null || value === undefined) return "—";
  return bucket ? `${ms(value)} (bucket ≤ ${ms(bucket, 1)})` : ms(value);
}

export async function deploymentsPage(main, _params, { signal }) {
  const { deployments } = await api("/v1/deployments", { signal });
  const rows = deployments.map((d) => {
    const state = h("td", {}, "…");
    const requests = h("td", { class: "num" }, "…");
    const p50 = h("td", { class: "num" }, "…");
    const p99 = h("td", { class: "num" }, "…");
    // Each row's stats arrive on their own: one slow or refused scrape spoils only its row.
    api(`/v1/deployments/${d.name}/stats`, { signal })
      .then((s) => {
        clear(state, badge(s.state));
        requests.textContent = s.requests;
        p50.textContent = quantile(s.p50_ms, s.p50_bucket_ms);
        p99.textContent = quantile(s.p99_ms, s.p99_bucket_ms);
      })
      .catch((err) => {
        if (err.name !== "AbortError") clear(state, h("span", { title: err.message }, "unknown"));
      });
    return h(
      "tr",
      { dataset: { deployment: d.name } },
      h("td", {}, link(`#/deployments/${d.name}`, d.name)),
      h("td", {}, d.version),
      h("td", {}, link(`#/artifacts/${d.artifact}`, shortDigest(d.artifact), { class: "mono" })),
      state,
      requests,
      p50,
      p99,
      h("td", {}, when(d.created)),
    );
  });
  clear(
    main,
    h("h1", {}, "Deployments"),
    h(
      "section",
      { class: "card" },
      rows.length
        ? table(
            ["Name", "Version", "Artifact", "State", "Requests", "p50", "p99", "Deployed"],
            rows,
            { id: "deployments" },
          )
        : empty("Nothing deployed: deploy an artifact from its page."),
    ),
  );
}

export async function deploymentPage(main, [name], { signal }) {
  const path = `/v1/deployments/${encodeURIComponent(name)}`;
  const deployment = await api(path, { signal });
  const manifest = await api(`/v1/artifacts/${deployment.artifact}/manifest`, { signal });
  const stats = h(
    "div",
    { id: "deployment-stats" },
    h("p", { class: "muted" }, "Reading metrics…"),
  );

  async function refresh() {
    try {
      const s = await api(`${path}/stats`, { signal });
      clear(
        stats,
        facts([
          ["State", badge(s.state)],
          ["Requests", h("span", { id: "stat-requests" }, s.requests)],
          ["Mean", ms(s.mean_ms)],
          ["p50", quantile(s.p50_ms, s.p50_bucket_ms)],
          ["p99", quantile(s.p99_ms, s.p99_bucket_ms)],
        ]),
        h(
          "p",
          { class: "muted" },
          "p50 and p99 are interpolated inside the runtime's histogram buckets; the bucket " +
            "bound says how coarse that is. The mean is exact.",
        ),
        h("h2", {}, "Versions on the runtime server"),
        table(
          ["Version", "State", "Reason"],
          s.versions.map((v) =>
            h(
              "tr",
              {},
              h("td", {}, v.version),
              h("td", {}, badge(v.state)),
              h("td", {}, v.reason || ""),
            ),
          ),
          { id: "versions" },
        ),
      );
    } catch (err) {
      if (err.name !== "AbortError") clear(stats, problemBox(err));
    }
  }

  const unloadMessage = h("div");
  const unload = h(
    "button",
    {
      type: "button",
      class: "danger",
      id: "deployment-unload",
      onclick: async () => {
        unload.disabled = true;
        try {
          await api(path, { method: "DELETE" });
          location.hash = "#/deployments";
        } catch (err) {
          clear(unloadMessage, problemBox(err));
          unload.disabled = false;
        }
      },
    },
    "Unload",
  );

  clear(
    main,
    h("h1", {}, "Deployment ", h("span", { class: "mono" }, deployment.name)),
    h(
      "div",
      { class: "grid2" },
      h(
        "section",
        { class: "card" },
        facts([
          ["Version", deployment.version],
          [
            "Artifact",
            link(`#/artifacts/${deployment.artifact}`, shortDigest(deployment.artifact)),
          ],
          ["Target", manifest.target],
          ["Inference URL", h("span", { class: "mono" }, deployment.infer_url)],
          ["Deployed", when(deployment.created)],
        ]),
        h("div", { class: "row" }, unload),
        unloadMessage,
        loadForm(deployment),
      ),
      h("section", { class: "card" }, h("h2", {}, "Traffic"), stats),
    ),
    tryIt(deployment, manifest, refresh),
  );
  await refresh();
  const timer = setInterval(refresh, STATS_EVERY_MS);
  signal.addEventListener("abort", () => clearInterval(timer), { once: true });
}

// Load another version (or another artifact) under the same name.
function loadForm(deployment) {
  const artifact = h("input", {
    type: "text",
    id: "load-artifact",
    value: deployment.artifact,
    size: 40,
    class: "mono",
  });
  const version = h("input", {
    type: "text",
    id: "load-version",
    value: String(Number(deployment.version) + 1),
    size: 4,
  });
  const message = h("div");
  const form = h(
    "form",
    { class: "inline" },
    h("label", {}, "Artifact", artifact),
    h("label", {}, "Version", version),
    h("button", { type: "submit", class: "secondary", id: "load-submit" }, "Load"),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clear(message);
    try {
      const body = {
        artifact: artifact.value.trim(),
        name: deployment.name,
        version: version.value.trim(),
      };
      await api("/v1/deployments", { method: "POST", json: body });
      window.dispatchEvent(new HashChangeEvent("hashchange")); // re-read the page
    } catch (err) {
      clear(message, problemBox(err));
    }
  });
  return h("div", {}, h("h2", {}, "Load a version"), form, message);
}

// "Try it": one input row per model input (random values or an uploaded .npy), the outputs
// shown as a top-5 table when an output looks like one row of class scores.
function tryIt(deployment, manifest, afterInference) {
  const inputs = (manifest.inputs || []).map((spec) => {
    const file = h("input", { type: "file", id: `npy-${spec.name}`, accept: ".npy" });
    return { spec, file };
  });
  const result = h("div", { id: "infer-result" });
  const submit = h(
    "button",
    { type: "button", class: "primary", id: "infer-submit" },
    "Run inference",
  );
  submit.addEventListener("click", async () => {
    clear(result, h("p", { class: "muted" }, "Running…"));
    submit.disabled = true;
    try {
      const tensors = [];
      for (const { spec, file } of inputs) tensors.push(await tensorFor(spec, file.files[0]));
      const started = performance.now();
      const response = await api(`/v1/deployments/${deployment.name}/infer`, {
        method: "POST",
        json: { inputs: tensors },
      });
      const elapsed = performance.now() - started;
      clear(result, showOutputs(response, elapsed));
      afterInference();
    } catch (err) {
      clear(result, problemBox(err));
    } finally {
      submit.disabled = false;
    }
  });
  return h(
    "section",
    { class: "card" },
    h("h2", {}, "Try it"),
    table(
      ["Input", "Type", "Shape", "Values"],
      inputs.map(({ spec, file }) =>
        h(
          "tr",
          {},
          h("td", {}, spec.name),
          h("td", {}, spec.dtype),
          h("td", {}, shape(spec.shape)),
          h("td", {}, h("label", {}, "random normal, or a .npy file:", file)),
        ),
      ),
    ),
    h("p", {}, submit),
    result,
  );
}

async function tensorFor(spec, file) {
  const datatype = DATATYPES[spec.dtype];
  if (!datatype) throw new Error(`input ${spec.name}: unsupported type ${spec.dtype}`);
  if (file) {
    let array;
    try {
      array = parseNpy(await file.arrayBuffer());
    } catch (err) {
      throw new Error(`${file.name}: ${err.message}`);
    }
    const data = datatype === "BOOL" ? array.data.map(Boolean) : array.data;
    return { name: spec.name, shape: array.shape, datatype, data };
  }
  const count = spec.shape.reduce((a, b) => a * b, 1);
  const data = new Array(count);
  for (let i = 0; i < count; i += 1) {
    if (datatype.startsWith("FP")) data[i] = Number(normal().toFixed(6));
    else if (datatype === "BOOL") data[i] = false;
    else data[i] = 0;
  }
  return { name: spec.name, shape: spec.shape, datatype, data };
}

// A standard normal sample (Box-Muller).
function normal() {
  const u = 1 - Math.random();
  const v = Math.random();
  return Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * v);
}

function showOutputs(response, elapsed) {
  return h(
    "div",
    {},
    h(
      "p",
      { class: "muted" },
      `${response.model_name} version ${response.model_version}, ${elapsed.toFixed(1)} ms round trip`,
    ),
    response.outputs.map((out) => {
      const classes = out.shape[out.shape.length - 1];
      const rows = out.shape.slice(0, -1).reduce((a, b) => a * b, 1);
      const body =
        rows === 1 && classes > 1 && typeof out.data[0] === "number"
          ? topFive(out.data)
          : h(
              "pre",
              { class: "events" },
              JSON.stringify(out.data.slice(0, 64)),
              out.data.length > 64 ? " …" : "",
            );
      return h(
        "div",
        { class: "output", dataset: { output: out.name } },
        h("h2", {}, `${out.name} ${out.datatype} ${shape(out.shape)}`),
        body,
      );
    }),
  );
}

function topFive(scores) {
  const order = scores
    .map((s, i) => [i, s])
    .sort((a, b) => b[1] - a[1])
    .slice(0, 5);
  return h(
    "div",
    {},
    h("p", {}, "Top class: ", h("strong", { id: "top-class" }, String(order[0][0]))),
    table(
      ["Class", "Score"],
      order.map(([i, s]) =>
        h("tr", {}, h("td", {}, i), h("td", { class: "num" }, s.toPrecision(5))),
      ),
      { class: "top5" },
    ),
  );
}
