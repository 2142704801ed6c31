"""The browser client at `/`, driven in Debian's headless chromium by playwright.

Every test talks to a real voxgate (the shared `server` fixture) over
loopback. Numbers (TTFA, played frames, time to silence) are measured in
the page and read from `window.voxgate.stats`. Screenshots go to
$VOXGATE_SCREENSHOT_DIR when it is set (to look at, never to commit).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Route, sync_playwright

from tests.support.server import ServerProcess
from tests.support.wav import write_pcm16_wav

pytestmark = pytest.mark.browser

SENTENCE = "Hello there, this is the browser client speaking a typed sentence."
LONG_ANSWER = " ".join(
    f"This is sentence number {n} of a long answer, and it keeps the voice busy for a while."
    for n in range(1, 13)
)
READY = "document.body.dataset.ready === 'true' && window.voxgate.stats.connected"


def all_played(turns: int) -> str:
    """A page condition: `turns` turns were spoken, and every one was played to its end."""
    return (f"window.voxgate.stats.turns === {turns} && [...window.voxgate.agent.turns.values()]"
            ".every(t => t.state === 'played' || t.state === 'cancelled')")


def speech_like_wav(path: Path, seconds: float = 30.0, rate: int = 48000) -> Path:
    """A microphone stand-in: loud syllable-like bursts of a wobbling tone."""
    t = np.arange(round(seconds * rate)) / rate
    tone = np.sin(2 * np.pi * (180 + 60 * np.sin(2 * np.pi * 3 * t)) * t)
    envelope = (np.sin(2 * np.pi * 2.5 * t) > -0.3).astype(np.float64)
    write_pcm16_wav(path, (0.5 * tone * envelope * 32767).astype("<i2"), rate)
    return path


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    executable = shutil.which("chromium")
    assert executable is not None, "expected Debian's chromium on PATH (apt-get install chromium)"
    mic = speech_like_wav(tmp_path_factory.mktemp("mic") / "speech.wav")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=[
            "--no-sandbox", "--disable-background-networking", "--disable-component-update",
            "--autoplay-policy=no-user-gesture-required",
            "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={mic}",
        ])
        yield browser
        browser.close()


class Console:
    """Console errors and uncaught exceptions of one page."""

    def __init__(self, page: Page) -> None:
        self.errors: list[str] = []
        page.on("console", self._on_console)
        page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))

    def _on_console(self, msg: ConsoleMessage) -> None:
        if msg.type == "error":
            self.errors.append(msg.text)


def open_page(browser: Browser, server: ServerProcess, query: str = "",
              viewport: dict[str, int] | None = None) -> tuple[Page, Console]:
    context = browser.new_context(viewport=viewport or {"width": 1280, "height": 900})
    context.grant_permissions(["microphone"])
    page = context.new_page()
    console = Console(page)
    page.goto(f"{server.url}/{query}")
    page.wait_for_function(READY, timeout=20_000)
    return page, console


@pytest.fixture
def page(browser: Browser, server: ServerProcess) -> Iterator[tuple[Page, Console]]:
    page, console = open_page(browser, server)
    yield page, console
    page.context.close()


def stats(page: Page) -> dict[str, Any]:
    return page.evaluate("JSON.parse(JSON.stringify(window.voxgate.stats))")


def screenshot(page: Page, name: str) -> None:
    folder = os.environ.get("VOXGATE_SCREENSHOT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=True)


def speak_and_wait_for_playing(page: Page, played_ms: float = 800) -> None:
    page.check("input[name=mode][value=answer]")
    page.fill("#answer-text", LONG_ANSWER)
    page.fill("#answer-rate", "200")
    page.click("#answer-go")
    page.wait_for_function(
        f"window.voxgate.stats.state === 'playing' && window.voxgate.stats.played_ms > {played_ms}",
        timeout=30_000)


def assert_silent_after_interrupt(page: Page) -> dict[str, Any]:
    page.wait_for_function("window.voxgate.stats.last_cancel?.answered === true", timeout=10_000)
    before = stats(page)
    page.wait_for_timeout(400)
    after = stats(page)
    assert after["frames_played"] == before["frames_played"], \
        "audio kept playing after the interrupt"
    assert after["state"] == "idle"
    assert after["buffer_ms"] == 0
    cut = after["last_cancel"]
    # Measured in the page: from the interrupt to the worklet confirming silence.
    assert cut["silence_ms"] < 500
    return cut


def assert_heard_then_dropped(cut: dict[str, Any]) -> None:
    """Some words were heard, some dropped, and together they are the answer's start, in order.

    The answer may still have been streaming in when the cancel came, so the dropped text
    can end inside a word ("answe"): the last word need only begin the answer's word.
    """
    spoken, unspoken = cut["spoken_text"].split(), cut["unspoken_text"].split()
    assert spoken and unspoken
    words = spoken + unspoken
    expected = LONG_ANSWER.split()[: len(words)]
    assert words[:-1] == expected[:-1]
    assert expected[-1].startswith(words[-1])


def test_page_loads_without_console_errors_and_lists_the_servers_voices(
        page: tuple[Page, Console]) -> None:
    pg, console = page
    voices = pg.eval_on_selector_all("#voice option", "options => options.map(o => o.value)")
    assert "joe" in voices
    assert pg.input_value("#voice") == "joe"
    assert pg.get_attribute("#conn-status", "data-state") == "ready"
    assert stats(pg)["session_id"]
    screenshot(pg, "desktop-loaded")
    assert console.errors == []


@pytest.mark.parametrize("codec", ["opus", "pcm16"])
def test_a_typed_sentence_is_played_with_captions_and_word_highlights(
        browser: Browser, server: ServerProcess, codec: str) -> None:
    pg, console = open_page(browser, server, f"?codec={codec}")
    try:
        pg.fill("#type-text", SENTENCE)
        pg.press("#type-text", "Enter")
        pg.wait_for_function("window.voxgate.stats.ttfa_ms !== null", timeout=20_000)
        pg.wait_for_function("document.querySelector('#captions .w.now, #captions .w.said')",
                             timeout=10_000)
        pg.wait_for_function(all_played(1), timeout=30_000)
        s = stats(pg)
        assert s["codec"] == codec
        assert s["ttfa_ms"] > 0
        assert s["turns"] == 1
        assert pg.locator("#captions .w:not(.said)").count() == 0
        # The whole sentence was played: at least one sample per ms of words.
        assert s["frames_played"] / 48 > 0.8 * s["played_ms"] > 1000
        caption = pg.inner_text("#captions")
        assert "browser client speaking a typed sentence" in caption
        assert pg.inner_text("#st-ttfa") != "–"
        assert pg.input_value("#type-text") == ""
        screenshot(pg, f"desktop-spoken-{codec}")
        assert console.errors == []
    finally:
        pg.context.close()


def test_typing_streams_finished_words_so_a_sentence_speaks_before_enter(
        page: tuple[Page, Console]) -> None:
    pg, console = page
    pg.click("#type-text")
    pg.keyboard.type("Live typing reaches the voice. And this", delay=5)
    pg.wait_for_function("document.querySelector('#captions').innerText"
                         ".includes('Live typing reaches the voice.')", timeout=20_000)
    assert "And this" not in pg.inner_text("#captions")
    pg.keyboard.type(" ends it.")
    pg.keyboard.press("Enter")
    pg.wait_for_function("document.querySelector('#captions').innerText.includes('And this ends "
                         "it.')",
                         timeout=20_000)
    turns = pg.evaluate("[...window.voxgate.agent.turns.values()].map(t => t.text)")
    assert turns == ["Live typing reaches the voice. And this ends it."]
    assert console.errors == []


def test_text_no_voice_can_say_is_shown_in_place_as_skipped_and_never_heard(
        page: tuple[Page, Console]) -> None:
    pg, console = page
    pg.fill("#type-text", "Yesterday I met 王小明 at the station. Привет, как дела? See you soon.")
    pg.press("#type-text", "Enter")
    pg.wait_for_function(all_played(1), timeout=30_000)
    s = stats(pg)
    assert s["skipped_chars"] == len("王小明") + len("Привет, как дела?")
    assert [x["language"] for x in s["skipped"]] == ["zh", "und-Cyrl"]
    skipped = pg.eval_on_selector_all("#captions .skipped", "els => els.map(e => e.textContent)")
    assert skipped == ["王小明", "Привет, как дела?"]
    # the name sits where it was cut from, inside its sentence; the Cyrillic one between sentences
    caption = " ".join(pg.inner_text("#captions").split())
    assert "Yesterday I met 王小明 at the station. Привет, как дела? See you soon." in caption
    assert pg.locator("#captions .skipped.said").count() == 0  # finished: words said, skips not
    assert pg.locator("#captions .w.said").count() > 0
    screenshot(pg, "desktop-skipped")
    assert console.errors == []


def test_the_interrupt_button_silences_playback_and_shows_heard_and_dropped_text(
        page: tuple[Page, Console]) -> None:
    pg, console = page
    speak_and_wait_for_playing(pg)
    pg.click("#interrupt")
    cut = assert_silent_after_interrupt(pg)
    assert cut["reason"] == "button"
    assert cut["source"] == "server"
    assert_heard_then_dropped(cut)
    assert pg.is_visible("#cut")
    assert pg.inner_text("#cut-spoken") == cut["spoken_text"]
    assert pg.inner_text("#cut-unspoken") == cut["unspoken_text"]
    assert pg.locator("#captions .dropped").count() > 0
    assert pg.inner_text("#answer-go") == "Stream answer"
    screenshot(pg, "desktop-interrupted")
    assert console.errors == []


def test_an_interrupt_after_the_server_finished_the_answer_still_splits_heard_from_dropped(
        browser: Browser, server: ServerProcess) -> None:
    pg, console = open_page(browser, server, "?pacing=asap")
    try:
        speak_and_wait_for_playing(pg)
        # Under asap pacing the whole answer is sent long before it is heard.
        pg.wait_for_function("[...window.voxgate.agent.turns.values()][0].state === 'done'",
                             timeout=60_000)
        pg.click("#interrupt")
        cut = assert_silent_after_interrupt(pg)
        assert_heard_then_dropped(cut)
        assert pg.inner_text("#cut-unspoken") == cut["unspoken_text"]
        assert console.errors == []
    finally:
        pg.context.close()


def test_escape_interrupts_while_typing_and_the_next_turn_still_speaks(
        page: tuple[Page, Console]) -> None:
    pg, console = page
    speak_and_wait_for_playing(pg, played_ms=500)
    pg.focus("#answer-text")
    pg.keyboard.press("Escape")
    cut = assert_silent_after_interrupt(pg)
    assert cut["reason"] == "escape"
    assert cut["spoken_text"] != ""
    pg.check("input[name=mode][value=type]")
    pg.fill("#type-text", "And now a new turn.")
    pg.press("#type-text", "Enter")
    pg.wait_for_function(all_played(2), timeout=30_000)
    assert "And now a new turn." in pg.inner_text("#captions")
    assert console.errors == []


def test_microphone_speech_barges_in_only_above_the_threshold(page: tuple[Page, Console]) -> None:
    pg, console = page
    pg.fill("#mic-threshold", "-5")
    pg.check("#mic-on")
    pg.wait_for_function("Number(document.querySelector('#mic-level').value) > -70", timeout=10_000)
    speak_and_wait_for_playing(pg, played_ms=300)
    assert stats(pg)["cancels"] == 0
    pg.fill("#mic-threshold", "-70")
    cut = assert_silent_after_interrupt(pg)
    assert cut["reason"] == "microphone"
    pg.uncheck("#mic-on")
    assert console.errors == []


def test_llm_mode_speaks_a_streamed_chat_completion_and_keeps_only_heard_text_in_history(
        page: tuple[Page, Console], server: ServerProcess) -> None:
    pg, console = page
    requests: list[dict[str, Any]] = []

    def fake_llm(route: Route) -> None:
        body = json.loads(route.request.post_data or "{}")
        requests.append({"body": body, "auth": route.request.headers.get("authorization")})
        words = LONG_ANSWER.split(" ") if len(requests) == 1 else ["Okay,", "stopping", "here."]
        events = [{"choices": [{"delta": {"role": "assistant"}}]}]
        events += [{"choices": [{"delta": {"content": (" " if i else "") + w}}]}
                   for i, w in enumerate(words)]
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=sse)

    pg.route("**/fake-llm/v1/chat/completions", fake_llm)
    pg.check("input[name=mode][value=llm]")
    pg.fill("#llm-url", f"{server.url}/fake-llm/v1/")
    pg.fill("#llm-model", "tiny-test-model")
    pg.fill("#llm-key", "sk-local")
    pg.fill("#llm-input", "Tell me a long story.")
    pg.press("#llm-input", "Enter")
    pg.wait_for_function("window.voxgate.stats.state === 'playing' && "
                         "window.voxgate.stats.played_ms > 800", timeout=30_000)
    assert requests[0]["auth"] == "Bearer sk-local"
    assert requests[0]["body"]["model"] == "tiny-test-model"
    assert requests[0]["body"]["stream"] is True
    assert [m["role"] for m in requests[0]["body"]["messages"]] == ["system", "user"]
    pg.click("#interrupt")
    cut = assert_silent_after_interrupt(pg)
    assert_heard_then_dropped(cut)
    heard = cut["spoken_text"]

    pg.fill("#llm-input", "Stop, please.")
    pg.press("#llm-input", "Enter")
    pg.wait_for_function(all_played(2), timeout=30_000)
    messages = requests[1]["body"]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[2]["content"] == heard
    assert pg.locator("#llm-chat .msg.assistant").count() == 2
    assert "Okay, stopping here." in pg.inner_text("#captions")
    screenshot(pg, "desktop-llm")
    assert console.errors == []


def test_an_llm_error_is_shown_and_leaves_no_turn_open(page: tuple[Page, Console],
                                                       server: ServerProcess) -> None:
    pg, console = page
    pg.route("**/broken-llm/v1/chat/completions",
             lambda route: route.fulfill(status=500, body="model not loaded"))
    pg.check("input[name=mode][value=llm]")
    pg.fill("#llm-url", f"{server.url}/broken-llm/v1")
    pg.fill("#llm-input", "Hello?")
    pg.press("#llm-input", "Enter")
    pg.wait_for_selector("#notice:not([hidden])")
    assert "expected 200 from the LLM endpoint, got 500: model not loaded" in pg.inner_text(
        "#notice")
    states = pg.evaluate("[...window.voxgate.agent.turns.values()].map(t => t.state)")
    assert states == ["played"]  # opened, never sent, closed
    assert pg.inner_text("#llm-send") == "Send"
    assert pg.locator("#llm-chat .msg.assistant").count() == 0
    # The browser itself reports the failed request; nothing else may fail.
    assert [e for e in console.errors if "status of 500" not in e] == []


def test_without_webcodecs_the_page_plays_pcm16(browser: Browser, server: ServerProcess) -> None:
    context = browser.new_context()
    context.add_init_script("delete window.AudioDecoder; delete window.EncodedAudioChunk;")
    pg = context.new_page()
    console = Console(pg)
    try:
        pg.goto(server.url + "/")
        pg.wait_for_function(READY, timeout=20_000)
        pg.evaluate("window.voxgate.speak('No decoder here.')")
        pg.wait_for_function(all_played(1), timeout=30_000)
        s = stats(pg)
        assert s["codec"] == "pcm16"
        assert s["frames_played"] > 0
        assert console.errors == []
    finally:
        context.close()


def test_at_phone_width_the_controls_fit_and_work(browser: Browser, server: ServerProcess) -> None:
    pg, console = open_page(browser, server, viewport={"width": 375, "height": 812})
    try:
        assert pg.evaluate("document.documentElement.scrollWidth") <= 375
        for selector in ["#type-text", "#type-speak", "#interrupt", "#voice", "#mic-on",
                         "input[name=mode][value=llm]"]:
            box = pg.locator(selector).bounding_box()
            assert box is not None, selector
            assert box["x"] >= 0 and box["x"] + box["width"] <= 375, selector
        interrupt = pg.locator("#interrupt").bounding_box()
        assert interrupt is not None and interrupt["height"] >= 44
        pg.fill("#type-text", SENTENCE)
        pg.click("#type-speak")
        pg.wait_for_function("window.voxgate.stats.played_ms > 400", timeout=20_000)
        pg.click("#interrupt")
        assert_silent_after_interrupt(pg)
        assert pg.is_visible("#cut")
        screenshot(pg, "phone-interrupted")
        assert console.errors == []
    finally:
        pg.context.close()


def test_every_control_has_an_accessible_name_and_is_reachable_by_keyboard(
        page: tuple[Page, Console]) -> None:
    pg, _ = page
    unnamed = pg.evaluate("""() => [...document.querySelectorAll('input, select, textarea, button')]
        .filter(el => !el.closest('[hidden]'))
        .filter(el => !(el.labels && el.labels.length) && !el.getAttribute('aria-label')
                      && !(el.tagName === 'BUTTON' && el.textContent.trim()))
        .map(el => el.id || el.outerHTML)""")
    assert unnamed == []
    reached = set()
    for _ in range(20):
        pg.keyboard.press("Tab")
        reached.add(pg.evaluate("document.activeElement.id || document.activeElement.name"))
    assert {"type-text", "type-speak", "interrupt", "mic-on", "voice", "mode"} <= reached


MSGPACK_SAMPLES: list[Any] = [
    None, True, False, 0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**53 - 1,
    -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**53) + 1,
    0.5, -1.25e300, "", "a" * 31, "b" * 32, "é" * 200, "c" * 70000,
    list(range(15)), list(range(16)), list(range(70000)),
    {str(i): i for i in range(15)}, {str(i): i for i in range(16)},
    {"type": "audio", "context_id": "c-1", "seq": 3, "pts_ms": 60.0, "duration_ms": 20.0,
     "codec": "opus", "packets": [[1, 2, 3], [4] * 300]},
]


def test_the_msgpack_decoder_reads_what_python_msgpack_writes(page: tuple[Page, Console]) -> None:
    pg, _ = page
    cases = []
    for value in MSGPACK_SAMPLES:
        cases.append({"bytes": list(msgpack.packb(value)), "expected": value, "bin": False})
    for blob in [b"", b"\x00\xff" * 10, bytes(range(256)) * 300]:
        cases.append({"bytes": list(msgpack.packb(blob, use_bin_type=True)),
                      "expected": list(blob), "bin": True})
    single = msgpack.packb(1.5, use_single_float=True)
    cases.append({"bytes": list(single), "expected": 1.5, "bin": False})
    decoded = pg.evaluate("""async (cases) => {
        const { decode } = await import('/msgpack.js');
        return cases.map(c => {
            const v = decode(new Uint8Array(c.bytes));
            return c.bin ? Array.from(v) : v;
        });
    }""", cases)
    for case, got in zip(cases, decoded, strict=True):
        assert got == case["expected"]
    error = pg.evaluate("""async () => {
        const { decode } = await import('/msgpack.js');
        try { decode(new Uint8Array([0x92, 0x01])); return null; } catch (e) { return e.message; }
    }""")
    assert error is not None and "expected" in error


WORKLET_SCENARIO = """async () => {
    // Offline rendering drives the worklet on a known timeline: suspend at a
    // time, post messages, give the audio thread a moment, resume. (Chromium
    // delivers messages to an offline worklet only while it is suspended.)
    const rate = 48000;
    const ac = new OfflineAudioContext(1, rate * 2, rate);
    await ac.audioWorklet.addModule('/player-worklet.js');
    const node = new AudioWorkletNode(ac, 'voxgate-player',
        { numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [1] });
    node.connect(ac.destination);
    const events = [];
    node.port.onmessage = (e) => { if (e.data.type !== 'progress') events.push(e.data); };
    const tone = (ms) => new Float32Array(rate * ms / 1000).fill(0.25);
    const settle = () => new Promise((r) => setTimeout(r, 100));
    const at = (t, fn) => ac.suspend(t).then(async () => { fn(); await settle(); ac.resume(); });
    at(0, () => {
        node.port.postMessage({ type: 'config', jitter_ms: 40 });
        node.port.postMessage({ type: 'push', ctx: 'a', pts_ms: 0, samples: tone(200) });
    });
    // 'a' runs dry at ~0.24 s; more of it arrives at 0.4 s: a real gap.
    at(0.4, () => node.port.postMessage({ type: 'push', ctx: 'a', pts_ms: 200,
                                          samples: tone(200) }));
    // Its end arrives after it ran dry again: not a gap.
    at(0.8, () => node.port.postMessage({ type: 'end', ctx: 'a' }));
    at(1.0, () => {
        node.port.postMessage({ type: 'push', ctx: 'b', pts_ms: 0, samples: tone(500) });
        node.port.postMessage({ type: 'end', ctx: 'b' });
    });
    at(1.2, () => node.port.postMessage({ type: 'flush', id: 7 }));
    const out = (await ac.startRendering()).getChannelData(0);
    const loudMs = out.reduce((n, x) => n + (x !== 0), 0) * 1000 / rate;
    return { events, loudMs };
}"""


def test_the_worklet_counts_gaps_as_underruns_but_not_the_end_of_a_turn(
        page: tuple[Page, Console]) -> None:
    pg, console = page
    result = pg.evaluate(WORKLET_SCENARIO)
    events = [(e["type"], e.get("ctx")) for e in result["events"]]
    assert events == [("started", "a"), ("underrun", "a"), ("finished", "a"),
                      ("started", "b"), ("flushed", "b")]
    underrun = result["events"][1]
    assert underrun["played_ms"] == pytest.approx(200, abs=1)
    assert underrun["gap_ms"] > 100
    assert result["events"][2]["played_ms"] == pytest.approx(400, abs=1)
    # 'b' played from ~1.0 s (after its end arrived, no jitter wait) until the flush at 1.2 s.
    flushed = result["events"][4]
    assert flushed["played_ms"] == pytest.approx(200, abs=30)
    assert result["loudMs"] == pytest.approx(400 + flushed["played_ms"], abs=3)
    assert console.errors == []
