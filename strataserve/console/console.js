// The console's shell: API key handling, authenticated fetch, tabs, and the Models page.
// dashboard.js and playgrounds.js register their pages on window.Strata.
"use strict";
const Strata = (window.Strata = { pages: {}, onReady: [] });
const KEY = "strata-api-key";
const $ = (id) => document.getElementById(id);
Strata.$ = $;

Strata.key = () => sessionStorage.getItem(KEY) || "";
// An HTTP header value must be ISO-8859-1, or fetch throws before sending: accept printable ASCII only.
const validKey = (k) => /^[\x20-\x7e]+$/.test(k);
const INVALID_KEY = "Invalid key: an API key holds only printable ASCII characters (letters, digits, punctuation).";

Strata.headers = (extra) => {
  const h = Object.assign({}, extra || {});
  const k = Strata.key();
  if (k && validKey(k)) h.Authorization = "Bearer " + k;
  return h;
};

class AuthError extends Error {}
Strata.AuthError = AuthError;

// fetch with the key; a 401 opens the key dialog and throws AuthError.
Strata.fetch = async (url, opts = {}) => {
  const r = await fetch(url, Object.assign({}, opts, { headers: Strata.headers(opts.headers) }));
  if (r.status === 401) {
    askKey(Strata.key() ? "The server refused this key." : "");
    throw new AuthError("API key needed");
  }
  return r;
};

// The message of an OpenAI ({error: {message}}) or KServe ({error: "..."}) error body.
Strata.errorText = (body, status) => {
  if (body && body.error) return typeof body.error === "string" ? body.error : body.error.message || JSON.stringify(body.error);
  return "HTTP " + status;
};

Strata.json = async (url, opts) => {
  const r = await Strata.fetch(url, opts);
  const body = await r.json().catch(() => null);
  if (!r.ok) throw new Error(Strata.errorText(body, r.status));
  return body;
};

Strata.post = (url, doc, opts = {}) =>
  Strata.json(url, Object.assign({ method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(doc) }, opts));

Strata.option = (select, values, keep) => {
  const old = keep ? select.value : "";
  select.replaceChildren(...values.map((v) => new Option(v, v)));
  if (values.includes(old)) select.value = old;
};

Strata.models = async () => (await Strata.json("/v1/models")).data;

// An error line that a later successful load of the same page clears (a fetch failure while the server was away),
// unlike the error of an action the user took, which stays until the next action.
Strata.loadError = (id, e) => {
  if (e instanceof AuthError) return;
  $(id).textContent = e.message;
  $(id).dataset.load = "1";
};
Strata.loaded = (id) => {
  if ($(id).dataset.load) $(id).textContent = "";
  delete $(id).dataset.load;
};

// A number field's value, or undefined when it is empty (Number("") is 0: a cleared field must be left out).
Strata.num = (id) => {
  const v = $(id).value.trim();
  return v === "" || !Number.isFinite(Number(v)) ? undefined : Number(v);
};

// ------------------------------------------------------------------ API key
let ready = false;
// While the dialog is open the page behind it is inert (no focus, no clicks) and Tab cycles inside the dialog.
function dialog(open) {
  $("keybox").hidden = !open;
  for (const el of document.querySelectorAll("header, main")) el.inert = open;
}
function askKey(message) {
  $("key-error").textContent = message || "";
  dialog(true);
  $("key").focus();
}
$("keybox").addEventListener("keydown", (ev) => {
  if (ev.key !== "Tab") return;
  const items = [...$("keybox").querySelectorAll("input, button")].filter((e) => !e.disabled);
  const i = items.indexOf(document.activeElement);
  const next = ev.shiftKey ? (i <= 0 ? items.length - 1 : i - 1) : (i + 1) % items.length;
  ev.preventDefault();
  items[next].focus();
});
document.addEventListener("focusin", (ev) => {
  if (!$("keybox").hidden && !$("keybox").contains(ev.target)) $("key").focus();
});

$("keyform").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const k = $("key").value.trim();
  if (!validKey(k)) {
    $("key-error").textContent = INVALID_KEY;
    $("key").focus();
    return;
  }
  sessionStorage.setItem(KEY, k);
  $("key").value = "";
  dialog(false);
  boot();
});

$("forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  location.reload();
});

