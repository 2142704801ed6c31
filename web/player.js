// Decodes voxgate audio frames and feeds the playback worklet.
//
// Opus goes through WebCodecs `AudioDecoder`; pcm16 is converted here. One
// decoder serves every context: its outputs come in decode order, and a map
// queue of chunk timestamps, on a running microsecond clock that advances by
// each packet's duration (decoders derive output timestamps that way), tells
// each output which context and pts it belongs to.

const OUTPUT_RATE = 48000;

export async function isOpusSupported() {
  if (typeof AudioDecoder === "undefined") return false;
  try {
    const result = await AudioDecoder.isConfigSupported({
      codec: "opus", sampleRate: OUTPUT_RATE, numberOfChannels: 1,
    });
    return result.supported === true;
  } catch {
    return false;
  }
}

// Linear interpolation with state carried across chunks, for a stream whose
// rate differs from the AudioContext's (e.g. pcm16 at 24 kHz).
class Resampler {
  constructor(fromRate, toRate) {
    this.step = fromRate / toRate;
    this.pos = 0; // position of the next output sample, relative to `last`
    this.last = 0; // the previous chunk's final sample (index -1)
  }

  process(input) {
    const count = Math.max(0, Math.floor((input.length - this.pos) / this.step));
    const out = new Float32Array(count);
    for (let i = 0; i < count; i++) {
      const x = this.pos + i * this.step;
      const k = Math.floor(x);
      const frac = x - k;
      const a = k === 0 ? this.last : input[k - 1];
      const b = input[k] ?? a;
      out[i] = a + (b - a) * frac;
    }
    this.pos = this.pos + count * this.step - input.length;
    if (input.length > 0) this.last = input[input.length - 1];
    return out;
  }
}

export class Player {
  // onEvent(msg) receives the worklet's messages (started, progress, ...).
  constructor({ onEvent }) {
    this.onEvent = onEvent;
    this.ac = null;
    this.node = null;
    this.decoder = null;
    this.chunkInfo = []; // [{timestamp, ctx, pts_ms}] of chunks sent to the decoder
    this.clockUs = 0;
    this.resamplers = new Map(); // ctx -> Resampler
    this.dropped = new Set(); // contexts whose audio must not play any more
    this.flushWaiters = new Map();
    this.nextFlushId = 1;
    this.decodeErrors = 0;
    this.numOrphans = 0; // decoder outputs matched to no chunk (dropped)
  }

  async start(jitterMs) {
    let ac;
    try {
      ac = new AudioContext({ sampleRate: OUTPUT_RATE, latencyHint: "interactive" });
    } catch {
      ac = new AudioContext({ latencyHint: "interactive" });
    }
    await ac.audioWorklet.addModule(new URL("./player-worklet.js", import.meta.url));
    this.node = new AudioWorkletNode(ac, "voxgate-player", {
      numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [1],
    });
    this.node.port.onmessage = (event) => this.receive(event.data);
    this.node.connect(ac.destination);
    this.ac = ac;
    this.setJitter(jitterMs);
  }

  get sampleRate() {
    return this.ac ? this.ac.sampleRate : OUTPUT_RATE;
  }

  // Browsers start an AudioContext suspended until the user interacts.
  resume() {
    if (this.ac && this.ac.state === "suspended") this.ac.resume().catch(() => {});
  }

  setJitter(ms) {
    if (this.node) this.node.port.postMessage({ type: "config", jitter_ms: ms });
  }

  receive(msg) {
    if (msg.type === "flushed") {
      const resolve = this.flushWaiters.get(msg.id);
      this.flushWaiters.delete(msg.id);
      if (resolve) resolve(msg);
    }
    this.onEvent(msg);
  }

  // frame: a decoded `audio` message; streamRate: the session's sample_rate.
  push(frame, streamRate) {
    const ctx = frame.context_id;
    if (this.dropped.has(ctx) || this.node === null) return;
    const codec = frame.codec ?? (frame.packets ? "opus" : "pcm16");
    if (codec === "opus") {
      this.pushOpus(ctx, frame);
    } else if (codec === "pcm16") {
      this.pushPcm16(ctx, frame, streamRate);
    } else {
      throw new Error(`expected audio codec opus or pcm16, got ${codec}`);
    }
  }

