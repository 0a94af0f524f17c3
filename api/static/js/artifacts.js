// An artifact (a compiled module): its manifest in readable form, per-kernel schedules with
// their share of the model's time, download, and the form that deploys it.

import { api } from "./api.js";
import { badge, bytes, clear, facts, h, link, ms, num, shape, table, when } from "./dom.js";
import { problemBox } from "./problem.js";

export async function artifactPage(main, [digest], { signal }) {
  const base = `/v1/artifacts/${encodeURIComponent(digest)}`;
  const [manifest, kernels] = await Promise.all([
    api(`${base}/manifest`, { signal }),
    api(`${base}/kernels`, { signal }),
  ]);
  const verification = manifest.verification || {};
  const tuned = kernels.kernels.filter((k) => k.schedule === "tuned").length;

  const kernelRows = kernels.kernels.map((k) =>
    h(
      "tr",
      { dataset: { kernel: k.name, schedule: k.schedule } },
      h("td", { class: "mono" }, k.name),
      h("td", {}, badge(k.schedule === "tuned" ? "tuned" : "default schedule", k.schedule)),
      h("td", {}, k.template || "—"),
      h(
        "td",
        { class: "mono" },
        k.config
          ? Object.entries(k.config)
              .map(([n, v]) => `${n}=${v}`)
              .join(" ")
          : "—",
      ),
      h("td", { class: "num" }, k.measured_us === null ? "—" : `${num(k.measured_us, 1)} µs`),
      h("td", { class: "num" }, num(k.gflops, 1)),
      h("td", {}, shareBar(k.share)),
    ),
  );

  clear(
    main,
    h("h1", {}, "Artifact ", h("span", { class: "mono" }, `${digest.slice(0, 23)}…`)),
    h(
      "section",
      { class: "card" },
      h(
        "div",
        { class: "row" },
        h(
          "button",
          {
            type: "button",
            class: "primary",
            id: "artifact-download",
            onclick: () => download(base, digest),
          },
          "Download module archive",
        ),
        kernels.compilation
          ? link(`#/compilations/${kernels.compilation}`, `built by ${kernels.compilation}`)
          : "",
      ),
      h("div", { id: "download-message" }),
    ),
    h(
      "div",
      { class: "grid2" },
      h(
        "section",
        { class: "card" },
        h("h2", {}, "Build"),
        facts([
          ["Digest", h("span", { class: "mono" }, digest)],
          ["Model", h("span", { class: "mono" }, manifest.model)],
          ["Target", manifest.target],
          ["Fingerprint", h("span", { class: "mono" }, manifest.target_fingerprint)],
          ["Compiler", manifest.compiler_version],
          ["Shapes", JSON.stringify((manifest.options || {}).shapes || "as declared")],
          ["Tuning request", JSON.stringify((manifest.options || {}).tuning || "none")],
          [
            "Compile time",
            kernels.compile_seconds === null ? "—" : `${num(kernels.compile_seconds, 2)} s`,
          ],
          [
            "Tuning time",
            kernels.tuning_seconds === null ? "not tuned" : `${num(kernels.tuning_seconds, 1)} s`,
          ],
          ["Measured latency", ms(kernels.latency_ms)],
          ["Memory", h("span", { id: "artifact-memory" }, memoryText(kernels))],
          ["Built", when(manifest.created)],
        ]),
      ),
      h(
        "section",
        { class: "card" },
        h("h2", {}, "Verification"),
        facts([
          ["Result", badge(verification.passed ? "passed" : "failed")],
          ["Against", verification.oracle],
          [
            "Max abs error",
            h(
              "span",
              { id: "verification-error" },
              verification.max_abs_error === undefined
                ? "—"
                : Number(verification.max_abs_error).toExponential(3),
            ),
          ],
          ["Tolerance", `rtol ${verification.rtol}, atol ${verification.atol}`],
        ]),
        h("h2", {}, "Signature"),
        table(
          ["", "Name", "Type", "Shape"],
          [
            ...(manifest.inputs || []).map((t) => sigRow("in", t)),
            ...(manifest.outputs || []).map((t) => sigRow("out", t)),
          ],
        ),
      ),
    ),
    h(
      "section",
      { class: "card" },
      h(
        "h2",
        {},
        `Kernels: ${tuned} of ${kernels.kernels.length} tuned`,
        kernels.distinct_kernels ? `, ${kernels.distinct_kernels} distinct` : "",
      ),
      table(
        ["Kernel", "Schedule", "Template", "Config", "Measured", "GFLOP/s", "Share of model time"],
        kernelRows,
        { id: "kernels" },
      ),
      h(
        "p",
        { class: "muted" },
        "Share: the kernel's measured time over the whole model's measured latency; default " +
          "schedules are not timed alone.",
      ),
    ),
    deployForm(digest, manifest),
  );
}

function sigRow(kind, t) {
  return h(
    "tr",
    {},
    h("td", { class: "muted" }, kind),
    h("td", {}, t.name),
    h("td", {}, t.dtype),
    h("td", {}, shape(t.shape)),
  );
}

function shareBar(share) {
  if (share === null || share === undefined) return "—";
  const percent = Math.min(100, share * 100);
  return h(
    "span",
    { class: "share" },
    h("span", { class: "fill", style: `width:${Math.max(1, percent)}px` }),
    `${percent.toFixed(1)}%`,
  );
}

// A plain <a href> cannot send the API key, so the archive is fetched and handed to the
// browser as a blob URL.
async function download(base, digest) {
  const message = document.getElementById("download-message");
  clear(message);
  try {
    const response = await api(base, { raw: true });
    const url = URL.createObjectURL(await response.blob());
    const a = h("a", { href: url, download: `${digest.split(":")[1].slice(0, 16)}.kiln` });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  } catch (err) {
    clear(message, problemBox(err));
  }
}

function deployForm(digest, manifest) {
  const name = h("input", {
    type: "text",
    id: "deploy-name",
    value: "",
    placeholder: "e.g. mlp",
    required: true,
  });
  const version = h("input", { type: "text", id: "deploy-version", value: "1", size: 4 });
  const submit = h("button", { type: "submit", class: "primary", id: "deploy-submit" }, "Deploy");
  const message = h("div");
  const form = h(
    "form",
    { class: "inline", id: "deploy-form" },
    h("label", {}, "Name", name),
    h("label", {}, "Version", version),
    submit,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clear(message);
    submit.disabled = true;
    try {
      const body = {
        artifact: digest,
        name: name.value.trim(),
        version: version.value.trim() || "1",
      };
      const deployment = await api("/v1/deployments", { method: "POST", json: body });
      location.hash = `#/deployments/${deployment.name}`;
    } catch (err) {
      clear(message, problemBox(err));
    } finally {
      submit.disabled = false;
    }
  });
  return h(
    "section",
    { class: "card" },
    h("h2", {}, "Deploy"),
    h(
      "p",
      { class: "muted" },
      `Loads this ${manifest.target} module on the runtime server under a name.`,
    ),
    form,
    message,
  );
}

// The run's planned workspace, and what one kernel takes beside it in a call (a Winograd
// conv's transformed tiles, a GEMM's packed panels).
function memoryText(kernels) {
  if (kernels.workspace_bytes === null) return "—";
  const scratch = kernels.kernel_scratch_bytes
    ? ` + up to ${bytes(kernels.kernel_scratch_bytes)} kernel scratch in a call`
    : "";
  return `${bytes(kernels.workspace_bytes)} workspace${scratch}`;
}
