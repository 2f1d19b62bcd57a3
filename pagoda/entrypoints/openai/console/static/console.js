// The Pagoda console: a live dashboard of the engine, a chat playground and benchmark reports.
// Plain JavaScript, no build step and nothing fetched from elsewhere. Every data call carries the
// API key (kept in sessionStorage, this tab only) when the server asks for one.
"use strict";

const KEY_STORE = "pagoda-api-key";
const HISTORY_S = 600; // the plots span the last ten minutes, as the server's ring buffer does
const POLL_MS = 1000;
const TABLE_ROWS = 50;
const $ = (id) => document.getElementById(id);

class Unauthorized extends Error {}

// ---- HTTP --------------------------------------------------------------------------------------
const api = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  headers(extra = {}) {
    return this.key ? { ...extra, Authorization: `Bearer ${this.key}` } : extra;
  },
  async get(path) {
    const response = await fetch(path, { headers: this.headers(), cache: "no-store" });
    if (response.status === 401) throw new Unauthorized();
    if (!response.ok) throw new Error(await errorText(response));
    return response.json();
  },
};

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `HTTP ${response.status}`;
  }
}

// The key prompt: resolves once the user has entered a key (which the next call then tries).
let keyWaiters = [];
function askForKey(refused) {
  $("key-error").hidden = !refused;
  $("key-prompt").hidden = false;
  $("key-input").focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  api.key = $("key-input").value.trim();
  sessionStorage.setItem(KEY_STORE, api.key);
  $("key-prompt").hidden = true;
  const waiters = keyWaiters;
  keyWaiters = [];
  waiters.forEach((resolve) => resolve());
});

// A data call that asks for the key on a 401 and tries again with it.
async function authorized(call) {
  let refused = Boolean(api.key);
  for (;;) {
    try {
      return await call();
    } catch (error) {
      if (!(error instanceof Unauthorized)) throw error;
      await askForKey(refused);
      refused = true;
    }
  }
}

// ---- formatting --------------------------------------------------------------------------------
const fmt = {
  int: (v) => (v == null ? "–" : Math.round(v).toLocaleString("en-US")),
  rate: (v) => (v == null ? "–" : v < 10 ? v.toFixed(1) : Math.round(v).toLocaleString("en-US")),
  pct: (v) => (v == null ? "–" : `${(v * 100).toFixed(1)}%`),
  ms: (s) => (s == null ? "–" : s < 1 ? `${(s * 1000).toFixed(s < 0.01 ? 1 : 0)} ms` : `${s.toFixed(2)} s`),
  time: (unix) => new Date(unix * 1000).toLocaleTimeString([], { hour12: false }),
};

// the last `n` characters of a text, "…" before them where it is longer
const tail = (text, n) => (text.length > n ? `…${text.slice(-n)}` : text);

// "chatcmpl-a41b9b6d4d73…": the prefix and enough of the id to tell rows apart
const shortId = (id) => (id.length > 22 ? `${id.slice(0, 21)}…` : id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
}

// ---- tabs --------------------------------------------------------------------------------------
const tabHooks = {};
function showTab() {
  const name = ["dashboard", "playground", "reports"].find((t) => location.hash === `#${t}`) || "dashboard";
  // sections are named tab-NAME, not NAME, so that the #NAME link does not scroll to them
  document.querySelectorAll("section.tab").forEach((section) => (section.hidden = section.id !== `tab-${name}`));
  document.querySelectorAll(".tabs a").forEach((a) => a.classList.toggle("active", a.dataset.tab === name));
  tabHooks[name]?.();
}
window.addEventListener("hashchange", showTab);
document.querySelectorAll(".tabs a").forEach((a) =>
  a.addEventListener("click", () => {
    if (location.hash === a.hash) showTab(); // no hashchange: read the tab afresh all the same
  }),
);

