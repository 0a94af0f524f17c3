// Compilations: the tenant's jobs, and one job followed live over Server-Sent Events: its
// stage, tasks done, a best-GFLOP/s curve per tuning task, the estimated model latency over
// time, cancel, and the error when it fails.

import { api, followEvents } from "./api.js";
import { drawChart } from "./chart.js";
import { badge, clear, empty, facts, h, link, ms, shortDigest, table, when } from "./dom.js";
import { problemBox } from "./problem.js";

const STAGES = ["queued", "importing", "tuning", "building", "verifying", "storing", "done"];
const FINAL = new Set(["done", "failed", "cancelled"]);

export const COMPILATION_HEADERS = [
  "Id",
  "Target",
  "Status",
  "Stage",
  "Tasks",
  "Latency",
  "Created",
];

export function compilationRows(jobs) {
  return jobs.map((c) =>
    h(
      "tr",
      { dataset: { compilation: c.id } },
      h("td", {}, link(`#/compilations/${c.id}`, c.id, { class: "mono" })),
      h("td", {}, c.target),
      h("td", {}, badge(c.status)),
      h("td", {}, c.stage),
      h("td", { class: "num" }, `${c.progress.tasks_done}/${c.progress.tasks_total}`),
      h("td", { class: "num" }, ms(c.best_latency_ms)),
      h("td", {}, when(c.created)),
    ),
  );
}

export async function compilationsPage(main, _params, { signal }) {
  const { compilations } = await api("/v1/compilations", { signal });
  const jobs = compilations.slice().reverse();
  clear(
    main,
    h("h1", {}, "Compilations"),
    h(
      "section",
      { class: "card" },
      jobs.length
        ? table(["Id", ...COMPILATION_HEADERS.slice(1)], compilationRows(jobs), {
            id: "compilations",
          })
        : empty("No compilations yet: start one from a model's page."),
    ),
  );
}

