// The shared tuning log: every workload seen, and per target fingerprint the number of
// trials measured and the best record. The log holds no model data, so all tenants see it.

import { api } from "./api.js";
import { clear, empty, h, num, table, when } from "./dom.js";

export async function tuningPage(main, _params, { signal }) {
  const log = await api("/v1/tuning", { signal });
  const rows = log.workloads.flatMap((w) =>
    w.targets.map((t, i) =>
      h(
        "tr",
        { dataset: { workload: w.workload_key, fingerprint: t.fingerprint } },
        i === 0
          ? h("td", { rowspan: w.targets.length, class: "mono", title: w.workload_key }, w.workload)
          : null,
        h("td", {}, t.target, h("div", { class: "muted mono" }, t.fingerprint.slice(0, 16))),
        h("td", { class: "num" }, t.trials),
        h("td", { class: "num" }, t.errors),
        h("td", {}, t.best ? `${t.best.template}/v${t.best.template_version}` : "—"),
        h(
          "td",
          { class: "mono" },
          t.best
            ? Object.entries(t.best.config)
                .map(([k, v]) => `${k}=${v}`)
                .join(" ")
            : "—",
        ),
        h("td", { class: "num" }, t.best ? `${num(t.best.measured_us, 1)} µs` : "—"),
        h("td", { class: "num" }, t.best ? num(t.best.gflops, 1) : "—"),
        h("td", {}, t.best ? when(t.best.timestamp) : "—"),
      ),
    ),
  );
  clear(
    main,
    h("h1", {}, "Tuning log"),
    h(
      "section",
      { class: "card" },
      h(
        "p",
        { class: "muted", id: "tuning-summary" },
        `${log.records} records (${log.backend} log), ${log.workloads.length} workloads` +
          (log.skipped ? `, ${log.skipped} malformed lines skipped` : ""),
      ),
      rows.length
        ? table(
            [
              "Workload",
              "Target",
              "Trials",
              "Errors",
              "Template",
              "Best config",
              "Best",
              "GFLOP/s",
              "Measured",
            ],
            rows,
            { id: "tuning" },
          )
        : empty("Nothing tuned yet: start a compilation with a tuning budget."),
    ),
  );
}
