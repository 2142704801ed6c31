// The page: wires the three text sources, the voice picker, barge-in
// controls, captions and stats to the Agent. Exposes `window.voxgate`
// ({stats, agent, speak, interrupt}) for scripts and the browser tests.
//
// URL parameters: codec=opus|pcm16 forces a codec; voice=ID picks a voice;
// jitter_ms=N sets the jitter buffer (default 60); pacing=realtime|asap
// (default realtime: the server stays a bounded lead ahead of playback, so a
// barge-in wastes little work and the server can say what was heard).

import { Agent } from "./agent.js";
import { Captions } from "./captions.js";
import { MicVad } from "./mic.js";
import { isOpusSupported } from "./player.js";
import { replayAnswer, streamChat } from "./sources.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const LLM_SETTINGS_KEY = "voxgate.llm";

function log(text) {
  const item = document.createElement("li");
  item.textContent = `${new Date().toLocaleTimeString()} ${text}`;
  const list = $("log");
  list.prepend(item);
  while (list.children.length > 200) list.lastChild.remove();
}

let noticeTimer = null;
function notice(text) {
  let el = $("notice");
  if (!el) {
    el = document.createElement("p");
    el.id = "notice";
    el.className = "notice";
    el.setAttribute("role", "alert");
    document.querySelector("main").before(el);
  }
  el.textContent = text;
  el.hidden = false;
  clearTimeout(noticeTimer);
  noticeTimer = setTimeout(() => { el.hidden = true; }, 8000);
  log(text);
}

const captions = new Captions($("captions"));
let agent = null;
let source = null; // {abort: AbortController, kind} of a running answer or LLM stream

const ui = {
  captions,
  onLog: log,
  onError: notice,
  onStatus(state, text) {
    const pill = $("conn-status");
    pill.dataset.state = state;
    pill.textContent = text;
    $("reconnect").hidden = state !== "closed";
  },
  onOptions(opts) {
    $("st-codec").textContent = `${opts.codec ?? "?"} @ ${opts.sample_rate ?? "?"} Hz`;
    if (typeof opts.voice === "string" && opts.voice) selectVoice(opts.voice);
  },
  onCut(cut) {
    $("cut").hidden = false;
    $("cut-spoken").textContent = cut.spoken_text || "(nothing)";
    $("cut-unspoken").textContent = cut.unspoken_text || "(nothing)";
  },
};

// ---- voices -------------------------------------------------------------

function voiceList(body) {
  const list = Array.isArray(body) ? body : (body?.voices ?? body?.data ?? []);
  return list.map((v) => {
    if (typeof v === "string") return { id: v, label: v };
    const id = String(v.id ?? v.voice_id ?? v.name ?? "");
    const name = String(v.name ?? id);
    const lang = v.language ?? v.lang;
    return { id, label: lang ? `${name} (${lang})` : name };
  }).filter((v) => v.id);
}

function selectVoice(id) {
  const select = $("voice");
  if (![...select.options].some((o) => o.value === id)) {
    select.append(new Option(id, id));
  }
  select.value = id;
}

