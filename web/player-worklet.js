// The playback end of the page: an AudioWorkletProcessor that plays mono
// float samples from a ring buffer, behind a small jitter buffer.
//
// Messages in (port):
//   {type: "push", ctx, pts_ms, samples: Float32Array}  audio of a context, in order
//   {type: "end", ctx}                                   no more audio for ctx
//   {type: "flush", id}                                  drop everything now (barge-in)
//   {type: "config", jitter_ms}
// Messages out:
//   {type: "started", ctx}                 first sample of ctx is being played
//   {type: "progress", ctx, played_ms, buffered_ms, underruns, state, frames}
//   {type: "underrun", ctx, played_ms}     the buffer ran dry before ctx ended
//   {type: "finished", ctx, played_ms}     all of ctx was played
//   {type: "flushed", id, ctx, played_ms}  answer to flush: what was heard of ctx
//
// Contexts play one after the other in push order (docs/protocol.md, "Contexts").
// A context starts, and resumes after an underrun, once `jitter_ms` of audio
// is buffered or its end has arrived, so network jitter does not turn into
// audible gaps.

const IDLE = 0;
const BUFFERING = 1;
const PLAYING = 2;
const STATE_NAMES = ["idle", "buffering", "playing"];
const PROGRESS_EVERY = 8; // render quanta between progress reports (~21 ms at 48 kHz)

class PlayerProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.ring = new Float32Array(sampleRate * 4);
    this.readAbs = 0; // absolute frame index of the next sample to play
    this.writeAbs = 0; // absolute frame index one past the last sample written
    this.marks = []; // [{ctx, start, length, pts_ms}] one per pushed chunk, in order
    this.ended = new Set(); // contexts whose last audio has been pushed
    this.state = IDLE;
    this.currentCtx = null;
    this.currentPlayedMs = 0;
    this.jitterFrames = Math.round(sampleRate * 0.06);
    this.underruns = 0;
    this.framesPlayed = 0;
    this.quanta = 0;
    this.starved = null; // {ctx, played_ms, at}: ran dry, not yet known to be a gap
    this.port.onmessage = (event) => this.receive(event.data);
  }

  receive(msg) {
    switch (msg.type) {
      case "push": this.push(msg.ctx, msg.pts_ms, msg.samples); break;
      case "end": this.ended.add(msg.ctx); break;
      case "flush": this.flush(msg.id); break;
      case "config":
        if (typeof msg.jitter_ms === "number") {
          this.jitterFrames = Math.max(0, Math.round((sampleRate * msg.jitter_ms) / 1000));
        }
        break;
    }
  }

  push(ctx, ptsMs, samples) {
    const buffered = this.writeAbs - this.readAbs;
    if (buffered + samples.length > this.ring.length) this.grow(buffered + samples.length);
    const cap = this.ring.length;
    let at = this.writeAbs % cap;
    const first = Math.min(samples.length, cap - at);
    this.ring.set(samples.subarray(0, first), at);
    if (first < samples.length) this.ring.set(samples.subarray(first), 0);
    this.marks.push({ ctx, start: this.writeAbs, length: samples.length, pts_ms: ptsMs });
    if (this.starved !== null && this.starved.ctx === ctx) {
      this.underruns += 1;
      this.port.postMessage({
        type: "underrun", ctx, played_ms: this.starved.played_ms,
        gap_ms: (currentTime - this.starved.at) * 1000,
      });
      this.starved = null;
    }
    this.writeAbs += samples.length;
  }

  // Long answers under `pacing: asap` arrive far ahead of playback: grow
  // rather than drop (the server bounds the lead under `pacing: realtime`).
  grow(needed) {
    let cap = this.ring.length;
    while (cap < needed) cap *= 2;
    const next = new Float32Array(cap);
    const old = this.ring;
    for (let abs = this.readAbs; abs < this.writeAbs; abs++) {
      next[abs % cap] = old[abs % old.length];
    }
    this.ring = next;
  }

  flush(id) {
    const ctx = this.currentCtx;
    const playedMs = this.currentPlayedMs;
    this.readAbs = this.writeAbs;
    this.marks = [];
    this.state = IDLE;
    this.currentCtx = null;
    this.starved = null;
    this.ended.clear();
    this.port.postMessage({ type: "flushed", id, ctx, played_ms: playedMs });
    this.report();
  }

  bufferedFramesOfHead() {
    if (this.marks.length === 0) return 0;
    const ctx = this.marks[0].ctx;
    let n = 0;
    for (const m of this.marks) {
      if (m.ctx !== ctx) return n + 1e12; // a later context follows: the head is complete
      n += m.start + m.length - Math.max(m.start, this.readAbs);
    }
    return n;
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    const frames = out.length;
    if (this.state !== PLAYING && this.marks.length > 0) {
      const ready = this.bufferedFramesOfHead() >= this.jitterFrames ||
        this.ended.has(this.marks[0].ctx);
      if (ready) this.state = PLAYING;
      else this.state = BUFFERING;
    }
    let written = 0;
    if (this.state === PLAYING) {
      while (written < frames && this.marks.length > 0) {
        const mark = this.marks[0];
        if (mark.ctx !== this.currentCtx) {
          if (this.currentCtx !== null) this.finish(this.currentCtx);
          this.currentCtx = mark.ctx;
          this.currentPlayedMs = mark.pts_ms;
          this.port.postMessage({ type: "started", ctx: mark.ctx });
        }
        const markEnd = mark.start + mark.length;
        const n = Math.min(frames - written, markEnd - this.readAbs);
        const cap = this.ring.length;
        for (let i = 0; i < n; i++) out[written + i] = this.ring[(this.readAbs + i) % cap];
        this.readAbs += n;
        written += n;
        this.currentPlayedMs = mark.pts_ms + ((this.readAbs - mark.start) * 1000) / sampleRate;
        if (this.readAbs >= markEnd) this.marks.shift();
      }
      this.framesPlayed += written;
      if (this.marks.length === 0) {
        if (this.currentCtx !== null && this.ended.has(this.currentCtx)) {
          this.finish(this.currentCtx);
          this.currentCtx = null;
          this.state = IDLE;
        } else if (this.currentCtx !== null) {
          // Dry before ctx ended. Whether this is a gap or simply the end of
          // the turn (its "end" still in flight) is known only when more
          // audio of ctx arrives, so the underrun is counted then.
          this.state = BUFFERING;
          this.starved = { ctx: this.currentCtx, played_ms: this.currentPlayedMs, at: currentTime };
        } else {
          this.state = IDLE;
        }
      }
    } else if (this.state === BUFFERING && this.currentCtx !== null &&
      this.ended.has(this.currentCtx) && (this.marks.length === 0 ||
      this.marks[0].ctx !== this.currentCtx)) {
      // ctx ended while we were waiting for more of it
      this.finish(this.currentCtx);
      this.currentCtx = null;
      this.state = this.marks.length > 0 ? BUFFERING : IDLE;
    }
    out.fill(0, written);
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    if (++this.quanta % PROGRESS_EVERY === 0) this.report();
    return true;
  }

  finish(ctx) {
    this.ended.delete(ctx);
    if (this.starved !== null && this.starved.ctx === ctx) this.starved = null;
    this.port.postMessage({ type: "finished", ctx, played_ms: this.currentPlayedMs });
    this.report();
  }

  report() {
    this.port.postMessage({
      type: "progress",
      ctx: this.currentCtx,
      played_ms: this.currentPlayedMs,
      buffered_ms: ((this.writeAbs - this.readAbs) * 1000) / sampleRate,
      underruns: this.underruns,
      state: STATE_NAMES[this.state],
      frames: this.framesPlayed,
    });
  }
}

registerProcessor("voxgate-player", PlayerProcessor);
