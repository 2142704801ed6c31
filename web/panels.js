// The three text sources of the page: Type, Stream an answer, LLM.
// `setupPanels` wires their forms to the agent and returns the hooks that
// barge-in needs: stop the running source and forget the half-typed turn.

import { replayAnswer, streamChat } from "./sources.js";

const $ = (id) => document.getElementById(id);
const LLM_SETTINGS_KEY = "voxgate.llm";

// getAgent() returns the Agent (created once the page knows its codec);
// interrupt(reason) is the page's barge-in.
export function setupPanels({ getAgent, notice, interrupt }) {
  let source = null; // {abort: AbortController, kind} of a running answer or LLM stream

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
      typeTurn = getAgent().openTurn("Typed");
    }
    if (delta !== "") getAgent().sendText(typeTurn, delta, flush);
    else getAgent().flush(typeTurn);
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
      if (typeTurn) getAgent().flush(typeTurn);
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
      const turn = getAgent().openTurn("Answer");
      const rate = () => Number($("answer-rate").value);
      for await (const token of replayAnswer(text, rate, signal)) getAgent().sendText(turn, token);
      if (!signal.aborted) getAgent().flush(turn);
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
      const turn = getAgent().openTurn("LLM");
      const bubble = chatBubble("assistant", "");
      const entry = { role: "assistant", content: "" };
      // After a barge-in the history keeps only what the listener heard.
      turn.onCut = (spoken) => {
        bubble.classList.add("is-cut");
        bubble.dataset.heard = spoken;
        entry.content = spoken;
        const at = history.indexOf(entry);
        if (spoken.trim() === "" && at >= 0) history.splice(at, 1);
        else if (spoken.trim() !== "" && at < 0) history.push(entry);
      };
      history.push(entry);
      const messages = settings.system ? [{ role: "system", content: settings.system }] : [];
      messages.push(...history.slice(0, -1));
      let received = "";
      try {
        for await (const delta of streamChat({ ...settings, messages, signal })) {
          getAgent().sendText(turn, delta);
          received += delta;
          if (!signal.aborted) entry.content = received;
          bubble.textContent = received;
        }
      } finally {
        // Speak what came, even when the stream broke off (not after a barge-in).
        if (!signal.aborted) getAgent().flush(turn);
        if (received === "") {
          bubble.remove();
          if (history.at(-1) === entry) history.pop();
        }
      }
    });
  });

  $("llm-reset").addEventListener("click", () => {
    history.length = 0;
    $("llm-chat").replaceChildren();
  });

  restoreLlmSettings();
  return {
    stop: stopSource,
    forgetTyping() {
      if (typeTurn !== null) {
        typeText.value = "";
        typeReset();
      }
    },
  };
}
