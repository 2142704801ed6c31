"""Routing by language in the sans-I/O session: skipped text, mapped voices, barge-in.

docs/voices.md, "Languages"; docs/protocol.md, `text.skipped`. The engine is
played by hand: every Submit is answered with a chunk of audio and word
timings, as piper gives them.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.types import AudioChunk, SynthesisRequest, WordTiming
from gateway.stream.actions import Observe, Send, Submit
from gateway.stream.options import SessionOptions
from gateway.stream.session import Session
from gateway.text.cleanup import clean_for_speech
from gateway.text.routing import Languages
from gateway.voices.catalog import VoiceCatalog
from tests.unit.gateway.text.test_language import mixed_text

RATE = 22050
LANGUAGES = {"joe": ("en",), "mei": ("zh",), "ivan": ("ru",)}


def make_session(voice_for: dict[str, str] | None = None, catalog: VoiceCatalog | None = None,
                 admitted: list[str] | None = None) -> Session:
    catalog = catalog or VoiceCatalog(LANGUAGES)
    session = Session("s1", catalog=catalog, sample_rate=RATE,
                      options=SessionOptions(codec="pcm16", sample_rate=24000),
                      admit=(admitted.append if admitted is not None else lambda key: None),
                      languages=Languages(LANGUAGES.get, voice_for))
    session.start(0.0)
    return session


def text(session: Session, context_id: str, value: str, flush: bool = True) -> list[Any]:
    return session.receive_frame(json.dumps({"type": "text", "context_id": context_id,
                                             "text": value, "flush": flush}), 0.0)


def events(actions: list[Any], *kinds: str) -> list[dict[str, Any]]:
    """The non-audio events sent, as their wire objects, in order."""
    return [a.message.to_wire() for a in actions if isinstance(a, Send)
            and a.message.type != "audio" and (not kinds or a.message.type in kinds)]


def submits(actions: list[Any]) -> list[SynthesisRequest]:
    return [a.request for a in actions if isinstance(a, Submit)]


def answer(session: Session, request: SynthesisRequest, ms_per_word: float = 100.0) -> list[Any]:
    """The engine's audio for `request`: one chunk, a word timing per word, as piper."""
    words = request.text.split()
    timings = [WordTiming(w, i * ms_per_word, (i + 1) * ms_per_word) for i, w in enumerate(words)]
    pcm = np.full(int(RATE * len(words) * ms_per_word / 1000), 0.1, dtype=np.float32)
    return session.receive_audio(AudioChunk(request.request_id, pcm, RATE, is_last=True,
                                            words=timings), 0.1)


def speak_all(session: Session, actions: list[Any]) -> list[Any]:
    """Answer every request as it is submitted, until none is left; all actions, in order."""
    out = list(actions)
    pending = submits(actions)
    while pending:
        more = answer(session, pending.pop(0))
        out += more
        pending += submits(more)
    return out


def test_a_chinese_sentence_with_no_voice_for_it_is_skipped_with_a_notice_in_its_place() -> None:
    session = make_session()
    actions = text(session, "c", "Hello there, my friend. 今天天气很好。 See you tomorrow.")
    requests = submits(actions)
    assert [(r.text, r.voice) for r in requests] == [("Hello there, my friend.", "joe"),
                                                     ("See you tomorrow.", "joe")]
    out = speak_all(session, actions)
    assert [(e["type"], e.get("segment_id")) for e in events(out)] == [
        ("segment", 0), ("text.skipped", 1), ("segment", 2), ("context.done", None)]
    skipped = events(out, "text.skipped")[0]
    assert skipped == {"type": "text.skipped", "context_id": "c", "segment_id": 1, "offset": None,
                       "text": "今天天气很好。", "reason": "language_unsupported", "language": "zh"}
    assert events(out, "context.done")[0]["segments"] == 2
    assert Observe("skipped:zh", 7) in out


