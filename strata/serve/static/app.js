// strata web app: a chat over /v1/chat/completions (streamed) and a monitor polling /v1/status.
// No build step and no dependencies: the page is served as-is by `strata serve`. Model text is only ever
// inserted with textContent, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "strata.apiKey";

let model = null;
let history = [];          // the conversation sent with every turn: {role, content}
let controller = null;     // AbortController of the turn in flight
const rates = [];          // decode tok/s samples for the sparkline

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setConn(text, cls) {
  const el = $("conn");
  el.textContent = text;
  el.className = "conn " + (cls || "");
}

async function apiError(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || resp.statusText;
  } catch (e) {
    return resp.status + " " + resp.statusText;
  }
}

async function loadModel() {
  try {
    const resp = await fetch("/v1/models", { headers: headers() });
    if (!resp.ok) { setConn(await apiError(resp), "bad"); return; }
    const body = await resp.json();
    model = body.data[0].id;
    $("model").textContent = model;
    setConn("connected", "ok");
  } catch (e) {
    setConn("server unreachable", "bad");
  }
}

function scrollDown() {
  const log = $("log");
  log.scrollTop = log.scrollHeight;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  if (text !== undefined) div.textContent = text;
  $("log").appendChild(div);
  scrollDown();
  return div;
}

// An assistant bubble: a collapsed thinking section (shown only when there is reasoning), the reply text,
// tool calls, and a line of usage numbers.
function assistantMessage() {
  const div = addMessage("assistant");
  div.dataset.state = "streaming";
  const thinking = document.createElement("details");
  thinking.className = "thinking";
  thinking.hidden = true;
  const summary = document.createElement("summary");
  summary.textContent = "Thinking";
  const thinkingText = document.createElement("div");
  thinkingText.className = "thinking-text";
  thinking.append(summary, thinkingText);
  const content = document.createElement("div");
  content.className = "content";
  const meta = document.createElement("div");
  meta.className = "meta";
  div.append(thinking, content, meta);
  return { div, thinking, thinkingText, content, meta, text: "" };
}

function showDelta(msg, delta) {
  if (delta.reasoning_content) {
    msg.thinking.hidden = false;
    msg.thinkingText.textContent += delta.reasoning_content;
  }
  if (delta.content) {
    msg.text += delta.content;
    msg.content.textContent = msg.text;
  }
  for (const call of delta.tool_calls || []) {
    const pre = document.createElement("pre");
    pre.className = "tool-call";
    pre.textContent = "tool call: " + call.function.name + "(" + call.function.arguments + ")";
    msg.div.appendChild(pre);
  }
  scrollDown();
}

// Reads a server-sent-events body and calls onData with each parsed `data:` payload until [DONE].
async function readEvents(resp, onData) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(text) {
  if (!model) await loadModel();
  if (!model) return;
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const msg = assistantMessage();
  const system = $("system").value.trim();
  const body = {
    model,
    messages: system ? [{ role: "system", content: system }, ...history] : history,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: Number($("max-tokens").value) || 256,
    temperature: Number($("temperature").value),
    chat_template_kwargs: { enable_thinking: $("think").checked },
  };
  controller = new AbortController();
  setBusy(true);
  let finish = null;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!resp.ok) throw new Error(await apiError(resp));
    await readEvents(resp, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices || []) {
        showDelta(msg, choice.delta || {});
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (chunk.usage) {
        const u = chunk.usage;
        const cached = (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) || 0;
        msg.meta.textContent = `${u.prompt_tokens} prompt tokens (${cached} reused), ` +
          `${u.completion_tokens} generated, finish: ${finish}`;
      }
    });
    msg.div.dataset.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      msg.div.dataset.state = "stopped";
      msg.meta.textContent = "stopped";
    } else {
      msg.div.dataset.state = "error";
      const err = document.createElement("div");
      err.className = "error";
      err.textContent = String(e.message || e);
      msg.div.appendChild(err);
    }
  } finally {
    controller = null;
    setBusy(false);
  }
  history.push({ role: "assistant", content: msg.text });
}

// --- monitor -----------------------------------------------------------------------------------------------

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

function fmtRate(r) {
  return r === null || r === undefined ? "–" : r.toFixed(1) + " tok/s";
}

function drawSpark() {
  const canvas = $("spark");
  const g = canvas.getContext("2d");
  g.clearRect(0, 0, canvas.width, canvas.height);
  if (!rates.length) return;
  const max = Math.max(...rates, 1);
  g.strokeStyle = "#2457c5";
  g.beginPath();
  rates.forEach((r, i) => {
    const x = (i / Math.max(rates.length - 1, 1)) * (canvas.width - 2) + 1;
    const y = canvas.height - 2 - (r / max) * (canvas.height - 4);
    if (i === 0) g.moveTo(x, y); else g.lineTo(x, y);
  });
  g.stroke();
}

async function pollStatus() {
  try {
    const resp = await fetch("/v1/status", { headers: headers() });
    if (!resp.ok) { setConn(await apiError(resp), "bad"); return; }
    const s = await resp.json();
    if (!model) { model = s.model; $("model").textContent = model; }
    setConn("connected", "ok");
    const q = s.queue;
    const live = q.running.find((j) => j.decode_tokens_per_s !== null);
    const last = s.last_request;
    const decode = live ? live.decode_tokens_per_s : (last ? last.decode_tokens_per_s : null);
    $("m-decode").textContent = fmtRate(decode) + (live ? " (live)" : "");
    $("m-prompt").textContent = fmtRate(last ? last.prompt_tokens_per_s : null);
    $("m-last").textContent = last ? `${last.prompt_tokens} prompt, ${last.completion_tokens} generated (${last.status})` : "–";
    $("m-reused").textContent = last ? `${last.cached_tokens} reused, ${last.prefilled_tokens} prefilled` : "–";
    $("m-queue").textContent = `${q.busy}/${q.slots} slots busy, ${q.waiting} waiting`;
    const m = s.memory;
    $("m-memory").textContent = "RSS " + fmtBytes(m.process_rss_bytes) +
      (m.cuda_allocated_bytes !== undefined ? ", CUDA " + fmtBytes(m.cuda_allocated_bytes) : "");
    $("m-cache").textContent = `${s.cache.entries} (${fmtBytes(s.cache.bytes)} of ${fmtBytes(s.cache.max_bytes)})`;
    $("m-placement").textContent = `${s.placement.device}, ${s.placement.dtype}`;
    const geo = s.geometry;
    $("m-geometry").textContent = `${geo.layers} layers, hidden ${geo.hidden}, ${geo.experts} experts, ctx ${geo.context}`;
    rates.push(decode || 0);
    if (rates.length > 60) rates.shift();
    drawSpark();
  } catch (e) {
    setConn("server unreachable", "bad");
  }
}

// --- wiring ------------------------------------------------------------------------------------------------

function init() {
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem(KEY_STORE, $("api-key").value.trim());
    loadModel();
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("clear").addEventListener("click", () => {
    if (controller) controller.abort();
    history = [];
    $("log").replaceChildren();
  });
  loadModel();
  pollStatus();
  setInterval(pollStatus, 1000);
}

document.addEventListener("DOMContentLoaded", init);
