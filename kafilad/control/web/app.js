// Kafila's page (kafilad/control/web.py): a chat streamed from the host's OpenAI-compatible API
// (POST /v1/chat/completions with "stream": true, Server-Sent Events) and a live view of the ring
// polled from GET /api/kafila/status. Plain script, no build step, no dependencies. Every value
// from the daemon goes into the page as text (textContent), never as HTML. When the API has keys
// (kafilad/control/auth.py) the page asks for one once, on its first 401, keeps it in this origin's
// localStorage and sends it as `Authorization: Bearer KEY`; a key the API refuses is asked again.
"use strict";

const KEY_STORAGE = "kafila.apiKey";

function storedKey() {
  try { return localStorage.getItem(KEY_STORAGE) || page.sessionKey || ""; } catch (e) { return page.sessionKey || ""; }
}

/** The headers every API call carries: the stored key, if any. */
function authHeaders(extra) {
  const key = storedKey();
  return Object.assign({}, extra || {}, key ? { authorization: `Bearer ${key}` } : {});
}

/** Show the key form; `refused`: a stored key was sent and refused. */
function askKey(refused) {
  if (refused) {
    try { localStorage.removeItem(KEY_STORAGE); } catch (e) { /* storage blocked */ }
    $("key-note").textContent = "The API refused the key this browser had; enter the key the host's owner gave you.";
  }
  $("key-form").hidden = false;
  $("api-key").focus();
}

function setUpKey() {
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("api-key").value.trim();
    if (!key) return;
    try { localStorage.setItem(KEY_STORAGE, key); } catch (e) { page.sessionKey = key; }
    $("api-key").value = "";
    $("key-form").hidden = true;
    $("change-key").hidden = false;
    poll();
  });
  $("change-key").addEventListener("click", () => askKey(false));
  $("change-key").hidden = !storedKey();
}

const $ = (id) => document.getElementById(id);
const page = { messages: [], model: null, controller: null, pollMs: 1000, sending: false, pollTimer: null };

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k.startsWith("data-")) e.setAttribute(k, v); else e[k] = v;
  }
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

const dash = "—";
const ms = (s) => (s === null || s === undefined ? dash : (s * 1000).toFixed(2));
const fixed = (x, n) => (x === null || x === undefined ? dash : Number(x).toFixed(n));

// ---- Server-Sent Events (the WHATWG "event stream" format, the subset the API sends) -------------

/** Split `buffer` into complete events; returns [list of data payloads, the unfinished rest]. */
function parseEvents(buffer) {
  const text = buffer.replace(/\r\n?/g, "\n");
  const blocks = text.split("\n\n");
  const rest = blocks.pop();
  const events = [];
  for (const block of blocks) {
    const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
    if (data.length) events.push(data.join("\n"));
  }
  return [events, rest];
}

// ---- chat ---------------------------------------------------------------------------------------

function addMessage(role, text) {
  const m = el("div", { class: `msg ${role}` });
  const body = el("span", { class: "text" }, text);
  m.appendChild(body);
  $("chat-log").appendChild(m);
  m.scrollIntoView({ block: "end" });
  return m;
}

function setMeta(msg, text) {
  let meta = msg.querySelector(".meta");
  if (!meta) { meta = el("span", { class: "meta" }); msg.appendChild(meta); }
  meta.textContent = text;
}

function setSending(on) {
  page.sending = on;
  $("send").disabled = on;
  $("stop").disabled = !on;
}

async function errorSentence(resp) {
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) return body.error.message;
    if (body && typeof body.error === "string" && body.error) return body.error;  // /api/ paths: Ollama's shape
  } catch (e) { /* not JSON */ }
  return `The API answered ${resp.status} ${resp.statusText}.`;
}

