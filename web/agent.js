// The voice-agent core of the page: turns (contexts), the socket, playback,
// barge-in and the numbers the stats panel and the browser tests read.
//
// TTFA here is what a listener waits for (docs/loadtest.md, "The numbers"): from the
// moment the turn's first segment was complete in the text sent (the send
// that carried the text confirming its end, or the last send when nothing
// followed it) to the first sample of the turn leaving the player, jitter
// buffer included. `ttfa_recv_ms` stops at the first audio frame received.

import { Connection, streamUrl } from "./connection.js";
import { Player } from "./player.js";

const PLAYBACK_REPORT_MS = 250;
const MAX_HISTORY = 50;

export function newStats() {
  return {
    connected: false, session_id: null, codec: null, stream_sample_rate: null,
    output_sample_rate: null, turns: 0, ttfa_ms: null, ttfa_recv_ms: null,
    ttfa_history: [], first_played_at: null, frames_played: 0, played_ms: 0,
    playing_context: null, buffer_ms: 0, underruns: 0, gap_ms: 0, state: "idle",
    audio_frames: 0, bytes_in: 0, decode_errors: 0, cancels: 0, last_cancel: null, errors: [],
    skipped_chars: 0, skipped: [],
  };
}

export class Agent {
  // ui: {onStatus(state, text), onError(msg), onLog(text), onOptions(opts),
  //      captions: Captions, onCut(cancel), onTurnPlayed(turn)}
  constructor({ ui, codec, voice, jitterMs, pacing }) {
    this.ui = ui;
    this.wantCodec = codec;
    this.pacing = pacing;
    this.voice = voice;
    this.jitterMs = jitterMs;
    this.stats = newStats();
    this.turns = new Map(); // ctx -> turn
    this.options = {};
    this.conn = null;
    this.player = new Player({ onEvent: (msg) => this.onPlayer(msg) });
    this.numTurns = 0;
    this.lastReport = new Map(); // ctx -> time of the last playback report
    this.retryMs = 1000;
    this.retryTimer = null;
    this.isClosing = false;
  }

  async start() {
    await this.player.start(this.jitterMs);
    this.stats.output_sample_rate = this.player.sampleRate;
    await this.connect();
  }

  async connect() {
    clearTimeout(this.retryTimer);
    if (this.conn !== null) this.conn.close(); // a Reconnect click during a retry wait
    const url = streamUrl(location.href, {
      codec: this.wantCodec, sample_rate: 48000, voice: this.voice,
    });
    // Events of a connection this one replaced are ignored.
    const conn = new Connection({
      url,
      onMessage: (msg) => { if (this.conn === conn) this.onMessage(msg); },
      onState: (state, detail) => { if (this.conn === conn) this.onConnState(state, detail); },
    });
    this.conn = conn;
    try {
      await conn.open();
      this.retryMs = 1000;
    } catch (err) {
      this.ui.onLog(err.message);
    }
  }

  onConnState(state, detail) {
    this.stats.connected = state === "ready";
    if (state === "ready") {
      this.ui.onStatus("ready", "Connected");
    } else if (state === "connecting") {
      this.ui.onStatus("connecting", "Connecting…");
    } else {
      const why = detail.reason ? `: ${detail.reason}` : "";
      this.ui.onStatus("closed", `Disconnected (${detail.code}${why})`);
      for (const turn of this.turns.values()) {
        if (turn.state === "open" || turn.state === "flushed") turn.state = "lost";
      }
      if (!this.isClosing && detail.code !== 4401) {
        this.retryTimer = setTimeout(() => this.connect(), this.retryMs);
        this.retryMs = Math.min(this.retryMs * 2, 30000);
      }
    }
  }

  applyOptions(msg) {
    const opts = msg.options && typeof msg.options === "object" ? msg.options : msg;
    Object.assign(this.options, opts);
    if (typeof opts.codec === "string") this.stats.codec = opts.codec;
    if (typeof opts.sample_rate === "number") this.stats.stream_sample_rate = opts.sample_rate;
    this.ui.onOptions(this.options);
  }

  send(msg) {
    if (this.conn === null || !this.conn.send(msg)) {
      this.ui.onError("Not connected to voxgate: the text was not sent.");
      return false;
    }
    return true;
  }

  updateSession(fields) {
    return this.send({ type: "session.update", ...fields });
  }

  // A new spoken turn: `label` names its source in the captions.
  openTurn(label) {
    this.numTurns += 1;
    const id = `${label.toLowerCase().replace(/[^a-z]/g, "") || "turn"}-${Date.now().toString(36)}-${this.numTurns}`;
    const turn = {
      id, label, state: "open", text: "", t_first_send: null, t_last_send: null,
      sends: [], t_release: null, t_first_audio: null, t_first_played: null, ttfa_ms: null,
      played_ms: 0, onCut: null, onPlayed: null,
    };
    this.turns.set(id, turn);
    while (this.turns.size > MAX_HISTORY) this.turns.delete(this.turns.keys().next().value);
    this.player.resume();
    return turn;
  }

