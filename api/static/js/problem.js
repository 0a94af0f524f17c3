import { ApiProblem } from "./api.js";
import { h } from "./dom.js";

// A problem as the API described it (title, status, detail), never a blank page. A 404 reads
// "Not found" whether the object is missing or another tenant's: the API answers both alike.
export function problemBox(err) {
  if (err instanceof ApiProblem) {
    const { title, detail } = err.problem;
    const heading = err.status === 404 ? "Not found" : title;
    return h(
      "div",
      { class: "problem", role: "alert", dataset: { status: String(err.status) } },
      h("strong", {}, heading),
      h("span", { class: "detail" }, detail),
    );
  }
  console.warn(err); // an unexpected error: shown, and kept in the log for a developer
  return h("div", { class: "problem", role: "alert" }, h("strong", {}, "Error"), String(err));
}