/** Send `text` as the next user turn and stream the assistant's reply into the log. */
async function send(text) {
  const maxTokens = parseInt($("max-tokens").value, 10);
  const temperature = parseFloat($("temperature").value);
  page.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const msg = addMessage("assistant", "");
  const body = msg.querySelector(".text");
  msg.dataset.state = "waiting";
  msg.dataset.chunks = "0";
  // the usage chunk (stream_options) counts tokens; a content chunk may carry several or none
  const request = { messages: page.messages.slice(), stream: true, stream_options: { include_usage: true },
                    max_tokens: Number.isFinite(maxTokens) ? maxTokens : 128,
                    temperature: Number.isFinite(temperature) ? temperature : 0 };
  if (page.model) request.model = page.model;
  const controller = new AbortController();
  page.controller = controller;
  setSending(true);
  const t0 = performance.now();
  let reply = "", chunks = 0, tokens = null, firstS = null, finish = null, failure = null;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: authHeaders({ "content-type": "application/json" }),
      body: JSON.stringify(request), signal: controller.signal });
    if (resp.status === 401) askKey(Boolean(storedKey()));
    if (!resp.ok) throw new Error(await errorSentence(resp));
    msg.dataset.state = "streaming";
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "", done = false;
    while (!done) {
      const { value, done: ended } = await reader.read();
      if (ended) break;
      buffer += decoder.decode(value, { stream: true });
      const [events, rest] = parseEvents(buffer);
      buffer = rest;
      for (const data of events) {
        if (data === "[DONE]") { done = true; break; }
        const chunk = JSON.parse(data);
        if (chunk.error) { failure = chunk.error.message || "The request failed."; continue; }
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        const choice = (chunk.choices || [])[0];
        if (!choice) continue;
        const piece = (choice.delta && choice.delta.content) || "";
        if (piece) {
          if (firstS === null) firstS = (performance.now() - t0) / 1000;
          reply += piece;
          chunks += 1;
          body.textContent = reply;
          msg.dataset.chunks = String(chunks);
          msg.scrollIntoView({ block: "end" });
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
    if (!done && !failure) failure = "The stream ended before the API said it was done.";
  } catch (e) {
    failure = e.name === "AbortError" ? "stopped" : (e.message || String(e));
  } finally {
    page.controller = null;
    setSending(false);
  }
  const totalS = (performance.now() - t0) / 1000;
  const decodeS = firstS === null ? 0 : totalS - firstS;
  const counted = tokens === null ? chunks : tokens;  // the API's count; chunks only if it sent none
  msg.dataset.tokens = String(counted);
  const rate = counted > 1 && decodeS > 0 ? (counted - 1) / decodeS : null;
  if (failure && failure !== "stopped" && !reply) {
    page.messages.pop();  // the turn never happened: it is not part of the conversation
    msg.className = "msg error";
    body.textContent = failure;
    msg.dataset.state = "error";
    return;
  }
  page.messages.push({ role: "assistant", content: reply });
  msg.dataset.state = failure ? (failure === "stopped" ? "stopped" : "error") : "done";
  const parts = [`${counted} tokens`, firstS === null ? null : `first after ${(firstS * 1000).toFixed(0)} ms`,
                 rate === null ? null : `${rate.toFixed(1)} tokens/s`, finish ? `finish: ${finish}` : null,
                 failure ? (failure === "stopped" ? "stopped by you" : failure) : null];
  setMeta(msg, parts.filter(Boolean).join(" · "));
  $("rate").textContent = rate === null ? "" : `last reply ${rate.toFixed(1)} tokens/s`;
}

function setUpChat() {
  $("chat-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || page.sending) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => { if (page.controller) page.controller.abort(); });
  $("clear").addEventListener("click", () => {
    if (page.controller) page.controller.abort();
    page.messages = [];
    $("chat-log").replaceChildren();
    $("rate").textContent = "";
  });
}

// ---- the ring -----------------------------------------------------------------------------------

function memberState(m) {
  if (m.lost) return ["lost: " + m.lost, "bad"];
  if (m.left) return ["left", "warn"];
  if (m.standby) return ["standby (no blocks, ready for healing)", "ok"];  // as `kafila-ctl status` says
  if (m.ready) return [m.control === "down" ? "ready, control down" : "ready", m.control === "down" ? "warn" : "ok"];
  return [m.progress || "joining", "warn"];
}

function renderMembers(st) {
  const rows = (st.members || []).map((m) => {
    const [state, cls] = memberState(m);
    const b = m.blocks;
    const tr = el("tr", { "data-name": m.name });
    tr.append(el("td", {}, m.name), el("td", {}, b ? `[${b[0]}, ${b[1]})` : dash), el("td", {}, m.head ? "●" : ""),
              el("td", {}, m.nat_class || dash), el("td", { class: "num" }, ms(m.predicted_stage_s)),
              el("td", { class: "num" }, ms(m.measured_stage_s)), el("td", { class: cls }, state));
    return tr;
  });
  $("members").tBodies[0].replaceChildren(...rows);
}

function renderEdges(st) {
  const rows = (st.edges || []).map((e) => {
    const known = e.classes ? Object.entries(e.classes).filter(([, v]) => v) : [];
    const classes = known.length ? Object.entries(e.classes).map(([k, v]) => `${k}: ${v || "?"}`).join(", ") : dash;
    const tr = el("tr", { "data-edge": `${e.from}>${e.to}` });
    const cls = { direct: "ok", relayed: "warn" }[e.path] || "";
    tr.append(el("td", {}, `${e.from} → ${e.to}`), el("td", { class: cls }, e.path || dash),
              el("td", {}, e.predicted_path || dash), el("td", {}, classes),
              el("td", { class: "num" }, fixed(e.rtt_ms, 2)),
              el("td", { class: "num" }, e.bytes_sent === undefined ? dash : (e.bytes_sent / 1e6).toFixed(2)));
    return tr;
  });
  $("edges").tBodies[0].replaceChildren(...rows);
}

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

/** The ring as a circle of members (head at the top, ring order clockwise), edges coloured by path. */
function renderPicture(st) {
  const members = st.members || [];
  const pic = $("ring-picture");
  const n = members.length, r = 80;
  const at = (i) => [r * Math.sin((2 * Math.PI * i) / n), -r * Math.cos((2 * Math.PI * i) / n)];
  const path = {};
  for (const e of st.edges || []) path[`${e.from}>${e.to}`] = e.path;
  const parts = [];
  if (n > 1) {
    parts.push(svg("defs", {}));
    parts[0].appendChild(svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 6,
                                         markerHeight: 6, orient: "auto-start-reverse" }));
    parts[0].firstChild.appendChild(svg("path", { d: "M 0 0 L 10 5 L 0 10 z", class: "arrow" }));
    members.forEach((m, i) => {
      const [ax, ay] = at(i), [bx, by] = at((i + 1) % n);
      const len = Math.hypot(bx - ax, by - ay) || 1, ux = (bx - ax) / len, uy = (by - ay) / len;
      const kind = path[`${m.name}>${members[(i + 1) % n].name}`] || "pending";
      // from circle edge to circle edge (radius 22, 3 px gap), the arrow at the receiver
      parts.push(svg("line", { x1: ax + ux * 25, y1: ay + uy * 25, x2: bx - ux * 25, y2: by - uy * 25,
                               class: `edge ${kind}`, "marker-end": "url(#arrow)" }));
    });
  }
  members.forEach((m, i) => {
    const [x, y] = at(i);
    parts.push(svg("circle", { cx: x, cy: y, r: 22, class: `node${m.head ? " head" : ""}${m.lost ? " down" : ""}` }));
    parts.push(svg("text", { x, y: y + 1 }, m.name.length > 10 ? m.name.slice(0, 9) + "…" : m.name));
    if (m.blocks) parts.push(svg("text", { x, y: y + 13 }, `${m.blocks[0]}–${m.blocks[1]}`));
  });
  pic.replaceChildren(...parts);
}