  sendText(turn, text, flush = false) {
    if (turn.state !== "open") return false;
    const msg = { type: "text", context_id: turn.id, text };
    if (flush) msg.flush = true;
    if (!this.send(msg)) return false;
    const now = performance.now();
    turn.t_first_send ??= now;
    turn.text += text;
    if (turn.t_release === null) {
      turn.t_last_send = now;
      turn.sends.push({ end: turn.text.length, t: now });
    }
    if (flush) turn.state = "flushed";
    return true;
  }

  flush(turn) {
    if (turn.state !== "open") return;
    if (turn.text === "") {
      turn.state = "played"; // never created on the server
      return;
    }
    if (this.send({ type: "flush", context_id: turn.id })) turn.state = "flushed";
  }

  speak(text, label = "Typed") {
    const turn = this.openTurn(label);
    this.sendText(turn, text, true);
    return turn;
  }

  isLive(turn) {
    return ["open", "flushed", "done"].includes(turn.state);
  }

  get isSpeaking() {
    return [...this.turns.values()].some((t) => this.isLive(t) && t.t_first_audio !== null);
  }

  // Barge-in: silence first, then tell the server what was heard.
  async interrupt(reason) {
    const t0 = performance.now();
    const live = [...this.turns.values()].filter((t) => this.isLive(t));
    for (const turn of live) turn.state = "cancelled";
    const flushed = await this.player.flush(live.map((t) => t.id));
    const silenceMs = performance.now() - t0;
    if (live.length === 0) return null;
    let shown = live.find((t) => t.id === flushed.ctx) ?? live[live.length - 1];
    for (const turn of live) {
      const played = turn.id === flushed.ctx ? flushed.played_ms : 0;
      turn.played_ms = played;
      if (turn.text !== "") {
        this.send({ type: "cancel", context_id: turn.id, played_ms: Math.round(played) });
      }
      this.ui.captions.cut(turn.id, played);
    }
    const local = this.ui.captions.heardText(shown.id, shown.played_ms);
    this.stats.cancels += 1;
    this.stats.last_cancel = {
      context_id: shown.id, reason, played_ms: Math.round(shown.played_ms),
      silence_ms: silenceMs, spoken_text: local.spoken,
      unspoken_text: local.unspoken || (shown.played_ms === 0 ? shown.text : ""),
      source: "local", answered: false,
    };
    this.ui.onCut(this.stats.last_cancel);
    for (const turn of live) turn.onCut?.(turn.id === shown.id ? local.spoken : "");
    this.ui.onLog(`interrupt (${reason}): silent after ${silenceMs.toFixed(1)} ms`);
    return this.stats.last_cancel;
  }

  onMessage(msg) {
    const turn = typeof msg.context_id === "string" ? this.turns.get(msg.context_id) : undefined;
    switch (msg.type) {
      case "session.ready":
        this.stats.session_id = msg.session_id ?? null;
        this.applyOptions(msg);
        {
          // Ask for what the query could not say, or the server did not take.
          const update = {};
          if (this.wantCodec && this.stats.codec && this.stats.codec !== this.wantCodec) {
            update.codec = this.wantCodec;
          }
          if (this.pacing && this.options.pacing !== this.pacing) update.pacing = this.pacing;
          if (Object.keys(update).length > 0) this.updateSession(update);
        }
        break;
      case "session.updated":
        this.applyOptions(msg);
        break;
      case "audio":
        this.onAudio(msg, turn);
        break;
      case "segment":
        if (!turn || turn.state === "cancelled") break;
        if (turn.t_release === null) this.release(turn, String(msg.text ?? ""));
        this.ui.captions.addSegment(turn.id, turn.label, msg);
        break;
      case "text.skipped":
        // Text no voice of the server could say (another language): shown, never heard.
        if (!turn || turn.state === "cancelled") break;
        this.onSkipped(msg, turn);
        break;
      case "context.done":
        if (!turn || turn.state === "cancelled") break;
        turn.state = "done";
        if (turn.t_first_audio === null) this.finishTurn(turn); // nothing to play
        else this.player.end(turn.id);
        break;
      case "cancelled":
        this.onCancelled(msg);
        break;
      case "error":
        this.onServerError(msg, turn);
        break;
      default:
        this.ui.onLog(`ignored a message of type ${msg.type}`);
    }
    this.stats.bytes_in = this.conn ? this.conn.bytesIn : 0;
  }

  // When the first segment (text `first`; null when unknown) was complete
  // in what was sent.
  release(turn, first) {
    if (first === null) {
      turn.t_release = turn.t_last_send;
      turn.sends = [];
      return;
    }
    const at = turn.text.indexOf(first);
    const end = at >= 0 ? at + first.length : first.length;
    const confirming = turn.sends.find((send) => send.end > end);
    turn.t_release = confirming ? confirming.t : turn.t_last_send;
    turn.sends = [];
  }

