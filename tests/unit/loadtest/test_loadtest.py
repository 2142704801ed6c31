"""loadtest: the metric math with a fake clock, and short runs against a real voxgate."""

from __future__ import annotations

import asyncio
import io
import json
import math
import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadtest.__main__ import main
from loadtest.anchor import PiperHttpSession, wav_duration_ms
from loadtest.client import TurnState
from loadtest.config import LoadConfig, Protocol, check_target
from loadtest.corpus import Answer, first_segment_end, first_segment_token, load_corpus, tokenize
from loadtest.make_corpus import generate
from loadtest.metrics import (
    Outcome,
    RunStats,
    TurnRecord,
    passes,
    percentile,
    summarize,
)
from loadtest.runner import sweep_levels
from tests.support.wav import write_pcm16_wav
from voxgate_client import Audio, PlaybackClock, Segment, TextSkipped
from voxgate_client.session import stream_url

# --- percentiles -------------------------------------------------------------


def test_percentile_matches_numpy_linear_interpolation() -> None:
    rng = random.Random(3)
    for size in (1, 2, 7, 100):
        values = [rng.uniform(0, 1000) for _ in range(size)]
        for q in (0, 50, 90, 95, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_nothing_is_nan_and_bad_q_is_refused() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="within 0-100"):
        percentile([1.0], 101)


# --- the playback clock (fake time) -------------------------------------------


def test_audio_arriving_ahead_of_playback_has_no_gap() -> None:
    clock = PlaybackClock()
    for i in range(50):  # 20 ms frames every 10 ms: the buffer grows
        assert clock.on_frame(1.0 + i * 0.010, 20.0) == 0.0
    assert (clock.num_gaps, clock.gap_ms, clock.audio_ms) == (0, 0.0, 1000.0)
    assert clock.played_ms(1.25) == pytest.approx(250.0)


def test_a_late_frame_is_one_gap_of_its_lateness_and_playback_resumes_from_it() -> None:
    clock = PlaybackClock()
    clock.on_frame(10.0, 100.0)  # plays 10.0-10.1
    clock.on_frame(10.05, 100.0)  # plays 10.1-10.2
    assert clock.played_ms(10.3) == pytest.approx(200.0)  # stalled: nothing more arrived
    assert clock.on_frame(10.45, 100.0) == pytest.approx(250.0)
    assert clock.on_frame(10.5, 100.0) == 0.0  # queued behind the late one
    assert clock.num_gaps == 1
    assert clock.gaps == [pytest.approx(250.0)]
    assert clock.gaps_at == [200.0]  # after the first two frames' audio
    assert clock.run_out_at == pytest.approx(10.65)
    assert clock.time_at_played(250.0) == pytest.approx(10.5)
    assert clock.time_at_played(401.0) is None


def test_a_playout_delay_absorbs_a_frame_late_by_less_than_the_delay() -> None:
    clock = PlaybackClock(playout_delay_ms=100.0)
    clock.on_frame(0.0, 20.0)  # plays 0.1-0.12
    clock.on_frame(0.11, 20.0)
    assert clock.num_gaps == 0
    assert clock.played_ms(0.05) == 0.0


def test_turn_state_flags_seq_gaps_and_audio_after_cancelled() -> None:
    record = TurnRecord(0, "c", num_tokens=3, num_chars=10)
    state = TurnState(record, 0.0)
    state.first_token_at, state.segment_complete_at = 1.0, 1.2
    def audio(at: float, seq: int) -> Audio:
        return Audio("c", seq, 20.0 * seq, 20.0, "opus", [b"x"], None, at)

    state.on_audio(audio(1.5, 0))
    state.on_audio(audio(1.6, 2))
    state.cancel_sent_at = 1.7
    state.on_audio(audio(1.75, 3))  # in flight: heard by nobody
    state.cancelled_at = 1.8
    state.on_audio(audio(1.9, 4))
    state.finalize()
    assert record.violations == ["seq_gap", "audio_after_cancelled"]
    assert record.ttfa_segment_ms == pytest.approx(300.0)
    assert record.ttfa_first_token_ms == pytest.approx(500.0)
    assert record.cancel_latency_ms == pytest.approx(100.0)
    assert record.cancel_to_last_frame_ms == pytest.approx(50.0)
    assert (record.num_frames, record.audio_ms) == (3, 60.0)


# --- corpus and the TTFA mark --------------------------------------------------