  pushPcm16(ctx, frame, streamRate) {
    const bytes = frame.data;
    const count = Math.floor(bytes.byteLength / 2);
    const view = new DataView(bytes.buffer, bytes.byteOffset, count * 2);
    const samples = new Float32Array(count);
    for (let i = 0; i < count; i++) samples[i] = view.getInt16(i * 2, true) / 32768;
    this.deliver(ctx, frame.pts_ms, samples, streamRate || this.sampleRate);
  }

  pushOpus(ctx, frame) {
    this.ensureDecoder();
    const packets = frame.packets ?? (frame.data ? [frame.data] : []);
    const each = packets.length ? (frame.duration_ms ?? 20) / packets.length : 0;
    packets.forEach((packet, i) => {
      const timestamp = Math.round(this.clockUs);
      this.clockUs += Math.max(1, each) * 1000;
      this.chunkInfo.push({ timestamp, ctx, pts_ms: frame.pts_ms + i * each });
      this.decoder.decode(new EncodedAudioChunk({
        type: "key", timestamp, duration: Math.round(each * 1000), data: packet,
      }));
    });
  }

  ensureDecoder() {
    if (this.decoder !== null && this.decoder.state === "configured") return;
    this.decoder = new AudioDecoder({
      output: (data) => this.decoded(data),
      error: (err) => {
        this.decodeErrors += 1;
        console.warn("voxgate: opus decoder error:", err.message);
        this.decoder = null;
      },
    });
    this.decoder.configure({ codec: "opus", sampleRate: OUTPUT_RATE, numberOfChannels: 1 });
  }

  // The info of the chunk that produced an output; chunks that produced
  // nothing (the decoder may swallow one) are skipped over.
  takeInfo(timestamp) {
    const queue = this.chunkInfo;
    while (queue.length > 0 && queue[0].timestamp < timestamp - 500) queue.shift();
    if (queue.length > 0 && Math.abs(queue[0].timestamp - timestamp) <= 500) return queue.shift();
    return undefined;
  }

  decoded(data) {
    const info = this.takeInfo(data.timestamp);
    try {
      if (!info) this.numOrphans += 1;
      if (!info || this.dropped.has(info.ctx)) return;
      const samples = new Float32Array(data.numberOfFrames);
      data.copyTo(samples, { planeIndex: 0, format: "f32-planar" });
      this.deliver(info.ctx, info.pts_ms, samples, data.sampleRate);
    } finally {
      data.close();
    }
  }

  deliver(ctx, ptsMs, samples, rate) {
    if (rate !== this.sampleRate) {
      let resampler = this.resamplers.get(ctx);
      if (!resampler) {
        resampler = new Resampler(rate, this.sampleRate);
        this.resamplers.set(ctx, resampler);
      }
      samples = resampler.process(samples);
    }
    this.node.port.postMessage({ type: "push", ctx, pts_ms: ptsMs, samples }, [samples.buffer]);
  }

  // All audio of ctx has arrived: once the decoder has emitted it, tell the
  // worklet, so that running dry at its end is not counted as an underrun.
  async end(ctx) {
    if (this.decoder !== null && this.decoder.state === "configured") {
      try {
        await this.decoder.flush();
      } catch {
        return; // reset by a barge-in: nothing of ctx will play anyway
      }
    }
    this.resamplers.delete(ctx);
    if (this.node && !this.dropped.has(ctx)) this.node.port.postMessage({ type: "end", ctx });
  }

  // Barge-in: silence now. Resolves to {ctx, played_ms} of what was playing.
  flush(contexts) {
    for (const ctx of contexts) this.dropped.add(ctx);
    if (this.decoder !== null && this.decoder.state === "configured") {
      this.decoder.reset();
      this.decoder.configure({ codec: "opus", sampleRate: OUTPUT_RATE, numberOfChannels: 1 });
    }
    this.chunkInfo = [];
    this.resamplers.clear();
    if (this.node === null) return Promise.resolve({ ctx: null, played_ms: 0 });
    const id = this.nextFlushId++;
    return new Promise((resolve) => {
      this.flushWaiters.set(id, resolve);
      this.node.port.postMessage({ type: "flush", id });
    });
  }
}