function renderSummary(st) {
  const members = st.members || [];
  // a member on standby holds no blocks until a replan: ready as `kafila-ctl wait` counts it
  const ready = members.filter((m) => m.ready || (m.standby && !m.lost && !m.left)).length;
  const standby = members.filter((m) => m.standby && !m.lost && !m.left).length;
  const bits = [];
  if (!st.session) bits.push(`${st.node || "this daemon"} is not in a session`);
  else {
    bits.push(`${st.role === "host" ? "hosted by" : "member"} ${st.node}`);
    bits.push(`${ready} of ${st.expected_members || members.length} members ready` +
              (standby ? ` (${standby} on standby)` : ""));
  }
  const p = st.plan;
  if (p && p.circuit_s) {
    bits.push(`predicted: circuit ${ms(p.circuit_s)} ms (≈ ${(1 / p.circuit_s).toFixed(1)} tokens/s for one request), ` +
              `bottleneck ${ms(p.bottleneck_s)} ms, tier ${p.tier}`);
  }
  const g = st.last_generation;
  if (g && g.decode_tokens_per_s) {
    bits.push(`measured (last generation): circuit ${ms(g.circuit_s_median)} ms, ` +
              `${g.decode_tokens_per_s.toFixed(1)} tokens/s, first token ${ms(g.ttft_s)} ms`);
  }
  if (st.load && st.load.progress && st.state === "loading") {
    bits.push(`${st.load.progress}: ${((st.load.done_bytes || 0) / 1e6).toFixed(1)} of ` +
              `${((st.load.total_bytes || 0) / 1e6).toFixed(1)} MB`);
  }
  if (st.error) bits.push(`error: ${st.error}`);
  $("summary").textContent = bits.join("\n");
  const pending = st.pending || [];
  $("pending").hidden = pending.length === 0;
  $("pending").textContent = pending.length ? `waiting for admission: ${pending.join(", ")}` : "";
}

function renderQueue(st) {
  const q = st.requests || {};
  const show = (x) => (x === undefined || x === null ? dash : String(x));
  $("q-running").textContent = show(q.running);
  $("q-queued").textContent = show(q.queued);
  $("q-concurrency").textContent = show(q.concurrency);
  $("q-limit").textContent = show(q.queue_limit);
}

function render(st) {
  const state = st.session ? st.state : "idle";
  $("state").textContent = state;
  $("state").dataset.state = state;
  $("model").textContent = st.model_id || dash;
  if (st.model_id && st.role === "host") page.model = st.model_id;
  renderSummary(st);
  renderMembers(st);
  renderEdges(st);
  renderPicture(st);
  renderQueue(st);
}

async function poll() {
  clearTimeout(page.pollTimer);
  try {
    const resp = await fetch("/api/kafila/status", { cache: "no-store", headers: authHeaders() });
    if (resp.status === 401) {  // polling resumes once a key is given (setUpKey)
      askKey(Boolean(storedKey()));
      $("conn").textContent = "waiting for an API key";
      return;
    }
    if (!resp.ok) throw new Error(await errorSentence(resp));
    const st = await resp.json();
    if (st.poll_ms) page.pollMs = st.poll_ms;
    $("conn").textContent = "";
    render(st);
  } catch (e) {
    $("conn").textContent = `the daemon does not answer (${e.message || e}); retrying`;
  }
  page.pollTimer = setTimeout(poll, page.pollMs);
}

document.addEventListener("DOMContentLoaded", () => {
  setUpKey();
  setUpChat();
  poll();
});