// ---- dashboard ---------------------------------------------------------------------------------
// Each tile: a headline value, a line under it, and the last ten minutes of one or more series.
const TILES = [
  {
    id: "requests", label: "Requests running / waiting",
    value: (s) => `${s.running} / ${s.waiting}`,
    series: [["running", "running"], ["waiting", "waiting"]], counts: true,
  },
  {
    id: "throughput", label: "Output tokens/s",
    value: (s) => fmt.rate(s.generation_tps), sub: (s) => `prompt: ${fmt.rate(s.prompt_tps)} tokens/s`,
    series: [["generation_tps", "output"], ["prompt_tps", "prompt"]],
  },
  {
    id: "kv", label: "KV cache usage", value: (s) => fmt.pct(s.kv_usage),
    series: [["kv_usage", "used"]], max: 1, scale: fmt.pct,
  },
  {
    id: "hits", label: "Prefix-cache hit rate, last minute", value: (s) => fmt.pct(s.hit_rate_minute),
    sub: (s) => `since start: ${fmt.pct(s.hit_rate_total)}`,
    series: [["hit_rate_minute", "last minute"], ["hit_rate_total", "since start"]], max: 1, scale: fmt.pct,
  },
  {
    id: "preemptions", label: "Preemptions since start", value: (s) => fmt.int(s.preemptions),
    sub: (s, samples) => `last minute: ${fmt.int(s.preemptions - valueAgo(samples, "preemptions", 60))}`,
    series: [["preemptions", "since start"]], counts: true,
  },
  {
    id: "ttft", label: "TTFT p50, last minute", value: (s) => fmt.ms(s.ttft_p50),
    sub: (s) => `p90 ${fmt.ms(s.ttft_p90)} · p99 ${fmt.ms(s.ttft_p99)}`,
    series: [["ttft_p50", "p50"], ["ttft_p90", "p90"], ["ttft_p99", "p99"]], scale: fmt.ms,
  },
  {
    id: "tpot", label: "TPOT p50, last minute", value: (s) => fmt.ms(s.tpot_p50),
    sub: (s) => `p90 ${fmt.ms(s.tpot_p90)} · p99 ${fmt.ms(s.tpot_p99)}`,
    series: [["tpot_p50", "p50"], ["tpot_p90", "p90"], ["tpot_p99", "p99"]], scale: fmt.ms,
  },
  {
    id: "finished", label: "Requests finished, last minute", value: (s) => fmt.int(s.finished_minute),
    series: [["finished_minute", "finished"]], counts: true,
  },
];
const COLORS = ["var(--s1)", "var(--s2)", "var(--s3)"];

const feed = { instance: null, samples: [], rows: [], afterSample: 0, afterRequest: 0 };

function valueAgo(samples, key, seconds) {
  const latest = samples[samples.length - 1];
  const old = samples.find((s) => s.time >= latest.time - seconds) || samples[0];
  return old[key];
}

function buildTiles() {
  const tiles = $("tiles");
  for (const tile of TILES) {
    const legend = el("div", { class: "legend" });
    tile.series.forEach(([, name], i) => legend.append(el("i", { style: `background:${COLORS[i]}` }), name));
    legend.append(el("span", { id: `max-${tile.id}`, class: "max" }));
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("aria-label", `${tile.label}, the last 10 minutes`);
    svg.setAttribute("viewBox", "0 0 600 64");
    svg.setAttribute("preserveAspectRatio", "none");
    svg.id = `plot-${tile.id}`;
    tiles.append(
      el("div", { class: "tile", id: `tile-${tile.id}` },
        el("div", { class: "label" }, tile.label),
        el("div", { class: "value", id: `value-${tile.id}` }, "–"),
        el("div", { class: "sub", id: `sub-${tile.id}` }),
        svg, legend),
    );
  }
}