def test_bundled_corpus_has_hundreds_of_mixed_answers_that_tokenize_losslessly() -> None:
    corpus = load_corpus()
    assert len(corpus) >= 200
    assert any(a.lang == "zh" for a in corpus)
    assert any("\n1. " in a.text for a in corpus)
    assert len({len(a.text) // 200 for a in corpus}) >= 4  # short to long
    for answer in corpus:
        tokens = tokenize(answer.text)
        assert "".join(tokens) == answer.text
        assert max(len(t) for t in tokens) <= 8


def test_corpus_generator_is_deterministic_for_a_seed() -> None:
    assert generate(40, seed=5) == generate(40, seed=5)
    assert generate(40, seed=5) != generate(40, seed=6)


@pytest.mark.parametrize(("text", "end"), [
    ("Sure! Here", 5),
    ("Pi is 3.14 roughly. Next", 19),
    ("Steps:\n1. Open it. Then", 18),
    ("Use e.g. salt. Then", 14),
    ("好的。我们", 3),
    ("Sure!", None),  # not confirmed yet: the flush completes it
])
def test_first_segment_ends_where_the_input_confirms_a_sentence(text: str, end: int | None) -> None:
    assert first_segment_end(text) == end


def test_first_segment_is_completed_by_the_token_after_a_latin_full_stop() -> None:
    assert first_segment_token(["Sure", "!", " Here", " is"]) == 2
    assert first_segment_token(["好的", "。", "我们"]) == 1
    assert first_segment_token(["Hello", " there"]) is None


# --- summaries ----------------------------------------------------------------


def _record(outcome: Outcome, ttfa: float | None, gaps: tuple[float, ...] = ()) -> TurnRecord:
    r = TurnRecord(0, "c", 10, 40, outcome=outcome, ttfa_segment_ms=ttfa, audio_ms=1000.0,
                   num_frames=50)
    r.gaps_ms, r.num_gaps, r.gap_ms = list(gaps), len(gaps), sum(gaps)
    return r


def test_summary_counts_add_up_and_a_level_holds_only_without_gaps_or_failures() -> None:
    turns = [_record(Outcome.COMPLETED, 100.0), _record(Outcome.CANCELLED, 200.0),
             _record(Outcome.FAILED, None), _record(Outcome.ABORTED, 150.0, (40.0, 60.0))]
    turns[2].error_codes.append("busy")
    s = summarize(turns, RunStats(wall_s=10.0, client_cpu_s=0.5, num_sessions=2, num_cores=2))
    t = s["turns"]
    assert t["started"] == 4 == sum(t[o.value] for o in Outcome)
    assert s["ttfa_segment_ms"]["n"] == 3
    # made by hand, without text leads: both gaps are the server's
    assert s["gaps"] == {"count": 2, "text_late": 0, "server": 2, "server_at_segment_start": 0,
                         "server_inside_segment": 2, "total_ms": 100.0, "turns_with_gaps": 1,
                         "gap_ms": s["gaps"]["gap_ms"]}
    assert s["errors"] == {"busy": 1}
    assert s["audio"]["seconds"] == 4.0 and s["audio"]["frames"] == 200
    assert s["run"]["client_cpu_share_of_machine"] == pytest.approx(0.025)
    assert not passes(s, ttfa_p95_target_ms=1000.0)
    fine = summarize(turns[:2], RunStats(10.0, 0.5, 2))
    assert passes(fine, 1000.0) and not passes(fine, 150.0)
    silent = _record(Outcome.ABORTED, None)
    silent.num_frames = 0
    waiting = summarize([*turns[:2], silent], RunStats(10.0, 0.5, 2))
    assert waiting["turns"]["aborted_without_audio"] == 1
    assert not passes(waiting, 1000.0)  # it waited through the whole drain period


def test_segments_and_skipped_text_are_counted_by_script_and_language() -> None:
    record = TurnRecord(0, "c", num_tokens=3, num_chars=40)
    state = TurnState(record, 0.0)
    state.on_segment(Segment("c", 0, "My friend said hi.", 0.0, None, None, 1.0))
    state.on_skipped(TextSkipped("c", 0, 9, "王小明", "language_unsupported", "zh", 1.0))
    state.on_skipped(TextSkipped("c", 1, None, "Привет", "language_unsupported", "und-Cyrl",
                                 1.1))
    assert record.spoken_letters == {"Latn": 14}
    assert record.skipped_chars == {"zh": 3, "und-Cyrl": 6}
    text = summarize([record, record], RunStats(10.0, 0.5, 1))["text"]
    assert text == {"spoken_letters": 28, "spoken_letters_by_script": {"Latn": 28},
                    "skipped_chars": 18, "skipped_chars_by_language": {"und-Cyrl": 12, "zh": 6}}


def test_sweep_levels_double_up_to_the_maximum() -> None:
    assert sweep_levels(20) == [1, 2, 4, 8, 16, 20]
    assert sweep_levels(8) == [1, 2, 4, 8]


# --- the loopback guard --------------------------------------------------------


def test_non_loopback_targets_are_refused_unless_allowed() -> None:
    check_target("http://127.0.0.1:8000", allow_remote=False)
    check_target("ws://[::1]:8000/v1/stream", allow_remote=False)
    check_target("http://localhost:8000", allow_remote=False)
    with pytest.raises(ValueError, match="refusing non-loopback"):
        check_target("http://10.1.2.3:8000", allow_remote=False)
    check_target("http://10.1.2.3:8000", allow_remote=True)
    assert main(["run", "--url", "http://192.0.2.7:8000", "--duration", "1", "--quiet"]) == 2


def test_the_stream_url_comes_from_an_http_base_with_the_session_options() -> None:
    config = LoadConfig(url="http://127.0.0.1:8000", query={"codec": "pcm16"})
    query = {"encoding": config.encoding, **config.query}
    assert stream_url(config.url, query) == (
        "ws://127.0.0.1:8000/v1/stream?encoding=msgpack&codec=pcm16")
    assert stream_url("wss://localhost:9/custom", query).startswith("wss://localhost:9/custom?")


# --- the anchor client, against a stand-in for piper's Flask server --------------


def _wav(seconds: float, rate: int = 22050) -> bytes:
    buf = io.BytesIO()
    write_pcm16_wav(buf, np.zeros(int(rate * seconds), dtype="<i2"), rate)
    return buf.getvalue()


@pytest.fixture
def fake_piper() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            assert self.path == "/synthesize"
            text = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["text"]
            body = _wav(len(text) / 1000.0)  # 1 ms of audio per character
            self.send_response(200)
            self.send_header("Content-Type", "audio/wav")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_wav_duration_reads_the_data_chunk() -> None:
    assert wav_duration_ms(_wav(1.5)) == pytest.approx(1500.0)
    with pytest.raises(ValueError, match="RIFF"):
        wav_duration_ms(b"nope")


def test_anchor_session_times_first_byte_and_reads_audio_length(fake_piper: str) -> None:
    answer = Answer("a", "en", "Short answer. " * 20)
    config = LoadConfig(url=fake_piper, protocol=Protocol.PIPER_HTTP, token_rate=2000.0,
                        think_s=0.0)
    records: list[TurnRecord] = []
    session = PiperHttpSession(0, config, [answer], records, turn_budget=[2])

    async def play() -> None:
        loop = asyncio.get_running_loop()
        await session.run(loop.time() + 30.0, max_turns=2, first_think=False)

    asyncio.run(play())
    assert [r.outcome for r in records] == [Outcome.COMPLETED] * 2
    for r in records:
        assert r.audio_ms == pytest.approx(len(answer.text))
        assert r.ttfa_segment_ms is not None and r.ttfa_first_token_ms is not None
        assert 0 < r.ttfa_segment_ms < r.ttfa_first_token_ms


# --- end to end against a real voxgate ---------------------------------------------


@pytest.fixture
def short_corpus(tmp_path: Path) -> Path:
    """Short answers, so that turns finish within a few seconds."""
    path = tmp_path / "short.jsonl"
    lines = [{"id": f"s{i}", "lang": "en", "text": t} for i, t in enumerate([
        "Sure! It takes about 20 minutes. Let me know if you need more.",
        "Of course. Preheat the oven to 220 degrees. Then bake for 12 minutes.",
        "Good question. The answer is 42, more or less.",
        "好的。我们明天见。",
    ])]
    path.write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\n")
    return path


def _check_consistent(summary: dict[str, Any], turns: list[dict[str, Any]]) -> None:
    t = summary["turns"]
    assert t["started"] == len(turns) > 0
    assert t["started"] == sum(t[o.value] for o in Outcome)
    assert t["completed"] + t["cancelled"] > 0
    for key in ("ttfa_segment_ms", "ttfa_first_token_ms"):
        d = summary[key]
        assert d["n"] > 0
        assert d["min"] <= d["p50"] <= d["p90"] <= d["p95"] <= d["p99"] <= d["max"]
    assert summary["audio"]["frames"] == sum(x["num_frames"] for x in turns)
    assert summary["audio"]["seconds"] == pytest.approx(sum(x["audio_ms"] for x in turns) / 1000)
    for x in turns:
        if x["outcome"] == "completed" or x["is_cancelled_after_done"]:
            # what we summed is what the server says it sent
            assert x["audio_ms"] == pytest.approx(x["server_audio_ms"], abs=1.0)
            if x["num_frames"]:
                assert x["ttfa_first_token_ms"] > 0
            else:  # a Chinese answer: joe says none of it (docs/voices.md, "Languages")
                assert x["skipped_chars"] and not x["spoken_letters"]
    assert summary["gaps"]["count"] == sum(x["num_gaps"] for x in turns)
    assert summary["violations"] == {}
    assert summary["run"]["client_cpu_s"] > 0


def test_a_fixed_run_against_voxgate_reports_consistent_numbers(
        server: Any, short_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    code = main(["run", "--url", server.url, "--sessions", "2", "--duration", "4",
                 "--drain", "20", "--think", "0.3", "--token-rate", "100",
                 "--barge-in-rate", "0.5", "--corpus", str(short_corpus), "--seed", "2",
                 "--json", str(out), "--turns", "--quiet"])
    assert code == 0
    result = json.loads(out.read_text())["targets"]["voxgate"]["result"]
    _check_consistent(result["summary"], result["turns"])


def test_a_listener_barging_in_mid_answer_gets_cancelled_and_its_latency_measured(
        server: Any, tmp_path: Path) -> None:
    corpus = tmp_path / "long.jsonl"
    long_answer = max(load_corpus(), key=lambda a: len(a.text))
    corpus.write_text(json.dumps({"id": "long", "lang": "en", "text": long_answer.text}) + "\n")
    out = tmp_path / "barge.json"
    # 20 tokens/s: the text streams for several seconds, so the cut comes mid-generation
    code = main(["run", "--url", server.url, "--sessions", "1", "--duration", "30",
                 "--max-turns", "1", "--drain", "30", "--think", "0", "--token-rate", "20",
                 "--barge-in-rate", "1", "--barge-in-at", "0.03-0.06", "--corpus", str(corpus),
                 "--json", str(out), "--turns", "--quiet"])
    assert code == 0
    result = json.loads(out.read_text())["targets"]["voxgate"]["result"]
    _check_consistent(result["summary"], result["turns"])
    (turn,) = result["turns"]
    assert turn["outcome"] == "cancelled" and not turn["is_cancelled_after_done"]
    assert 0 < turn["played_ms_at_cancel"] <= turn["audio_ms"]
    assert turn["cancel_latency_ms"] >= 0 and turn["cancel_to_last_frame_ms"] >= 0
    assert result["summary"]["cancel_latency_ms"]["n"] == 1


def test_open_loop_arrivals_each_play_their_turns(
        server: Any, short_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "rate.json"
    code = main(["rate", "--url", server.url, "--rate", "2", "--duration", "2", "--drain", "20",
                 "--turns-per-arrival", "1", "--corpus", str(short_corpus), "--seed", "4",
                 "--json", str(out), "--turns", "--quiet"])
    assert code == 0
    result = json.loads(out.read_text())["targets"]["voxgate"]["result"]
    _check_consistent(result["summary"], result["turns"])
    assert result["sessions"] == len(result["turns"])  # one turn per arrival


def test_a_sweep_finds_capacity_and_draws_its_plots(
        server: Any, short_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    # --all-levels: a gap on a busy box ends a sweep early, and both levels are checked below
    code = main(["sweep", "--url", server.url, "--levels", "1,2", "--all-levels", "--duration", "3",
                 "--drain", "20", "--think", "0.3", "--token-rate", "100",
                 "--ttfa-target-ms", "60000", "--corpus", str(short_corpus),
                 "--json", str(out), "--turns", "--plot-dir", str(tmp_path / "img"), "--quiet"])
    assert code == 0
    report = json.loads(out.read_text())["targets"]["voxgate"]
    assert [level["sessions"] for level in report["levels"]] == [1, 2]
    for level in report["levels"]:
        _check_consistent(level["summary"], level["turns"])
    held = 0
    for level in report["levels"]:  # capacity: the last level of the unbroken run of passes
        if not level["summary"]["passes"]:
            break
        held = level["sessions"]
    assert report["capacity"] == held
    for name in ("loadtest_ttfa.png", "loadtest_capacity.png"):
        assert (tmp_path / "img" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_anchor_runs_beside_voxgate_against_pipers_own_http_server(
        server: Any, short_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "anchor.json"
    code = main(["run", "--url", server.url, "--anchor-url", "auto", "--sessions", "1",
                 "--duration", "3", "--max-turns", "2", "--drain", "30", "--think", "0.2",
                 "--token-rate", "100", "--corpus", str(short_corpus),
                 "--json", str(out), "--turns", "--quiet"])
    assert code == 0
    targets = json.loads(out.read_text())["targets"]
    assert set(targets) == {"voxgate", "piper-http"}
    anchor = targets["piper-http"]["result"]
    _check_consistent(anchor["summary"], anchor["turns"])
    assert anchor["summary"]["gaps"]["count"] == 0
    for turn in anchor["turns"]:  # a whole WAV: one "frame" holding all of the audio
        assert turn["num_frames"] == 1 and turn["audio_ms"] > 500
        assert turn["ttfa_first_token_ms"] > turn["ttfa_segment_ms"] > 0