// ------------------------------------------------------------------ tabs
function show(name) {
  for (const b of document.querySelectorAll("#tabs button")) {
    b.classList.toggle("active", b.dataset.page === name);
    b.setAttribute("aria-selected", String(b.dataset.page === name));
  }
  for (const p of document.querySelectorAll(".page")) p.hidden = p.id !== "page-" + name;
  Strata.current = name;
  const page = Strata.pages[name];
  if (page && page.show && ready) page.show();
}
for (const b of document.querySelectorAll("#tabs button")) b.addEventListener("click", () => show(b.dataset.page));

Strata.setConn = (ok, text) => {
  const c = $("conn");
  c.textContent = text;
  c.className = "pill " + (ok ? "ok" : "bad");
};

// The first /v1/models call can fail (server starting or draining, a proxy hiccup): retry with backoff,
// 1 s doubling to 10 s, until it answers. A refused key stops here: submitting a new one boots again.
let bootTimer = null;
let bootDelay = 1000;
async function boot() {
  clearTimeout(bootTimer);
  bootTimer = null;
  const k = Strata.key();
  if (k && !validKey(k)) { // stored by an older page: it would make every fetch throw
    sessionStorage.removeItem(KEY);
    askKey(INVALID_KEY);
    return;
  }
  try {
    const models = await Strata.models();
    $("tab-speech").hidden = !models.some((m) => m.payload === "speech");
  } catch (e) {
    if (e instanceof AuthError) return;
    Strata.setConn(false, `offline: ${e.message} · retrying in ${bootDelay / 1000} s`);
    bootTimer = setTimeout(boot, bootDelay);
    bootDelay = Math.min(bootDelay * 2, 10000);
    return;
  }
  bootDelay = 1000;
  $("forget-key").hidden = !Strata.key();
  ready = true;
  for (const f of Strata.onReady) f(); // each hook is idempotent: a new key after a refusal restarts polling
  show(Strata.current || "dashboard");
}
window.addEventListener("load", boot);

// ------------------------------------------------------------------ Models page
const cell = (text, cls) => {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
};

function details(m) {
  const parts = [];
  if (m.max_model_len) parts.push("context " + m.max_model_len);
  const x = m.extra || {};
  if (x.upstream_model) parts.push("upstream model " + x.upstream_model);
  for (const r of x.replicas || []) parts.push(`${r.url}: ${r.healthy ? "healthy" : "DOWN"}, ${r.outstanding} in flight`);
  if (m.reason) parts.push(m.reason);
  return parts.join(" · ");
}

async function control(name, verb) {
  let error = "";
  try {
    await Strata.post(`/v2/repository/models/${encodeURIComponent(name)}/${verb}`, {});
  } catch (e) {
    if (!(e instanceof AuthError)) error = `${verb} ${name}: ${e.message}`;
  }
  await Strata.pages.models.show();
  if (error) $("repo-error").textContent = error;
}

Strata.pages.models = {
  async show() {
    let doc;
    try {
      doc = await Strata.json("/console/api/models");
    } catch (e) {
      Strata.loadError("repo-error", e);
      return;
    }
    $("repo-error").textContent = "";
    const body = $("models-table").tBodies[0];
    body.replaceChildren(...doc.models.map((m) => {
      const tr = document.createElement("tr");
      tr.append(cell(m.name), cell(m.payload), cell(m.backend),
        cell(m.ready ? "ready" : "not ready", m.ready ? "ready-yes" : "ready-no"), cell(details(m)));
      return tr;
    }));
    const repo = doc.repository;
    $("repo-none").hidden = !!repo;
    $("repo-table").hidden = !repo;
    $("repo-mode").textContent = repo ? "control mode: " + repo.control_mode : "";
    if (!repo) return;
    const explicit = repo.control_mode === "explicit";
    $("repo-table").tBodies[0].replaceChildren(...repo.models.map((m) => {
      const tr = document.createElement("tr");
      tr.dataset.model = m.name;
      const act = document.createElement("td");
      if (explicit) {
        const loaded = m.state === "READY";
        const b = document.createElement("button");
        b.textContent = loaded ? "Unload" : "Load";
        b.className = loaded ? "danger" : "";
        b.dataset.action = loaded ? "unload" : "load";
        b.addEventListener("click", () => { b.disabled = true; control(m.name, b.dataset.action); });
        act.append(b);
      }
      tr.append(cell(m.name), cell(m.version || "–"), cell(m.state || "not loaded", "state-" + m.state),
        cell(m.reason), act);
      return tr;
    }));
  },
};