  onAudio(msg, turn) {
    if (!turn || turn.state === "cancelled" || turn.state === "played") return;
    const now = performance.now();
    this.stats.audio_frames += 1;
    if (turn.t_first_audio === null) {
      turn.t_first_audio = now;
      if (turn.t_release === null) this.release(turn, null);
      this.stats.ttfa_recv_ms = now - turn.t_release;
    }
    try {
      this.player.push(msg, this.stats.stream_sample_rate);
    } catch (err) {
      this.ui.onError(err.message);
    }
    this.stats.decode_errors = this.player.decodeErrors;
    if (this.player.decodeErrors > 0 && this.stats.codec === "opus") {
      this.ui.onError("This browser failed to decode Opus; switching to pcm16.");
      this.wantCodec = "pcm16";
      this.updateSession({ codec: "pcm16" });
      this.stats.codec = "pcm16";
    }
  }

  onSkipped(msg, turn) {
    const text = String(msg.text ?? "");
    this.stats.skipped_chars += text.length;
    this.stats.skipped.push({ context_id: turn.id, text, language: msg.language ?? null });
    if (this.stats.skipped.length > MAX_HISTORY) this.stats.skipped.shift();
    this.ui.captions.addSkipped(turn.id, turn.label, msg);
    this.ui.onLog(`not spoken (${msg.language ?? "unknown language"}): ${text.length} characters`);
  }

  onCancelled(msg) {
    const last = this.stats.last_cancel;
    if (!last || (msg.context_id !== null && msg.context_id !== last.context_id)) return;
    last.answered = true;
    if (typeof msg.spoken_text === "string") {
      last.spoken_text = msg.spoken_text;
      last.unspoken_text = typeof msg.unspoken_text === "string" ? msg.unspoken_text : "";
      last.source = "server";
      last.audio_ms_sent = msg.audio_ms_sent;
      const turn = this.turns.get(last.context_id);
      turn?.onCut?.(msg.spoken_text);
      this.ui.onCut(last);
    }
  }

  onServerError(msg, turn) {
    const entry = { code: msg.code, message: msg.message, context_id: msg.context_id ?? null };
    this.stats.errors.push(entry);
    if (this.stats.errors.length > MAX_HISTORY) this.stats.errors.shift();
    // A cancel or playback report that raced the end of its context on the
    // server: not the user's problem (after a cancel the local estimate stands).
    if (msg.code === "context_closed" && turn && turn.state !== "open" && turn.state !== "flushed") {
      this.ui.onLog(`server: ${msg.code} for ${msg.context_id} (already finished)`);
      return;
    }
    if (turn && this.isLive(turn)) turn.state = "failed";
    this.ui.onError(`${msg.code}: ${msg.message}${msg.fatal ? " (connection closed)" : ""}`);
  }

  onPlayer(msg) {
    const now = performance.now();
    const turn = msg.ctx ? this.turns.get(msg.ctx) : undefined;
    switch (msg.type) {
      case "started":
        if (turn && turn.t_first_played === null) {
          turn.t_first_played = now;
          turn.ttfa_ms = now - (turn.t_release ?? turn.t_last_send ?? now);
          this.stats.turns += 1;
          this.stats.ttfa_ms = turn.ttfa_ms;
          this.stats.ttfa_history.push(Math.round(turn.ttfa_ms));
          if (this.stats.ttfa_history.length > MAX_HISTORY) this.stats.ttfa_history.shift();
          this.stats.first_played_at ??= now;
        }
        break;
      case "progress":
        this.stats.buffer_ms = msg.buffered_ms;
        this.stats.underruns = msg.underruns;
        this.stats.state = msg.state;
        this.stats.frames_played = msg.frames;
        this.stats.playing_context = msg.ctx;
        if (turn && turn.state !== "cancelled" && turn.state !== "played") {
          this.stats.played_ms = msg.played_ms;
          turn.played_ms = msg.played_ms;
          this.ui.captions.highlight(turn.id, msg.played_ms - this.outputLatencyMs());
          this.reportPlayback(turn, now);
        }
        break;
      case "underrun":
        this.stats.gap_ms += msg.gap_ms ?? 0;
        this.ui.onLog(`underrun in ${msg.ctx} at ${Math.round(msg.played_ms)} ms`);
        break;
      case "finished":
        if (turn && turn.state !== "cancelled") {
          turn.played_ms = msg.played_ms;
          this.send({ type: "playback", context_id: turn.id, played_ms: Math.round(msg.played_ms) });
          this.finishTurn(turn);
        }
        break;
    }
  }

  finishTurn(turn) {
    turn.state = "played";
    this.lastReport.delete(turn.id);
    this.ui.captions.finish(turn.id);
    turn.onPlayed?.();
  }

  reportPlayback(turn, now) {
    const last = this.lastReport.get(turn.id) ?? 0;
    if (now - last < PLAYBACK_REPORT_MS) return;
    this.lastReport.set(turn.id, now);
    this.send({ type: "playback", context_id: turn.id, played_ms: Math.round(turn.played_ms) });
  }

  outputLatencyMs() {
    const ac = this.player.ac;
    return ac ? ((ac.outputLatency || 0) + (ac.baseLatency || 0)) * 1000 : 0;
  }
}
