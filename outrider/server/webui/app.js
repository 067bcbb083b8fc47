"use strict";
/* outrider's built-in page. Chat streams through /v1/chat/completions; every request asks for the outrider
 * extension `return_draft_provenance`, whose per-token entries drive the token view. The status strip polls
 * /props, /slots and /metrics, any of which the server may have turned off. No dependencies, no build step. */

const STORE = "outrider.webui.";
const POLL_MS = 2000;
const RATE_WINDOW_MS = 60000;
const DEFAULTS = { system: "", temperature: 0.8, top_p: 0.95, max_tokens: 256, seed: "", tokenView: false };
const SPEC_TYPES = { "draft-simple": "draft", "draft-mtp": "mtp", "draft-dflash": "dflash" };  // /props names

const $ = (id) => document.getElementById(id);

function load(key, fallback) {
  try {
    const raw = localStorage.getItem(STORE + key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback;
  }
}

function save(key, value) {
  try {
    localStorage.setItem(STORE + key, JSON.stringify(value));
  } catch {
    // storage full or blocked: the page works on, it only forgets
  }
}

const page = {
  // {role, content, tokens: [[text, accepted draft 0|1]], timings, draftKind, ttft, error, stopped}
  messages: load("messages", []),
  settings: { ...DEFAULTS, ...load("settings", {}) },
  apiKey: load("apiKey", ""),
  props: null,  // the last /props answer
  inflight: null,  // AbortController of the reply being streamed
  metricsSamples: [],  // [ms, llamacpp:tokens_predicted_total], the last minute's
  localTokens: [],  // [ms, tokens] of this tab's finished replies: the rate when /metrics is off
  loadedAt: performance.now(),
};
const elements = new WeakMap();  // message -> its element

// --- the server ---
class KeyNeeded extends Error {}

async function api(path, init = {}) {
  const headers = { ...(init.headers || {}) };
  if (page.apiKey) headers.Authorization = "Bearer " + page.apiKey;
  const response = await fetch(path, { ...init, headers });
  if (response.status === 401) {
    askForKey(page.apiKey ? "The server refused this key." : "");
    throw new KeyNeeded("this server needs an API key: enter it and send again");
  }
  return response;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

/* Server-sent events of a fetch body: each `data:` payload parsed ("[DONE]" stays a string). */
async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;  // ":" lines are keep-alive comments
        const data = line.slice(6);
        yield data === "[DONE]" ? data : JSON.parse(data);
      }
    }
  }
}

// --- chat ---
function requestBody(user) {
  const s = page.settings;
  const history = page.messages
    .filter((m) => !m.error && m.content)
    .map((m) => ({ role: m.role, content: m.content }));
  const body = {
    messages: [...(s.system ? [{ role: "system", content: s.system }] : []), ...history,
               { role: "user", content: user.content }],
    stream: true,
    return_draft_provenance: true,
  };
  // an empty field leaves the server's default
  for (const key of ["temperature", "top_p", "max_tokens", "seed"]) {
    if (s[key] !== "" && s[key] !== null) body[key] = Number(s[key]);
  }
  return body;
}

async function send(text) {
  const user = { role: "user", content: text };
  const reply = { role: "assistant", content: "", tokens: [] };
  const body = requestBody(user);
  page.messages.push(user, reply);
  save("messages", page.messages);
  const controller = new AbortController();
  setInflight(controller);
  renderAll();
  const started = performance.now();
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const event of sseEvents(response.body)) {
      if (event === "[DONE]") break;
      if (event.error) throw new Error(event.error.message);
      const choice = event.choices && event.choices[0];
      if (choice) {
        const entries = choice.draft_provenance || [];
        const content = (choice.delta && choice.delta.content) || "";
        if (reply.ttft === undefined && (entries.length || content)) reply.ttft = performance.now() - started;
        reply.content += content;
        for (const e of entries) reply.tokens.push([e.text, e.accepted_draft ? 1 : 0]);
      }
      if (event.timings) {
        reply.timings = event.timings;
        // the drafter kind: beside `timings` once the request drafted, else the server's (/props)
        reply.draftKind = event.draft_kind || drafterKind();
      }
      renderSoon(reply);
    }
  } catch (err) {
    if (controller.signal.aborted) reply.stopped = true;
    else reply.error = err.message;
  } finally {
    page.localTokens.push([performance.now(), reply.tokens.length]);
    setInflight(null);
    save("messages", page.messages);
    render(reply);
    refreshStatus();
  }
}

function setInflight(controller) {
  page.inflight = controller;
  $("send").hidden = controller !== null;
  $("stop").hidden = controller === null;
}

// --- rendering ---
let pending = new Set();

