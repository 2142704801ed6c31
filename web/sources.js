// Where the page's text comes from, besides the keyboard: a replayed answer
// (LLM-style tokens at a set rate) and a live chat completion from any
// OpenAI-compatible endpoint. Both are async generators of text deltas that
// stop when their AbortSignal fires.

// LLM-like tokens: leading whitespace plus up to five characters. Joined,
// the tokens give back the text exactly.
export function tokenize(text) {
  return text.match(/\s*\S{1,5}|\s+$/g) ?? [];
}

function sleep(ms, signal) {
  return new Promise((resolve) => {
    if (signal.aborted) return resolve();
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
  });
}

// Yields the tokens of `text` at `rate()` tokens per second; rate is read
// before each token so a slider moved mid-answer takes effect at once.
export async function* replayAnswer(text, rate, signal) {
  let due = performance.now();
  for (const token of tokenize(text)) {
    if (signal.aborted) return;
    const wait = due - performance.now();
    if (wait > 0) await sleep(wait, signal);
    if (signal.aborted) return;
    yield token;
    due = Math.max(due, performance.now() - 50) + 1000 / Math.max(0.1, rate());
  }
}

export function chatCompletionsUrl(endpoint) {
  const trimmed = endpoint.trim().replace(/\/+$/, "");
  if (trimmed === "") throw new Error("expected an endpoint URL such as http://127.0.0.1:8080/v1, got nothing");
  const url = new URL(trimmed, location.href); // throws on garbage
  if (url.pathname.endsWith("/chat/completions")) return url.href;
  url.pathname = url.pathname.replace(/\/+$/, "") + "/chat/completions";
  return url.href;
}

// Streams a chat completion (server-sent events) and yields content deltas.
export async function* streamChat({ endpoint, model, apiKey, messages, signal }) {
  const headers = { "Content-Type": "application/json", Accept: "text/event-stream" };
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  const url = chatCompletionsUrl(endpoint);
  let response;
  try {
    response = await fetch(url, {
      method: "POST",
      headers,
      body: JSON.stringify({ model, messages, stream: true }),
      signal,
    });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new Error(`could not reach ${url} (${err.message}): is the LLM server running, ` +
      "and does it allow cross-origin requests from this page?");
  }
  if (!response.ok) {
    const body = (await response.text()).slice(0, 300);
    throw new Error(`expected 200 from the LLM endpoint, got ${response.status}: ${body}`);
  }
  const type = response.headers.get("content-type") ?? "";
  if (type.includes("application/json")) {
    // A server that ignored `stream: true`: one whole answer.
    const body = await response.json();
    const content = body?.choices?.[0]?.message?.content;
    if (typeof content === "string" && content) yield content;
    return;
  }
  const reader = response.body.getReader();
  const utf8 = new TextDecoder();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += utf8.decode(value, { stream: true });
    const lines = pending.split(/\r?\n/);
    pending = lines.pop();
    for (const line of lines) {
      const delta = parseSseLine(line);
      if (delta === DONE) return;
      if (delta) yield delta;
    }
  }
  const delta = parseSseLine(pending);
  if (delta && delta !== DONE) yield delta;
}

const DONE = Symbol("done");

function parseSseLine(line) {
  if (!line.startsWith("data:")) return null;
  const data = line.slice(5).trim();
  if (data === "[DONE]") return DONE;
  if (data === "") return null;
  let event;
  try {
    event = JSON.parse(data);
  } catch {
    return null;
  }
  if (event.error) throw new Error(`LLM error: ${event.error.message ?? JSON.stringify(event.error)}`);
  const content = event?.choices?.[0]?.delta?.content;
  return typeof content === "string" ? content : null;
}