// Polylines over the last HISTORY_S seconds; a missing value (null) breaks the line.
function plot(tile, samples) {
  const svg = $(`plot-${tile.id}`);
  const now = samples.length ? samples[samples.length - 1].time : Date.now() / 1000;
  const values = tile.series.flatMap(([key]) => samples.map((s) => s[key]).filter((v) => v != null));
  const highest = Math.max(...values, 0) * 1.1;
  const top = tile.max || (tile.counts ? Math.ceil(highest) : highest) || 1;
  const parts = ['<line class="axis" x1="0" y1="63.5" x2="600" y2="63.5"/>'];
  tile.series.forEach(([key], i) => {
    let points = [];
    const flush = () => {
      if (points.length) parts.push(`<polyline style="stroke:${COLORS[i]}" points="${points.join(" ")}"/>`);
      points = [];
    };
    for (const s of samples) {
      if (s[key] == null) { flush(); continue; }
      const x = ((s.time - (now - HISTORY_S)) / HISTORY_S) * 600;
      const y = 62 - (Math.min(s[key], top) / top) * 60;
      points.push(`${x.toFixed(1)},${y.toFixed(1)}`);
    }
    flush();
  });
  svg.innerHTML = parts.join("");
  $(`max-${tile.id}`).textContent = `top ${(tile.scale || (tile.counts ? fmt.int : fmt.rate))(top)}`;
}

function renderDashboard() {
  const samples = feed.samples;
  if (samples.length) {
    const latest = samples[samples.length - 1];
    for (const tile of TILES) {
      $(`value-${tile.id}`).textContent = tile.value(latest);
      $(`sub-${tile.id}`).textContent = tile.sub ? tile.sub(latest, samples) : "";
      plot(tile, samples);
    }
  }
  const body = $("requests").tBodies[0];
  body.replaceChildren(
    ...feed.rows.slice().reverse().map((r) => {
      const row = el("tr", {},
        el("td", { title: `${r.request_id} (${r.endpoint})` }, shortId(r.request_id)),
        el("td", {}, fmt.time(r.finished)),
        el("td", {}, fmt.int(r.prompt_tokens)),
        el("td", {}, fmt.int(r.cached_tokens)),
        el("td", {}, fmt.int(r.output_tokens)),
        el("td", {}, fmt.ms(r.ttft_s)),
        el("td", {}, fmt.ms(r.tpot_s)),
        el("td", {}, r.finish_reason));
      if (r.prompt != null) row.append(el("td", { class: "prompt", title: r.prompt }, tail(r.prompt, 200)));
      return row;
    }),
  );
  $("requests-note").textContent = feed.rows.length ? `last ${feed.rows.length}` : "none yet";
}

let serverInfo = null; // the latest /console/api/info: the server's settings, read again after a restart

const onOff = (flag) => (flag ? "on" : "off");

function renderInfo(info) {
  serverInfo = info;
  $("model-name").textContent = info.model;
  document.title = `Pagoda · ${info.model}`;
  const rows = [
    ["model", info.model], ["architecture", info.architecture], ["dtype", info.dtype],
    ["quantization", info.quantization], ["device", info.device], ["attention", info.attention_backend],
    ["CUDA graphs", info.cuda_graphs ? "on" : "off"], ["max_model_len", fmt.int(info.max_model_len)],
    ["max_num_seqs", info.max_num_seqs], ["max_num_batched_tokens", fmt.int(info.max_num_batched_tokens)],
    ["scheduling", info.scheduling_policy], ["block_size", info.block_size],
    ["prefix caching", onOff(info.prefix_caching)],
    ["deterministic", onOff(info.deterministic)],
    ["speculative decoding", info.speculative || "off"],
    info.lora_adapters != null ? ["LoRA adapters", info.lora_adapters.join(", ") || "none"] : null,
    ["tool_choice auto", onOff(info.auto_tool_choice)],
    ["prompts logged", onOff(info.prompts_shown)],
    info.kv_cache_memory_gib != null ? ["KV cache memory", `${info.kv_cache_memory_gib} GiB`] : null,
    info.gpu_memory_utilization != null ? ["GPU memory use", fmt.pct(info.gpu_memory_utilization)] : null,
    ["pagoda", info.version],
  ].filter(Boolean);
  $("engine-info").replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))]));
  $("prompt-col")?.remove(); // renderInfo runs again after a restart
  if (info.prompts_shown) $("requests").tHead.rows[0].append(el("th", { id: "prompt-col" }, "prompt text"));
  // without --enable-auto-tool-choice the server refuses "auto": offer it only where it is served
  const auto = $("tool-choice").querySelector("option[value='auto']");
  auto.disabled = !info.auto_tool_choice;
  auto.textContent = info.auto_tool_choice ? "auto" : "auto (needs --enable-auto-tool-choice)";
  if (auto.disabled && $("tool-choice").value === "auto") $("tool-choice").value = "required";
}

