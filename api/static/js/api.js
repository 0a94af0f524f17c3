// The console's only way to the platform: the public HTTP API, with the tenant's key.

const KEY = "kiln.apiKey";

// The key is kept in sessionStorage: it lives as long as the tab, is not shared with other
// tabs and is gone when the tab closes (localStorage would keep it on disk indefinitely).
export const session = {
  get key() {
    return sessionStorage.getItem(KEY);
  },
  signIn(key) {
    sessionStorage.setItem(KEY, key);
  },
  signOut() {
    sessionStorage.removeItem(KEY);
  },
};

// An API error carrying its RFC 9457 problem (title, status, detail), so that every view can
// show what the API said rather than a blank page.
export class ApiProblem extends Error {
  constructor(status, problem) {
    super(`${problem.title}: ${problem.detail}`);
    this.status = status;
    this.problem = problem;
  }
}

export async function problemOf(response) {
  let problem;
  try {
    problem = await response.json();
  } catch {
    problem = null;
  }
  if (!problem || typeof problem !== "object" || !problem.title) {
    problem = { title: response.statusText || "Error", detail: `HTTP ${response.status}` };
  }
  return new ApiProblem(response.status, problem);
}

function problemFromText(status, text) {
  try {
    const problem = JSON.parse(text);
    if (problem && problem.title) return new ApiProblem(status, problem);
  } catch {
    // not JSON: fall through to a generic problem
  }
  return new ApiProblem(status, { title: `HTTP ${status}`, detail: text.slice(0, 300) });
}

function networkProblem(err) {
  return new ApiProblem(0, { title: "Network error", detail: `the API did not answer: ${err}` });
}

// A 401 means the key was revoked or mistyped: every listener (the shell) sends the user back
// to the sign-in page.
const unauthorizedListeners = [];
export function onUnauthorized(listener) {
  unauthorizedListeners.push(listener);
}

function check401(problem) {
  if (problem.status === 401) unauthorizedListeners.forEach((listener) => listener(problem));
  return problem;
}

export async function api(path, { method = "GET", json, headers = {}, signal, raw = false } = {}) {
  const init = { method, signal, headers: { "X-API-Key": session.key || "", ...headers } };
  if (json !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(json);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw networkProblem(err);
  }
  if (!response.ok) throw check401(await problemOf(response));
  if (raw) return response;
  return response.status === 204 ? null : response.json();
}

// Upload with XMLHttpRequest because fetch() reports no upload progress.
export function uploadModel(file, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", "/v1/models");
    xhr.setRequestHeader("X-API-Key", session.key || "");
    xhr.setRequestHeader("Content-Type", "application/octet-stream");
    // Header values must be Latin-1; a name outside printable ASCII is simply not sent.
    const name = file.name.replace(/\.onnx$/i, "").slice(0, 200);
    if (/^[\x20-\x7e]+$/.test(name)) xhr.setRequestHeader("X-Model-Name", name);
    xhr.upload.addEventListener("progress", (event) => {
      if (event.lengthComputable) onProgress(event.loaded / event.total);
    });
    xhr.addEventListener("load", () => {
      if (xhr.status === 201) resolve(JSON.parse(xhr.responseText));
      else reject(check401(problemFromText(xhr.status, xhr.responseText)));
    });
    xhr.addEventListener("error", () =>
      reject(
        new ApiProblem(0, {
          title: "Upload failed",
          detail:
            "the connection closed before the API answered (a file over the upload limit " +
            "is refused as soon as its size is known)",
        }),
      ),
    );
    xhr.send(file);
  });
}

// --- Server-Sent Events over fetch() --------------------------------------------------------

// EventSource cannot send an X-API-Key header, so the stream is read with fetch() and parsed
// here. On a dropped connection it reconnects with Last-Event-ID, as EventSource would, and
// the API resumes after that event. It returns after a final event (done, failed, cancelled).
const FINAL = new Set(["done", "failed", "cancelled"]);

export async function followEvents(path, onEvent, { signal, onState = () => {} } = {}) {
  let lastId = null;
  let delay = 500;
  for (;;) {
    const headers = { "X-API-Key": session.key || "", Accept: "text/event-stream" };
    if (lastId) headers["Last-Event-ID"] = lastId;
    let response;
    try {
      response = await fetch(path, { headers, signal });
    } catch (err) {
      if (err.name === "AbortError") return;
      onState("reconnecting");
      await sleep(delay, signal);
      delay = Math.min(delay * 2, 10000);
      continue;
    }
    if (!response.ok) throw check401(await problemOf(response));
    onState("live");
    delay = 500;
    try {
      for await (const event of parseStream(response.body, signal)) {
        if (event.id) lastId = event.id;
        onEvent(event);
        if (FINAL.has(event.type)) return;
      }
    } catch (err) {
      if (err.name === "AbortError") return;
      // a broken stream: fall through and resume from lastId
    }
    if (signal && signal.aborted) return;
    onState("reconnecting");
    await sleep(delay, signal);
  }
}

async function* parseStream(body, signal) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  const abort = () => reader.cancel().catch(() => {});
  if (signal) signal.addEventListener("abort", abort, { once: true });
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end;
      // An event ends at a blank line; anything after the last one waits for more bytes.
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const event = parseBlock(block);
        if (event) yield event;
      }
    }
  } finally {
    if (signal) signal.removeEventListener("abort", abort);
  }
}

function parseBlock(block) {
  const event = { id: null, type: "message", data: "" };
  const data = [];
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue; // a comment: the API's keep-alive
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "id") event.id = value;
    else if (field === "event") event.type = value;
    else if (field === "data") data.push(value);
  }
  if (!data.length) return null;
  event.data = data.join("\n");
  try {
    event.payload = JSON.parse(event.data);
  } catch {
    event.payload = null;
  }
  return event;
}

function sleep(msec, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, msec);
    if (signal) {
      signal.addEventListener(
        "abort",
        () => {
          clearTimeout(timer);
          resolve();
        },
        { once: true },
      );
    }
  });
}
