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
import { setupPanels } from "./panels.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);

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

// ---- barge-in -----------------------------------------------------------

async function interrupt(reason) {
  panels.stop();
  panels.forgetTyping();
  return agent.interrupt(reason);
}

const panels = setupPanels({ getAgent: () => agent, notice, interrupt });

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
  const earlier = s.ttfa_history.slice(-6, -1).reverse();
  $("st-ttfa-recent").textContent = earlier.length ? `${earlier.join(", ")} ms` : "–";
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
  setInterval(renderStats, 100);
  await Promise.all([agent.start(), loadVoices()]);
  document.body.dataset.ready = "true";
}

main().catch((err) => notice(`voxgate failed to start: ${err.message}`));