async function poll() {
  try {
    if (!document.hidden) {
      const path = `console/api/feed?after=${feed.afterSample}&after_request=${feed.afterRequest}`;
      let data = await authorized(() => api.get(path));
      if (feed.instance !== null && data.instance !== feed.instance) {
        // the server restarted: its counters began again, so read its feed and its info afresh
        Object.assign(feed, { samples: [], rows: [], afterSample: 0, afterRequest: 0 });
        renderInfo(await authorized(() => api.get("console/api/info")));
        data = await authorized(() => api.get("console/api/feed?after=0&after_request=0"));
      }
      feed.instance = data.instance;
      if (data.samples.length) {
        feed.samples.push(...data.samples);
        feed.afterSample = data.samples[data.samples.length - 1].seq;
        const since = feed.samples[feed.samples.length - 1].time - HISTORY_S;
        feed.samples = feed.samples.filter((s) => s.time >= since);
      }
      if (data.requests.length) {
        feed.rows = feed.rows.concat(data.requests).slice(-TABLE_ROWS);
        feed.afterRequest = data.requests[data.requests.length - 1].seq;
      }
      renderDashboard();
      showLive();
    }
  } catch (error) {
    showDown(error.message);
  }
  setTimeout(poll, POLL_MS);
}

function showLive() {
  $("conn").className = "conn live";
  $("conn").title = "live: updated every second";
  $("conn-note").hidden = true;
  document.body.classList.remove("stale");
}

// Not live: the dot turns red and a note says why; the dashboard's figures stay, dimmed, as of
// the last sample read.
function showDown(reason) {
  const latest = feed.samples[feed.samples.length - 1];
  const since = latest ? ` · showing ${fmt.time(latest.time)}` : "";
  $("conn").className = "conn down";
  $("conn").title = `feed: ${reason}`;
  $("conn-note").textContent = `${/loading/i.test(reason) ? "loading the model" : `not live: ${reason}`}${since}`;
  $("conn-note").hidden = false;
  document.body.classList.add("stale");
}

// ---- playground --------------------------------------------------------------------------------
// The conversation as the next request sends it. `pending`: the model's last tool calls that have
// no result yet (the composer sends each one's result in turn; the model answers once all have);
// `epoch` counts Clears, so that a stream cleared away adds nothing to the new conversation.
const chat = { history: [], pending: [], controller: null, epoch: 0 };

function number(id) {
  const input = $(id);
  if (input.validity.badInput) throw new Error(`${id}: not a number`);
  const text = input.value.trim();
  return text === "" ? undefined : Number(text);
}

// The request body from the settings; throws with the field's name when a box does not parse.
function chatRequest(messages) {
  const body = {
    model: $("model-name").textContent,
    messages,
    stream: true,
    stream_options: { include_usage: true, continuous_usage_stats: true }, // a stopped answer's count too
  };
  for (const id of ["temperature", "top_p", "top_k", "max_tokens", "seed", "repetition_penalty"]) {
    const value = number(id);
    if (value !== undefined) body[id] = value;
  }
  const schema = $("json-schema").value.trim();
  if (schema) {
    body.response_format = { type: "json_schema", json_schema: { name: "schema", schema: parseJSON(schema, "JSON schema") } };
  }
  const tools = $("tools").value.trim();
  if (tools) {
    body.tools = parseJSON(tools, "Tools");
    body.tool_choice = $("tool-choice").value;
  }
  return body;
}

function parseJSON(text, what) {
  try {
    return JSON.parse(text);
  } catch (error) {
    throw new Error(`${what}: not valid JSON (${error.message})`);
  }
}

// Follows a growing answer only while the view is at the bottom (a reader who scrolled up stays put).
function atBottom() {
  const box = $("messages");
  return box.scrollHeight - box.scrollTop - box.clientHeight < 40;
}

