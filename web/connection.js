// The page's end of /v1/stream (docs/protocol.md): JSON text frames out, JSON
// events and msgpack binary frames (audio, or events under `encoding:
// msgpack`) in.

import { decode } from "./msgpack.js";

export function streamUrl(base, params) {
  const url = new URL("/v1/stream", base);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  for (const [key, value] of Object.entries(params)) {
    if (value !== undefined && value !== null && value !== "") url.searchParams.set(key, value);
  }
  return url.href;
}

export class Connection {
  // onMessage(msg) gets every server message as an object with a `type`;
  // onState(state, detail) gets "connecting", "ready", "closed".
  constructor({ url, onMessage, onState }) {
    this.url = url;
    this.onMessage = onMessage;
    this.onState = onState;
    this.ws = null;
    this.ready = null; // the session.ready message once it came
    this.bytesIn = 0;
  }

  open() {
    this.onState("connecting", this.url);
    const ws = new WebSocket(this.url);
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    return new Promise((resolve, reject) => {
      let settled = false;
      ws.onmessage = (event) => {
        const msg = this.parse(event.data);
        if (msg === null) return;
        if (msg.type === "session.ready" && !settled) {
          settled = true;
          this.ready = msg;
          this.onState("ready", msg);
          resolve(msg);
        }
        this.onMessage(msg);
      };
      ws.onclose = (event) => {
        if (this.ws === ws) this.ws = null;
        this.onState("closed", { code: event.code, reason: event.reason });
        if (!settled) {
          settled = true;
          reject(new Error(`expected session.ready, got a close (code ${event.code})`));
        }
      };
      ws.onerror = () => {}; // the close that follows carries the news
    });
  }

  parse(data) {
    try {
      if (typeof data === "string") {
        this.bytesIn += data.length;
        return JSON.parse(data);
      }
      this.bytesIn += data.byteLength;
      const msg = decode(data);
      if (msg === null || typeof msg !== "object" || typeof msg.type !== "string") {
        throw new Error("expected a map with a `type`");
      }
      return msg;
    } catch (err) {
      console.warn("voxgate: dropped an unreadable frame:", err.message);
      return null;
    }
  }

  get isOpen() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  }

  send(msg) {
    if (!this.isOpen) return false;
    this.ws.send(JSON.stringify(msg));
    return true;
  }

  close() {
    if (this.ws !== null) {
      const ws = this.ws;
      this.ws = null;
      ws.close(1000);
    }
  }
}