export async function compilationPage(main, [id], { signal }) {
  const path = `/v1/compilations/${encodeURIComponent(id)}`;
  let job = await api(path, { signal });

  // What the event stream has told so far; render() draws it all, at most once a frame.
  const state = { tasks: new Map(), latency: [], events: [], started: null, link: "connecting" };
  const status = h("span", { id: "job-status" });
  const stages = h("ol", { class: "stages", id: "job-stages" });
  const progress = h("progress", { id: "job-progress", max: 1, value: 0 });
  const progressText = h("span", { class: "muted", id: "job-progress-text" });
  const details = h("div");
  const outcome = h("div", { id: "job-outcome" });
  // Task figures join the latency figure in one grid (display: contents on this wrapper).
  const curves = h("div", { class: "charts-tasks", id: "curves" });
  const latencyCanvas = h("canvas", { class: "chart", id: "curve-latency" });
  const log = h("pre", { class: "events", id: "job-events" });
  const streamState = h("span", { class: "muted", id: "stream-state" });
  const cancel = h(
    "button",
    { type: "button", class: "danger", id: "job-cancel", onclick: onCancel },
    "Cancel",
  );
  const cancelMessage = h("div");

  async function onCancel() {
    cancel.disabled = true;
    try {
      job = await api(path, { method: "DELETE" });
      render();
    } catch (err) {
      clear(cancelMessage, problemBox(err));
      cancel.disabled = false;
    }
  }

  let pending = false;
  function render() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      draw();
    });
  }

  function draw() {
    clear(status, badge(job.status));
    const at = STAGES.indexOf(job.stage);
    clear(
      stages,
      STAGES.map((name, i) => {
        let kind = "";
        if (job.status === "done" || i < at) kind = "passed";
        else if (i === at) kind = "current";
        if ((job.status === "failed" || job.status === "cancelled") && name === "done") {
          return h("li", { class: "failed" }, job.status);
        }
        return h("li", { class: kind }, name);
      }),
    );
    const { tasks_done: done, tasks_total: total } = job.progress;
    progress.max = Math.max(total, 1);
    progress.value = job.status === "done" ? progress.max : done;
    progressText.textContent = total ? `${done}/${total} tuning tasks done` : "no tuning tasks";
    clear(
      details,
      facts([
        ["Model", link(`#/models/${job.model}`, job.model)],
        ["Target", job.target],
        ["Shapes", job.shapes ? JSON.stringify(job.shapes) : "as declared"],
        ["Tuning", tuningText(job.tuning)],
        ["Measured latency", h("span", { id: "job-latency" }, ms(job.best_latency_ms))],
        ["Attempts", job.attempts],
        ["Created", when(job.created)],
        ["Updated", when(job.updated)],
      ]),
    );
    cancel.hidden = FINAL.has(job.status);
    clear(outcome);
    if (job.status === "failed") {
      outcome.append(
        h(
          "div",
          { class: "problem", role: "alert", id: "job-error" },
          h("strong", {}, "The compilation failed"),
          job.error || "no reason recorded",
        ),
      );
    } else if (job.status === "done" && job.artifact) {
      outcome.append(
        h(
          "div",
          { class: "notice" },
          "Done: artifact ",
          link(`#/artifacts/${job.artifact}`, shortDigest(job.artifact), { id: "job-artifact" }),
          job.verification
            ? ` (verified, max abs error ${Number(job.verification.max_abs_error).toExponential(2)})`
            : "",
        ),
      );
    } else if (job.status === "cancelled") {
      outcome.append(h("div", { class: "problem" }, h("strong", {}, "Cancelled")));
    }
    drawCurves();
    log.textContent = state.events.slice(-200).join("\n");
    log.scrollTop = log.scrollHeight;
    streamState.textContent = state.link;
  }

  // One small chart per tuning task: the best GFLOP/s found so far against trials measured.
  function drawCurves() {
    for (const [index, task] of state.tasks) {
      if (!task.canvas) {
        task.canvas = h("canvas", { class: "chart", dataset: { task: String(index) } });
        curves.append(
          h(
            "figure",
            {},
            h(
              "figcaption",
              { title: task.workload },
              `Task ${index}: best GFLOP/s against trials · ${task.workload}`,
            ),
            task.canvas,
          ),
        );
      }
      drawChart(task.canvas, [{ label: `task ${index}`, points: task.points }], {
        xLabel: "trials",
        yLabel: "best GFLOP/s",
        xZero: true,
      });
    }
    if (!state.tasks.size) {
      clear(curves, empty(job.tuning ? "waiting for the first measured batch…" : "not tuned"));
    } else {
      const placeholder = curves.querySelector(".empty");
      if (placeholder) placeholder.remove();
    }
    drawChart(latencyCanvas, [{ label: "estimated", points: state.latency }], {
      xLabel: "seconds of tuning",
      yLabel: "estimated model ms",
      yZero: false,
    });
  }

  function onEvent(event) {
    const e = event.payload || {};
    const stamp = e.time ? new Date(e.time * 1000).toLocaleTimeString() : "";
    state.events.push(`${stamp} ${event.type} ${summarize(e)}`);
    if (event.type === "stage") {
      job.stage = e.stage;
      if (job.status === "queued") job.status = "running";
      if (e.progress) job.progress = e.progress;
    } else if (event.type === "tuning") {
      if (state.started === null) state.started = e.time;
      const task = state.tasks.get(e.task) || { workload: e.workload, points: [] };
      task.points.push([e.trials, e.best_gflops]);
      state.tasks.set(e.task, task);
      // null until every task has been measured once: a partial sum is no estimate.
      if (e.estimated_ms != null) state.latency.push([e.time - state.started, e.estimated_ms]);
      job.progress = { tasks_done: e.tasks_done, tasks_total: e.tasks_total };
    } else if (event.type === "measured") {
      job.best_latency_ms = e.latency_ms;
    } else if (event.type === "requeued") {
      job.status = "queued";
    } else if (FINAL.has(event.type)) {
      job.status = event.type;
      job.stage = event.type;
      // The final record (artifact, verification, error) comes from the job itself.
      api(path, { signal })
        .then((fresh) => {
          job = fresh;
          render();
        })
        .catch(() => {});
    }
    render();
  }

  clear(
    main,
    h("h1", {}, "Compilation ", h("span", { class: "mono" }, job.id), " ", status),
    h(
      "section",
      { class: "card" },
      stages,
      h("div", { class: "row" }, progress, progressText),
      outcome,
      h("div", { class: "row" }, cancel, cancelMessage),
    ),
    h(
      "section",
      { class: "card" },
      h("h2", {}, "Tuning"),
      h(
        "div",
        { class: "charts" },
        h(
          "figure",
          {},
          h("figcaption", {}, "Estimated model latency (ms) over tuning time"),
          latencyCanvas,
        ),
        curves,
      ),
    ),
    h("section", { class: "card" }, details),
    h("section", { class: "card" }, h("h2", {}, "Events ", streamState), log),
  );
  draw();
  // The stream replays every event from the start, so a finished job shows its curves too.
  await followEvents(`${path}/events`, onEvent, {
    signal,
    onState: (s) => {
      state.link = s;
      render();
    },
  });
  if (!signal.aborted) {
    state.link = "ended";
    render();
  }
}

function tuningText(tuning) {
  const parts = [];
  if (tuning && tuning.trials) parts.push(`${tuning.trials} trials`);
  if (tuning && tuning.time_budget) parts.push(`${tuning.time_budget} s budget`);
  return parts.length ? parts.join(", ") : "none (default schedules)";
}

function summarize(e) {
  const skip = new Set(["type", "time", "workload"]);
  return Object.entries(e)
    .filter(([k]) => !skip.has(k))
    .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`)
    .join(" ");
}