def test_a_chinese_sentence_goes_to_the_voice_mapped_for_chinese_in_order() -> None:
    session = make_session(voice_for={"zh": "mei"})
    actions = text(session, "c", "Hello there, my friend. 今天天气很好。 See you tomorrow.")
    requests = submits(actions)
    assert [(r.voice, r.language) for r in requests] == [("joe", None), ("mei", None),
                                                         ("joe", None)]
    out = speak_all(session, actions)
    segments = events(out, "segment")
    assert [s["text"] for s in segments] == ["Hello there, my friend.", "今天天气很好。",
                                             "See you tomorrow."]
    assert [s["pts_ms"] for s in segments] == sorted(s["pts_ms"] for s in segments)
    assert events(out, "text.skipped") == []
    audio = [a.message for a in out if isinstance(a, Send) and a.message.type == "audio"]
    assert [a.seq for a in audio] == list(range(len(audio)))


def test_the_context_language_option_goes_only_to_the_contexts_own_voice() -> None:
    session = make_session(voice_for={"zh": "mei"})
    session.receive_frame(json.dumps({"type": "session.update", "language": "en"}), 0.0)
    requests = submits(text(session, "c", "Hello there, my friend. 今天天气很好。"))
    assert [(r.voice, r.language) for r in requests] == [("joe", "en"), ("mei", None)]


def test_a_chinese_name_in_an_english_sentence_stays_english_and_is_cut_out() -> None:
    session = make_session(voice_for={"zh": "mei"})
    actions = text(session, "c", "I met 王小明 at the station yesterday.")
    (request,) = submits(actions)
    assert (request.text, request.voice) == ("I met at the station yesterday.", "joe")
    out = speak_all(session, actions)
    segment, skipped = events(out, "segment", "text.skipped")
    assert segment["text"] == "I met at the station yesterday."
    assert (skipped["segment_id"], skipped["offset"], skipped["text"]) == (0, 5, "王小明")
    assert segment["text"][:skipped["offset"]] == "I met"


def test_a_cyrillic_segment_is_skipped_as_undetermined_or_goes_to_a_russian_voice() -> None:
    out = speak_all(session := make_session(),
                    text(session, "c", "Привет, как дела? Fine, thanks."))
    assert [(e["text"], e["language"]) for e in events(out, "text.skipped")] == [
        ("Привет, как дела?", "und-Cyrl")]
    session = make_session(voice_for={"ru": "ivan"})
    assert [r.voice for r in submits(text(session, "c", "Привет, как дела? Fine, thanks."))] == [
        "ivan", "joe"]


def test_a_context_with_nothing_to_say_takes_no_engine_capacity_and_ends_silent() -> None:
    admitted: list[str] = []
    session = make_session(admitted=admitted)
    actions = text(session, "c", "今天天气很好。我们明天见。")
    assert submits(actions) == [] and admitted == []
    assert [e["type"] for e in events(actions)] == ["text.skipped", "text.skipped", "context.done"]
    assert events(actions, "context.done")[0] == {"type": "context.done", "context_id": "c",
                                                  "audio_ms": 0.0, "segments": 0}


def test_at_barge_in_skipped_text_is_unspoken_wherever_it_fell() -> None:
    session = make_session()
    actions = text(session, "c",
                   "I met 王小明 at the station yesterday. 今天天气很好。 Then we left.")
    first = submits(actions)[0]
    answer(session, first)  # 6 words of 100 ms
    cancel = session.receive_frame(json.dumps({"type": "cancel", "context_id": "c",
                                               "played_ms": 250}), 0.5)
    (cancelled,) = events(cancel, "cancelled")
    assert cancelled["spoken_text"] == "I met"
    assert cancelled["unspoken_text"] == \
        "王小明 at the station yesterday. 今天天气很好。 Then we left."


