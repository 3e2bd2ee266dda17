// The /ui page of vllm-omni: plain JavaScript, no build step. It talks to the server's own
// OpenAI-compatible routes: /ui/info (what the pipeline is, its default steps / guidance / scale),
// /v1/models (the adapters), /v1/images/generations (with the `lora` field) and /v1/chat/completions.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { info: null, adapters: [], paths: {} };
const GRID_CONCURRENCY = 2;

function setStatus(text, ok = false) {
  const el = $("status");
  el.textContent = text;
  el.className = ok ? "ok" : "";
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function api(path, body) {
  const init = body === undefined ? { headers: headers() } : { method: "POST", headers: headers(), body: JSON.stringify(body) };
  const reply = await fetch(path, init);
  const text = await reply.text();
  let data = null;
  try { data = JSON.parse(text); } catch (e) { data = null; }
  if (!reply.ok) {
    const msg = data && data.error ? data.error.message : text.slice(0, 300);
    throw new Error(`${reply.status}: ${msg}`);
  }
  return data;
}

// A scale or schedule as the server takes it (docs/user_guide/diffusion_lora.md#scale-schedules):
// a number, JSON (a per-step list, ranges, {"steps", "blocks"}) or the shorthand a@f>b.
function parseScale(text) {
  const t = String(text).trim();
  if (t === "") return null;
  const short = t.match(/^(-?\d*\.?\d+)@(\d*\.?\d+)>(-?\d*\.?\d+)$/);
  if (short) {
    const [a, f, b] = short.slice(1).map(Number);
    return [{ start: 0, end: f, scale: a }, { start: f, end: 1, scale: b }];
  }
  if (t[0] === "[" || t[0] === "{") {
    try { return JSON.parse(t); } catch (e) { throw new Error(`schedule ${t}: not valid JSON (${e.message})`); }
  }
  const n = Number(t);
  if (!Number.isFinite(n)) throw new Error(`scale ${JSON.stringify(t)} is neither a number, JSON nor a@f>b`);
  return n;
}

function renderAdapters() {
  const box = $("adapters");
  box.innerHTML = "";
  if (!state.adapters.length) { box.innerHTML = "<em>no adapters (start the server with --lora-modules, --lora-path or --lora-dirs)</em>"; return; }
  const scale = String(state.info.default_scale ?? 1);  // the server's --lora-scale
  for (const name of state.adapters) {
    const row = document.createElement("div");
    row.className = "adapter";
    row.dataset.adapter = name;
    row.innerHTML = `<label><input type="checkbox" class="use"> <span></span></label>
      <input type="range" class="scale" min="-1" max="2" step="0.05">
      <output class="scale-value"></output>
      <input type="text" class="schedule" placeholder="schedule (optional)">`;
    row.querySelector("span").textContent = name;
    if (name in state.paths) {
      row.dataset.path = state.paths[name];
      row.querySelector("label").title = `${state.paths[name]} (in --lora-dirs: loaded on first use)`;
      row.querySelector("span").textContent = `${name} (--lora-dirs)`;
    }
    const slider = row.querySelector(".scale");
    slider.value = scale;
    row.querySelector(".scale-value").textContent = slider.value;
    slider.addEventListener("input", () => { row.querySelector(".scale-value").textContent = slider.value; });
    row.querySelector(".use").addEventListener("change", limitChoices);
    box.appendChild(row);
  }
  limitChoices();
}

// No more adapters can be ticked than the server applies per request (its --max-loras).
function limitChoices() {
  const max = state.info.max_adapters ?? Infinity;
  const boxes = [...document.querySelectorAll("#adapters .use")];
  const full = boxes.filter((b) => b.checked).length >= max;
  for (const b of boxes) {
    b.disabled = full && !b.checked;
    b.title = b.disabled ? tooMany(max) : "";
  }
}

// Steps and guidance start at what the server runs when a request sets none (/ui/info "defaults": a stage
// option, the model's model_index.json "_call_defaults", or its pipeline's __call__ defaults).
function showDefaults() {
  const d = state.info.defaults || {};
  const from = d.from || {};
  for (const [field, id] of [["num_inference_steps", "steps"], ["guidance_scale", "guidance"]]) {
    const el = $(id);
    el.value = d[field] ?? "";
    el.placeholder = "server default";
    el.title = from[field] ? `server default, from ${from[field]}` : "";
  }
}

function tooMany(max) {
  return `this server applies at most ${max} adapter(s) per request; start it with --max-loras N to allow N`;
}

// The request's `lora` list from the adapter rows, with per-cell overrides {adapter: scale}.
function loraField(overrides = {}) {
  const out = [];
  for (const row of document.querySelectorAll("#adapters .adapter")) {
    const name = row.dataset.adapter;
    const schedule = parseScale(row.querySelector(".schedule").value);
    let scale = schedule === null ? Number(row.querySelector(".scale").value) : schedule;
    if (name in overrides) scale = overrides[name];
    else if (!row.querySelector(".use").checked) continue;
    // an adapter of --lora-dirs is named by its path: the server loads it on first use
    out.push(row.dataset.path ? { path: row.dataset.path, scale } : { name, scale });
  }
  return out;
}

function imageBody(overrides = {}, seed = null) {
  const body = {
    model: state.info.model,
    prompt: $("prompt").value,
    n: 1,
    size: `${Number($("width").value)}x${Number($("height").value)}`,
    response_format: "b64_json",
    seed: seed === null ? Number($("seed").value) : seed,
  };
  // an empty field is left out: the server then runs its default (the one the field started with)
  for (const [field, id] of [["num_inference_steps", "steps"], ["guidance_scale", "guidance"]]) {
    const text = $(id).value.trim();
    if (text !== "") body[field] = Number(text);
  }
  const negative = $("negative").value.trim();
  if (negative) body.negative_prompt = negative;
  const lora = loraField(overrides);
  if (lora.length) body.lora = lora;
  return body;
}

function pngImage(b64, alt) {
  const img = new Image();
  img.src = "data:image/png;base64," + b64;
  img.alt = alt;
  return img;
}

async function generate() {
  const button = $("generate");
  button.disabled = true;
  setStatus("generating…", true);
  try {
    const t0 = performance.now();
    const data = await api("/v1/images/generations", imageBody());
    const result = $("result");
    result.innerHTML = "";
    result.appendChild(pngImage(data.data[0].b64_json, "generated image"));
    setStatus(`done in ${((performance.now() - t0) / 1000).toFixed(1)} s`, true);
  } catch (e) {
    setStatus(e.message);
  } finally {
    button.disabled = false;
  }
}

function axisKinds() {
  const kinds = [["seed", "seed"]];
  for (const name of state.adapters) {
    kinds.push([`scale:${name}`, `scale of ${name}`]);
    kinds.push([`schedule:${name}`, `schedule of ${name}`]);
  }
  for (const [axis, preset] of [["x", 1], ["y", 3]]) {
    const select = $(`grid-${axis}-kind`);
    select.innerHTML = "";
    for (const [value, label] of kinds) select.add(new Option(label, value));
    select.selectedIndex = Math.min(preset, kinds.length - 1);
  }
}

function axisValues(axis) {
  const kind = $(`grid-${axis}-kind`).value;
  const text = $(`grid-${axis}-values`).value;
  const parts = (kind.startsWith("schedule:") ? text.split("|") : text.split(",")).map((s) => s.trim()).filter(Boolean);
  if (!parts.length) throw new Error(`grid axis ${axis.toUpperCase()}: no values`);
  const values = parts.map((p) => {
    if (kind === "seed") {
      const n = Number(p);
      if (!Number.isInteger(n)) throw new Error(`grid axis ${axis.toUpperCase()}: seed ${JSON.stringify(p)} is not an integer`);
      return n;
    }
    return parseScale(p);
  });
  return { kind, labels: parts, values };
}

function cellSettings(axes, values) {
  const overrides = {};
  let seed = null;
  axes.forEach((axis, i) => {
    if (axis.kind === "seed") seed = values[i];
    else overrides[axis.kind.split(":").slice(1).join(":")] = values[i];
  });
  return imageBody(overrides, seed);
}

async function runGrid() {
  let x, y;
  try { x = axisValues("x"); y = axisValues("y"); } catch (e) { setStatus(e.message); return; }
  const table = document.createElement("table");
  const head = table.insertRow();
  head.appendChild(document.createElement("th")).textContent = "Y \\ X";
  for (const label of x.labels) head.appendChild(document.createElement("th")).textContent = label;
  const jobs = [];
  const widest = Math.max(...y.values.flatMap((yv) => x.values.map((xv) => (cellSettings([x, y], [xv, yv]).lora || []).length)));
  if (widest > (state.info.max_adapters ?? Infinity)) { setStatus(`grid: ${widest} adapters in a cell, but ${tooMany(state.info.max_adapters)}`); return; }
  y.values.forEach((yv, j) => {
    const row = table.insertRow();
    row.appendChild(document.createElement("th")).textContent = y.labels[j];
    x.values.forEach((xv, i) => {
      const cell = row.insertCell();
      cell.className = "pending";
      cell.textContent = "…";
      jobs.push({ cell, body: cellSettings([x, y], [xv, yv]), label: `${x.labels[i]} / ${y.labels[j]}` });
    });
  });
  $("grid").innerHTML = "";
  $("grid").appendChild(table);
  $("grid-run").disabled = true;
  setStatus(`grid: 0 / ${jobs.length}`, true);
  let done = 0, failed = 0, next = 0;
  async function worker() {
    while (next < jobs.length) {
      const job = jobs[next++];
      try {
        const data = await api("/v1/images/generations", job.body);
        job.cell.className = "done";
        job.cell.textContent = "";
        job.cell.appendChild(pngImage(data.data[0].b64_json, job.label));
      } catch (e) {
        failed++;
        job.cell.className = "failed";
        job.cell.textContent = e.message;
      }
      done++;
      setStatus(`grid: ${done} / ${jobs.length}${failed ? `, ${failed} failed` : ""}`, !failed);
    }
  }
  await Promise.all(Array.from({ length: GRID_CONCURRENCY }, worker));
  $("grid-run").disabled = false;
}

const chat = [];

function appendMessage(role, text, by = null) {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  el.textContent = text;
  if (by !== null) el.dataset.by = el.title = by;  // which adapter (or the base model) answered
  $("chat-log").appendChild(el);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
}

async function sendChat() {
  const input = $("chat-input");
  const text = input.value.trim();
  if (!text) return;
  input.value = "";
  chat.push({ role: "user", content: text });
  appendMessage("user", text);
  $("chat-send").disabled = true;
  try {
    const adapter = $("chat-adapter").value;
    const data = await api("/v1/chat/completions", {
      model: adapter || state.info.model,
      messages: chat,
      max_tokens: Number($("chat-max-tokens").value),
      temperature: Number($("chat-temperature").value),
    });
    const reply = data.choices[0].message.content || "";
    chat.push({ role: "assistant", content: reply });
    appendMessage("assistant", reply, adapter ? `adapter ${data.model}` : `base model ${data.model}`);
    setStatus("", true);
  } catch (e) {
    chat.pop();
    appendMessage("error", e.message);
    setStatus(e.message);
  } finally {
    $("chat-send").disabled = false;
  }
}

async function init() {
  $("api-key").value = localStorage.getItem("vllm-omni-api-key") || "";
  $("api-key").addEventListener("change", () => { localStorage.setItem("vllm-omni-api-key", $("api-key").value); init(); });
  try {
    state.info = await api("/ui/info");
    const models = await api("/v1/models");
    state.adapters = models.data.filter((m) => m.parent !== null).map((m) => m.id);
    state.paths = {};  // adapters found in --lora-dirs and not registered under that name
    for (const a of state.info.dir_adapters || []) {
      if (!state.adapters.includes(a.name) && !(a.name in state.paths)) { state.paths[a.name] = a.path; state.adapters.push(a.name); }
    }
  } catch (e) {
    setStatus(`cannot read the server: ${e.message}`);
    return;
  }
  $("model-info").textContent = `${state.info.model} · pipeline ${state.info.pipeline} · ${state.info.outputs.join(", ")}`;
  const isChat = state.info.is_llm && state.info.outputs.includes("text");
  $("chat-mode").hidden = !isChat;
  $("image-mode").hidden = isChat || !state.info.outputs.includes("image");
  if (isChat) {
    const select = $("chat-adapter");
    select.innerHTML = "";
    select.add(new Option("(base model)", ""));
    for (const name of state.adapters) if (!(name in state.paths)) select.add(new Option(name, name));
  } else {
    showDefaults();
    renderAdapters();
    axisKinds();
  }
  document.body.dataset.ready = "1";
  setStatus("ready", true);
}

$("generate").addEventListener("click", generate);
$("grid-run").addEventListener("click", runGrid);
$("chat-send").addEventListener("click", sendChat);
$("chat-input").addEventListener("keydown", (e) => { if (e.key === "Enter") sendChat(); });
$("chat-clear").addEventListener("click", () => { chat.length = 0; $("chat-log").innerHTML = ""; });
init();