async function loadVoices() {
  const select = $("voice");
  try {
    const response = await fetch("/v1/voices", { headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(`expected 200 from /v1/voices, got ${response.status}`);
    const current = select.value;
    select.replaceChildren(new Option("(server default)", ""));
    for (const v of voiceList(await response.json())) select.append(new Option(v.label, v.id));
    if (current) selectVoice(current);
    else if (agent?.options.voice) selectVoice(agent.options.voice);
  } catch (err) {
    log(`voices: ${err.message}`);
  } finally {
    select.disabled = false;
  }
}

$("voice").addEventListener("change", (e) => {
  if (e.target.value) agent.updateSession({ voice: e.target.value });
});
$("speed").addEventListener("input", (e) => {
  $("speed-out").textContent = `${Number(e.target.value).toFixed(2)}×`;
});
$("speed").addEventListener("change", (e) => agent.updateSession({ speed: Number(e.target.value) }));

// ---- modes --------------------------------------------------------------

for (const radio of document.querySelectorAll('input[name="mode"]')) {
  radio.addEventListener("change", () => {
    for (const panel of document.querySelectorAll(".panel")) {
      panel.hidden = panel.dataset.mode !== radio.value;
    }
  });
}

// Type: completed words stream as they are typed; Enter speaks the rest.
const typeText = $("type-text");
let typeTurn = null;
let typeSent = "";

function typeReset() {
  typeTurn = null;
  typeSent = "";
}

function typeSendUpTo(end, flush) {
  const delta = typeText.value.slice(typeSent.length, end);
  if (delta === "" && !flush) return;
  if (typeTurn === null) {
    if (delta.trim() === "") return;
    typeTurn = agent.openTurn("Typed");
  }
  if (delta !== "") agent.sendText(typeTurn, delta, flush);
  else agent.flush(typeTurn);
  typeSent += delta;
}

typeText.addEventListener("beforeinput", (e) => {
  // Words already sent cannot be unsaid: keep edits after them.
  const start = typeText.selectionStart;
  const isBackward = e.inputType.startsWith("deleteContentBackward") && start === typeText.selectionEnd;
  if (typeSent && (start < typeSent.length || (isBackward && start <= typeSent.length))) {
    e.preventDefault();
    notice("Words already sent to the voice cannot be changed; press Enter to start a new turn.");
  }
});

typeText.addEventListener("input", () => {
  if (!typeText.value.startsWith(typeSent)) {
    // Changed another way (e.g. a script): start over with what is there.
    if (typeTurn) agent.flush(typeTurn);
    typeReset();
  }
  if (!$("type-live").checked) return;
  const lastSpace = Math.max(typeText.value.lastIndexOf(" "), typeText.value.lastIndexOf("\n"));
  if (lastSpace + 1 > typeSent.length) typeSendUpTo(lastSpace + 1, false);
});

typeText.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    $("panel-type").requestSubmit();
  }
});

$("panel-type").addEventListener("submit", (e) => {
  e.preventDefault();
  if (typeText.value.trim() === "" && typeTurn === null) return;
  typeSendUpTo(typeText.value.length, true);
  typeText.value = "";
  typeReset();
});

// Stream an answer: replay text token by token at the chosen rate.
$("answer-rate").addEventListener("input", (e) => {
  $("answer-rate-out").textContent = `${e.target.value} tokens/s`;
});

async function runSource(kind, button, idleLabel, body) {
  if (source !== null) {
    stopSource();
    return;
  }
  const abort = new AbortController();
  source = { abort, kind };
  button.textContent = "Stop";
  try {
    await body(abort.signal);
  } catch (err) {
    if (err.name !== "AbortError") notice(err.message);
  } finally {
    if (source?.abort === abort) source = null;
    button.textContent = idleLabel;
  }
}

function stopSource() {
  if (source !== null) {
    source.abort.abort();
    source = null;
  }
}

$("panel-answer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("answer-text").value;
  if (text.trim() === "") return;
  runSource("answer", $("answer-go"), "Stream answer", async (signal) => {
    const turn = agent.openTurn("Answer");
    const rate = () => Number($("answer-rate").value);
    for await (const token of replayAnswer(text, rate, signal)) agent.sendText(turn, token);
    if (!signal.aborted) agent.flush(turn);
  });
});

// LLM: a chat completion from an OpenAI-compatible endpoint, into voxgate.
const history = [];

function llmSettings() {
  return {
    endpoint: $("llm-url").value, model: $("llm-model").value,
    apiKey: $("llm-key").value, system: $("llm-system").value,
  };
}

function restoreLlmSettings() {
  try {
    const saved = JSON.parse(sessionStorage.getItem(LLM_SETTINGS_KEY) ?? "{}");
    if (saved.endpoint) $("llm-url").value = saved.endpoint;
    if (saved.model) $("llm-model").value = saved.model;
    if (saved.apiKey) $("llm-key").value = saved.apiKey;
  } catch { /* nothing saved */ }
}

function chatBubble(role, text) {
  const item = document.createElement("li");
  item.className = `msg ${role}`;
  item.textContent = text;
  $("llm-chat").append(item);
  item.scrollIntoView({ block: "nearest" });
  return item;
}