function addMessage(role, text) {
  $("messages").querySelector(".empty")?.remove();
  const node = el("div", { class: `msg ${role}` }, el("div", { class: "text" }, text));
  $("messages").append(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

// Reads an SSE body, calling `onEvent` with each parsed data payload until [DONE].
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

const callText = (call) => `${call.name}(${call.arguments})`;

// The composer asks for what the conversation waits for: a message, or a tool call's result.
function updateComposer() {
  const call = chat.pending[0];
  $("prompt").placeholder = call
    ? `Result of ${callText(call)} (Enter sends)`
    : "Message (Enter sends, Shift+Enter: new line)";
}

// What sending `text` adds: the user's message, or the result of the first call that has none.
function outgoing(text) {
  const call = chat.pending[0];
  return call ? { role: "tool", tool_call_id: call.id, content: text } : { role: "user", content: text };
}

async function send(text) {
  $("settings-error").hidden = true;
  const message = outgoing(text);
  const system = $("system").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...chat.history, message];
  let body;
  try {
    body = chatRequest(messages);
  } catch (error) {
    $("settings-error").textContent = error.message;
    $("settings-error").hidden = false;
    return; // the message stays in the box, to send once the settings are fixed
  }
  $("prompt").value = "";
  chat.history.push(message);
  const call = message.role === "tool" ? chat.pending.shift() : null;
  const bubble = addMessage(message.role, call ? `${callText(call)} → ${text}` : text);
  updateComposer();
  if (chat.pending.length) return; // the model answers once every call has its result
  const node = addMessage("assistant", "");
  node.dataset.state = "streaming";
  const thinking = el("div", { class: "thinking", hidden: "" });
  node.prepend(thinking);
  const out = node.querySelector(".text");
  const stats = el("div", { class: "stats" });
  node.append(stats);
  const epoch = chat.epoch;
  chat.controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let first = null; // the first text or call the answer shows (its TTFT)
  let firstChunk = null; // the first chunk of the answer: tokens come at the decode's rate from here
  let usage = null;
  let finish = null;
  const calls = [];
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST",
      headers: api.headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(body),
      signal: chat.controller.signal,
    });
    if (response.status === 401) {
      node.remove();
      takeBack(call, text, bubble);
      await askForKey(true);
      return; // the message is back in the box, to send with the key
    }
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) return;
      firstChunk ??= performance.now();
      const follow = atBottom();
      const delta = choice.delta || {};
      const reasoning = delta.reasoning_content ?? delta.reasoning;
      if (reasoning) {
        first ??= performance.now();
        thinking.hidden = false;
        thinking.textContent += reasoning;
      }
      if (delta.content) {
        first ??= performance.now();
        out.textContent += delta.content;
      }
      for (const call of delta.tool_calls || []) {
        first ??= performance.now();
        const entry = (calls[call.index] ??= { id: "", name: "", arguments: "" });
        entry.id ||= call.id || "";
        entry.name += call.function?.name || "";
        entry.arguments += call.function?.arguments || "";
      }
      if (choice.finish_reason) finish = choice.finish_reason;
      if (follow) node.scrollIntoView({ block: "end" });
    });
    node.dataset.state = "done";
  } catch (error) {
    if (error.name === "AbortError") {
      finish = "stopped";
      node.dataset.state = "stopped";
    } else {
      node.dataset.state = "error";
      node.append(el("div", { class: "error" }, `${error.message} (this turn is left out of the conversation)`));
    }
  } finally {
    if (chat.epoch === epoch) {
      chat.controller = null;
      setBusy(false);
    }
  }
  if (chat.epoch !== epoch) return; // cleared while it ran: the new conversation does not hold it
  const done = node.dataset.state === "done";
  if (calls.length) node.append(el("pre", { class: "calls" }, calls.map(callText).join("\n")));
  if (node.dataset.state === "error") {
    takeBack(call, text); // a refused or failed turn is not sent again with the next one
  } else {
    const answer = { role: "assistant", content: out.textContent };
    // calls only from an answer that ended whole (one stopped or cut at max_tokens has them cut short;
    // a named tool_choice's call ends as "stop", others as "tool_calls")
    const whole = done && finish !== "length";
    const called = whole ? calls.map((c, i) => ({ ...c, id: c.id || `call_${i}` })) : [];
    if (called.length) {
      answer.tool_calls = called.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
    }
    chat.history.push(answer);
    chat.pending = called;
    updateComposer();
  }
  stats.textContent = messageStats(usage, started, first, firstChunk, performance.now(), finish);
  if (atBottom()) node.scrollIntoView({ block: "end" });
}