def test_a_fully_heard_segment_leaves_its_skipped_name_unspoken() -> None:
    session = make_session()
    actions = text(session, "c", "I met 王小明 there.")
    answer(session, submits(actions)[0])  # all sent: the cancel comes after context.done
    cancel = session.receive_frame(json.dumps({"type": "cancel", "context_id": "c"}), 0.5)
    (cancelled,) = events(cancel, "cancelled")
    assert (cancelled["spoken_text"], cancelled["unspoken_text"]) == ("I met there.", "王小明")


def test_a_session_maps_and_unmaps_languages_over_the_servers_map_and_holds_their_voices() -> None:
    catalog = VoiceCatalog(LANGUAGES)
    session = make_session(voice_for={"zh": "mei"}, catalog=catalog)
    update = session.receive_frame(json.dumps({"type": "session.update",
                                               "voice_for": {"zh-CN": None, "ru": "ivan"}}), 0.0)
    assert events(update)[0]["options"]["voice_for"] == {"zh": None, "ru": "ivan"}
    assert catalog.num_holders("ivan") == 1 and catalog.num_holders("mei") == 0
    actions = text(session, "c", "今天天气很好。 Привет, как дела?")
    assert [r.voice for r in submits(actions)] == ["ivan"]  # the Chinese one is skipped now
    assert catalog.num_holders("ivan") == 2  # the session's, and the open context's
    session.disconnect()
    assert catalog.num_holders("ivan") == 0 and catalog.num_holders("joe") == 0


def test_voice_for_refuses_unknown_voices_and_malformed_languages() -> None:
    session = make_session()
    bad_voice = events(session.receive_frame(json.dumps(
        {"type": "session.update", "voice_for": {"zh": "nobody"}}), 0.0))[0]
    assert bad_voice["code"] == "unknown_voice"
    bad_key = events(session.receive_frame(json.dumps(
        {"type": "session.update", "voice_for": {"chinese!": "mei"}}), 0.0))[0]
    assert bad_key["code"] == "unsupported_option" and "language tags" in bad_key["message"]
    not_a_map = events(session.receive_frame(json.dumps(
        {"type": "session.update", "voice_for": ["zh", "mei"]}), 0.0))[0]
    assert not_a_map["code"] == "bad_message"


def test_without_languages_a_session_speaks_everything_with_its_voice() -> None:
    session = Session("s1", catalog=VoiceCatalog(LANGUAGES), sample_rate=RATE)
    session.start(0.0)
    requests = submits(text(session, "c", "Hello there. 今天天气很好。"))
    assert [(r.text, r.voice) for r in requests] == [("Hello there.", "joe"),
                                                     ("今天天气很好。", "joe")]


@given(mixed_text, st.sampled_from([None, {"zh": "mei"}, {"ru": "ivan", "ja": "mei"}]))
@settings(max_examples=150, deadline=None)
def test_segments_and_skipped_texts_in_order_rejoin_to_the_cleaned_text(
        value: str, voice_for: dict[str, str] | None) -> None:
    session = make_session(voice_for=voice_for)
    out = speak_all(session, text(session, "c", value))
    # per segment id, in order: its spoken text, and what was cut from it at which offsets
    spoken: dict[int, str] = {}
    cuts: dict[int, list[tuple[int, str]]] = {}
    for event in events(out, "segment", "text.skipped"):
        segment_id = event["segment_id"]
        if event["type"] == "segment":
            assert segment_id not in spoken and segment_id not in cuts  # its cuts follow it
            spoken[segment_id] = event["text"]
        else:
            offset = event["offset"]
            assert (offset is None) == (segment_id not in spoken)
            cuts.setdefault(segment_id, []).append((offset or 0, event["text"]))
    rejoined = []
    for segment_id in sorted(spoken.keys() | cuts.keys()):
        said, at = spoken.get(segment_id, ""), 0
        for offset, skipped in cuts.get(segment_id, []):
            assert offset >= at
            rejoined += [said[at:offset], skipped]
            at = offset
        rejoined.append(said[at:])
    assert "".join("".join(rejoined).split()) == "".join(clean_for_speech(value).split())