$("panel-llm").addEventListener("submit", (e) => {
  e.preventDefault();
  const input = $("llm-input");
  const question = input.value.trim();
  if (source !== null) {
    interrupt("stop button");
    return;
  }
  if (question === "") return;
  const settings = llmSettings();
  sessionStorage.setItem(LLM_SETTINGS_KEY, JSON.stringify({ ...settings, system: undefined }));
  input.value = "";
  chatBubble("user", question);
  history.push({ role: "user", content: question });
  runSource("llm", $("llm-send"), "Send", async (signal) => {
    const turn = agent.openTurn("LLM");
    const bubble = chatBubble("assistant", "");
    const entry = { role: "assistant", content: "" };
    // After a barge-in the history keeps only what the listener heard.
    turn.onCut = (spoken) => {
      bubble.classList.add("cut");
      bubble.dataset.heard = spoken;
      entry.content = spoken;
      const at = history.indexOf(entry);
      if (spoken.trim() === "" && at >= 0) history.splice(at, 1);
      else if (spoken.trim() !== "" && at < 0) history.push(entry);
    };
    history.push(entry);
    const messages = settings.system ? [{ role: "system", content: settings.system }] : [];
    messages.push(...history.slice(0, -1));
    for await (const delta of streamChat({ ...settings, messages, signal })) {
      agent.sendText(turn, delta);
      entry.content += delta;
      bubble.textContent += delta;
    }
    if (!signal.aborted) agent.flush(turn);
    if (entry.content === "" && history.at(-1) === entry) history.pop();
  });
});

$("llm-reset").addEventListener("click", () => {
  history.length = 0;
  $("llm-chat").replaceChildren();
});

// ---- barge-in -----------------------------------------------------------

async function interrupt(reason) {
  stopSource();
  if (typeTurn !== null) {
    typeText.value = "";
    typeReset();
  }
  return agent.interrupt(reason);
}

$("interrupt").addEventListener("click", () => interrupt("button"));
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && !e.defaultPrevented) interrupt("escape");
});

const mic = new MicVad({
  onLevel(db) {
    const meter = $("mic-level");
    meter.value = Math.max(-90, db);
    meter.textContent = `${Math.round(db)} dB`;
  },
  onSpeech() {
    if (agent.isSpeaking) interrupt("microphone");
  },
});

$("mic-threshold").addEventListener("input", (e) => {
  mic.thresholdDb = Number(e.target.value);
  $("mic-threshold-out").textContent = `${e.target.value} dB`;
});

$("mic-on").addEventListener("change", async (e) => {
  if (e.target.checked) {
    try {
      await mic.start();
    } catch (err) {
      e.target.checked = false;
      notice(`Microphone unavailable: ${err.message}`);
    }
  } else {
    mic.stop();
  }
});

// ---- stats --------------------------------------------------------------

function renderStats() {
  const s = agent.stats;
  const fmt = (ms) => (ms === null ? "–" : `${Math.round(ms)} ms`);
  $("st-ttfa").textContent = s.ttfa_ms === null ? "–" : `${fmt(s.ttfa_ms)} (net ${fmt(s.ttfa_recv_ms)})`;
  $("st-buffer").textContent = `${Math.round(s.buffer_ms)} ms`;
  $("st-underruns").textContent = String(s.underruns);
  $("st-state").textContent = s.state;
  $("st-turns").textContent = String(s.turns);
}

// ---- start --------------------------------------------------------------

async function main() {
  const forced = params.get("codec");
  const codec = forced === "opus" || forced === "pcm16" ? forced
    : (await isOpusSupported()) ? "opus" : "pcm16";
  const jitter = Number(params.get("jitter_ms") ?? 60);
  agent = new Agent({
    ui, codec, voice: params.get("voice") ?? undefined,
    jitterMs: Number.isFinite(jitter) ? jitter : 60,
    pacing: params.get("pacing") === "asap" ? "asap" : "realtime",
  });
  window.voxgate = {
    agent, stats: agent.stats, captions, mic,
    speak: (text) => agent.speak(text),
    interrupt: (reason = "script") => interrupt(reason),
  };
  $("st-codec").textContent = codec;
  $("reconnect").addEventListener("click", () => agent.connect());
  // Browsers keep audio suspended until the user interacts with the page.
  for (const type of ["pointerdown", "keydown"]) {
    document.addEventListener(type, () => agent.player.resume(), { capture: true });
  }
  restoreLlmSettings();
  setInterval(renderStats, 100);
  await Promise.all([agent.start(), loadVoices()]);
  document.body.dataset.ready = "true";
}

main().catch((err) => notice(`voxgate failed to start: ${err.message}`));