// Takes the message just sent (the last of the conversation) back out of it: a tool result's `call`
// waits for its result again, first; `text` goes back into an empty box; `bubble`, where given (the
// request never reached the model), goes. Results sent before it in the same round stay sent.
function takeBack(call, text, bubble = null) {
  chat.history.pop();
  if (call) chat.pending.unshift(call);
  bubble?.remove();
  if (!$("prompt").value) $("prompt").value = text;
  updateComposer();
}

function messageStats(usage, started, first, firstChunk, ended, finish) {
  const parts = [];
  if (usage) {
    parts.push(`prompt ${usage.prompt_tokens} tokens`, `cached ${usage.prompt_tokens_details?.cached_tokens ?? 0}`);
    parts.push(`output ${usage.completion_tokens}`);
  }
  if (first != null) parts.push(`TTFT ${fmt.ms((first - started) / 1000)}`);
  if (usage && firstChunk != null && usage.completion_tokens > 1 && ended > firstChunk) {
    parts.push(`${((usage.completion_tokens - 1) / ((ended - firstChunk) / 1000)).toFixed(1)} tokens/s`);
  }
  if (finish) parts.push(`finish: ${finish}`);
  return parts.join(" · ");
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || chat.controller) return;
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  // Enter that ends an input method's composition (Chinese, Japanese, ..) picks the text; it sends nothing
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => chat.controller?.abort());
$("clear").addEventListener("click", () => {
  chat.epoch += 1;
  chat.controller?.abort();
  chat.controller = null;
  setBusy(false);
  Object.assign(chat, { history: [], pending: [] });
  updateComposer();
  $("messages").replaceChildren(el("p", { class: "muted empty" }, "Send a message to start a chat."));
});

// ---- reports -----------------------------------------------------------------------------------
async function loadReports(info) {
  const note = $("reports-note");
  $("report-select").hidden = $("report").hidden = false;
  if (!info.reports) {
    note.textContent = "Start the server with --reports DIR to see the pagoda bench / bakeoff result folders in DIR here.";
    $("report-select").hidden = true;
    $("report").hidden = true;
    return;
  }
  const { reports } = await authorized(() => api.get("console/api/reports"));
  const select = $("report-select");
  const current = select.value;
  select.replaceChildren(...reports.map((name) => el("option", { value: name }, name === "." ? "(the folder itself)" : name)));
  note.textContent = reports.length ? `${reports.length} in the --reports folder, newest first` : "No report.md under the --reports folder yet.";
  select.hidden = $("report").hidden = !reports.length;
  if (reports.includes(current)) select.value = current;
  if (reports.length) await showReport(select.value);
}

async function showReport(name) {
  const report = $("report");
  try {
    const data = await authorized(() => api.get(`console/api/report?name=${encodeURIComponent(name)}`));
    report.innerHTML = data.html; // built by the server from report.md with every text escaped
  } catch (error) {
    report.replaceChildren(el("p", { class: "error" }, error.message));
  }
}

// ---- start -------------------------------------------------------------------------------------
async function start() {
  buildTiles();
  $("report-select").addEventListener("change", (event) => showReport(event.target.value));
  tabHooks.reports = () =>
    serverInfo && loadReports(serverInfo).catch((error) => ($("reports-note").textContent = error.message));
  showTab();
  // the page may open before the engine has loaded (or while the server restarts): ask until it answers
  for (;;) {
    try {
      renderInfo(await authorized(() => api.get("console/api/info")));
      break;
    } catch (error) {
      showDown(error.message);
      await new Promise((resolve) => setTimeout(resolve, POLL_MS));
    }
  }
  showTab();
  poll();
}

start();