function renderSoon(message) {
  if (!pending.size) requestAnimationFrame(() => {
    const messages = pending;
    pending = new Set();
    messages.forEach(render);
  });
  pending.add(message);
}

function node(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

/* "label: " then text and [stat name, value] parts; values carry data-stat so their source is plain. */
function statItem(label, ...parts) {
  const el = node("span", "", label + ": ");
  for (const part of parts) {
    if (typeof part === "string") {
      el.append(part);
    } else {
      const value = node("b", "", part[1]);
      value.dataset.stat = part[0];
      el.append(value);
    }
  }
  return el;
}

function statsElement(m) {
  const el = node("div", "stats");
  const t = m.timings;
  if (t) {
    el.append(
      statItem("prompt", ["prompt_n", String(t.prompt_n)], " tokens",
               ...(t.cache_n ? [" (+", ["cache_n", String(t.cache_n)], " cached)"] : []),
               ", ", ["prompt_ms", t.prompt_ms.toFixed(1)], " ms"),
      statItem("generated", ["predicted_n", String(t.predicted_n)], " tokens, ",
               ["predicted_ms", t.predicted_ms.toFixed(1)], " ms, ",
               ["predicted_per_second", t.predicted_per_second.toFixed(1)], " tokens/s"),
    );
  }
  if (m.ttft !== undefined) {
    el.append(statItem("TTFT", ["browser_ttft_ms", m.ttft.toFixed(0)], " ms in the browser",
                       ...(t ? [", server prompt_ms ", ["prompt_ms", t.prompt_ms.toFixed(1)]] : [])));
  }
  if (t && t.draft_rounds > 0) {
    const rate = t.draft_n ? (100 * t.draft_n_accepted) / t.draft_n : 0;
    const perRound = (t.draft_n_accepted + t.draft_rounds) / t.draft_rounds;
    el.append(statItem(
      "speculation", ["draft_kind", m.draftKind || "?"], ": drafted ", ["draft_n", String(t.draft_n)],
      ", accepted ", ["draft_n_accepted", String(t.draft_n_accepted)], " (", ["acceptance", rate.toFixed(1)],
      "%), ", ["tokens_per_round", perRound.toFixed(2)], " tokens/round"));
  }
  if (!t && m.tokens && m.tokens.length) el.append(statItem("generated", ["tokens", String(m.tokens.length)], " tokens"));
  return el.childElementCount ? el : null;
}

function textElement(m) {
  const el = node("div", "text");
  if (m.role === "assistant" && page.settings.tokenView && m.tokens && m.tokens.length) {
    for (const [text, draft] of m.tokens) el.append(node("span", draft ? "tok draft" : "tok own", text));
  } else {
    el.textContent = m.content;
  }
  return el;
}

function messageElement(m) {
  const el = node("div", "msg " + m.role);
  el.append(textElement(m));
  if (m.error) el.append(node("div", "error", m.error));
  if (m.stopped) el.append(node("div", "note", "stopped"));
  else if (m.role === "assistant" && !m.timings && !m.error && m === lastMessage() && page.inflight) {
    el.append(node("div", "note", "…"));
  }
  if (m.role === "assistant") {
    const stats = statsElement(m);
    if (stats) el.append(stats);
  }
  return el;
}

function lastMessage() {
  return page.messages[page.messages.length - 1];
}

function render(m) {
  const old = elements.get(m);
  if (!old) return;
  const main = $("messages");
  const atBottom = window.innerHeight + window.scrollY >= document.body.scrollHeight - 40;
  const el = messageElement(m);
  elements.set(m, el);
  old.replaceWith(el);
  if (atBottom && main.lastElementChild === el) window.scrollTo(0, document.body.scrollHeight);
}

function renderAll() {
  const main = $("messages");
  main.replaceChildren();
  if (!page.messages.length) {
    main.append(node("p", "empty", "Send a message to start. Turn on the token view to see which tokens were " +
                                   "drafts the target accepted and which were its own."));
  }
  for (const m of page.messages) {
    const el = messageElement(m);
    elements.set(m, el);
    main.append(el);
  }
  $("legend").hidden = !page.settings.tokenView;
  window.scrollTo(0, document.body.scrollHeight);
}

// --- the status strip ---
function drafterKind() {
  const params = page.props && page.props.default_generation_settings.params;
  const types = params && params["speculative.types"];
  return !types || types === "none" ? null : SPEC_TYPES[types] || types;
}

async function fetchStatus(path, as) {
  try {
    const response = await api(path);
    return { status: response.status, body: response.ok ? await response[as]() : null };
  } catch (err) {
    return { status: err instanceof KeyNeeded ? 401 : 0, body: null };
  }
}

function setStatus(id, text, title, on = false) {
  const el = $(id);
  el.textContent = text;
  if (title) el.title = title;
  el.classList.toggle("on", on);
}

async function refreshStatus() {
  const props = await fetchStatus("/props", "json");
  if (!props.body) {
    const why = { 0: "server unreachable", 401: "API key needed", 503: "loading…" }[props.status];
    setStatus("status-model", "model: " + (why || `HTTP ${props.status}`));
    return;
  }
  page.props = props.body;
  setStatus("status-model", "model: " + page.props.model_alias, page.props.model_path);
  const [slots, metrics] = await Promise.all([fetchStatus("/slots", "json"), fetchStatus("/metrics", "text")]);
  showSlots(slots);
  showRate(metrics);
}

function showSlots(slots) {
  const kind = drafterKind();
  const nMax = page.props.default_generation_settings.params["speculative.n_max"];
  if (!slots.body) {
    setStatus("status-slots", `slots: ${page.props.total_slots} (busy unknown: /slots is off)`);
    setStatus("status-drafter", "drafter: " + (kind || "none"));
    return;
  }
  const busy = slots.body.filter((s) => s.is_processing);
  setStatus("status-slots", `slots: ${busy.length} busy, ${slots.body.length - busy.length} idle`);
  // engaged: a busy slot is decoding with a drafter and a draft length above 0
  const engaged = busy.some((s) => s.speculative && (s.params ? s.params["speculative.n_max"] : nMax) > 0);
  const mode = nMax > 0 ? (engaged ? "engaged" : "idle") : "off (n_max 0)";
  setStatus("status-drafter", kind ? `drafter: ${kind}, ${mode}` : "drafter: none", "", engaged);
}

function showRate(metrics) {
  const now = performance.now();
  const since = now - RATE_WINDOW_MS;
  const match = metrics.body && metrics.body.match(/^llamacpp:tokens_predicted_total (\S+)$/m);
  if (match) {
    const samples = page.metricsSamples;
    samples.push([now, Number(match[1])]);
    while (samples.length > 2 && samples[1][0] <= since) samples.shift();  // keep one at the window's start
    const [t0, n0] = samples[0];
    const [t1, n1] = samples[samples.length - 1];
    const rate = t1 > t0 ? (n1 - n0) / ((t1 - t0) / 1000) : null;
    setStatus("status-rate", "tokens/s (1 min): " + (rate === null ? "…" : rate.toFixed(1)), "/metrics");
    return;
  }
  page.localTokens = page.localTokens.filter(([t]) => t > since);
  const tokens = page.localTokens.reduce((sum, [, n]) => sum + n, 0);
  const seconds = Math.min(RATE_WINDOW_MS, now - page.loadedAt) / 1000;
  setStatus("status-rate", `tokens/s (1 min, this tab): ${(tokens / Math.max(seconds, 1)).toFixed(1)}`,
            "/metrics is off (start the server with --metrics for server-wide figures)");
}

// --- the API key ---
function askForKey(error) {
  const dialog = $("key-dialog");
  $("key-error").textContent = error;
  $("key-error").hidden = !error;
  if (!dialog.open) dialog.showModal();
}

function useKey(key) {
  page.apiKey = key;
  save("apiKey", key);
  $("api-key").value = key;
}

// --- wiring ---
function bindSettings() {
  const fields = { "system-prompt": "system", temperature: "temperature", "top-p": "top_p",
                   "max-tokens": "max_tokens", seed: "seed" };
  for (const [id, key] of Object.entries(fields)) {
    const input = $(id);
    input.value = page.settings[key];
    input.addEventListener("input", () => {
      page.settings[key] = input.value;
      save("settings", page.settings);
    });
  }
  $("api-key").value = page.apiKey;
  $("api-key").addEventListener("change", () => {
    useKey($("api-key").value);
    refreshStatus();
  });
  $("token-view").checked = page.settings.tokenView;
  $("token-view").addEventListener("change", () => {
    page.settings.tokenView = $("token-view").checked;
    save("settings", page.settings);
    renderAll();
  });
}

function bindChat() {
  const input = $("input");
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = input.value.trim();
    if (!text || page.inflight) return;
    input.value = "";
    send(text);
  });
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => page.inflight && page.inflight.abort());
  $("new-chat").addEventListener("click", () => {
    if (page.inflight) page.inflight.abort();
    page.messages = [];
    save("messages", page.messages);
    renderAll();
  });
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    useKey($("key-input").value);
    $("key-input").value = "";
    $("key-dialog").close();
    refreshStatus();
  });
}

bindSettings();
bindChat();
renderAll();
refreshStatus();
setInterval(() => {
  if (!document.hidden && !$("key-dialog").open) refreshStatus();
}, POLL_MS);
