"""The piper backend: batching equals solo synthesis, trimming, word timings, errors."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.backend import BackendRequest
from engine.backends import create_backend
from engine.backends.piper.alignment import align_words
from engine.backends.piper.backend import PiperBackend, pack_by_length
from engine.backends.piper.config import PiperBackendConfig
from engine.backends.piper.segment import PiperState
from engine.errors import UnknownVoiceError, UnsupportedOptionError
from engine.types import RequestId, SamplingParams, SynthesisRequest

TEXTS = [
    "Hello, world. How are you today?",
    "Yes.",
    "Dr. Smith paid 42 dollars for 1,000 apples -- in the U.S., of all places!",
]


@pytest.fixture(scope="module")
def backend() -> PiperBackend:
    # Whole segments, one onnxruntime call per step however ragged: the batched path under
    # test (decoder windows: tests/unit/engine/piper/test_windows.py).
    piper = PiperBackend(PiperBackendConfig(num_threads=1, max_padding_waste=None, windowed=False))
    piper.load()
    return piper


def request(text: str, voice: str = "joe", **params: float) -> SynthesisRequest:
    noise = {"noise_scale": 0.0, "noise_w_scale": 0.0}  # VITS samples otherwise
    return SynthesisRequest(
        RequestId(text[:8]), text, voice, params=SamplingParams(**{**noise, **params})
    )


def synthesize(backend: PiperBackend, *requests: SynthesisRequest) -> list[np.ndarray]:
    results = backend.step([backend.prepare(r) for r in requests])
    assert all(r.error is None and r.is_finished for r in results)
    return [r.pcm for r in results]


def test_batched_segments_equal_their_unbatched_synthesis(backend: PiperBackend) -> None:
    batched = synthesize(backend, *(request(t) for t in TEXTS))
    for text, pcm in zip(TEXTS, batched, strict=True):
        (solo,) = synthesize(backend, request(text))
        assert pcm.dtype == np.float32
        assert len(pcm) == len(solo)
        assert np.abs(pcm - solo).max() < 1e-3


def test_padded_tail_of_a_shorter_item_is_not_silent(backend: PiperBackend) -> None:
    items = [backend.prepare(request(t)) for t in TEXTS]
    states = [item.state for item in items]
    assert all(isinstance(s, PiperState) for s in states)
    lengths = np.array([len(s.ids) for s in states], dtype=np.int64)
    ids = np.zeros((len(states), lengths.max()), dtype=np.int64)
    for row, state in enumerate(states):
        ids[row, : len(state.ids)] = state.ids
    voice = backend.get_voice("joe")
    audio, durations = voice.run(ids, lengths, np.array([0, 1, 0], dtype=np.float32), None)
    short = int(np.argmin(lengths))
    true_length = int(durations[short].sum()) * voice.config.hop_length
    tail = audio[short, true_length:]
    assert len(tail) > 0.5 * backend.sample_rate
    assert np.abs(tail).max() > 1e-3  # so trimming by the durations is what removes it
    trimmed = backend.step(items)[short].pcm
    assert len(trimmed) == true_length


def test_word_timings_tile_the_audio_and_keep_the_texts_words(backend: PiperBackend) -> None:
    items = [backend.prepare(request(t)) for t in TEXTS]
    for text, result in zip(TEXTS, backend.step(items), strict=True):
        words = result.words
        assert words is not None
        assert [w.word for w in words] == text.split()
        assert words[0].start_ms == 0.0
        assert words[-1].end_ms == pytest.approx(1000.0 * len(result.pcm) / backend.sample_rate)
        for before, after in itertools.pairwise(words):
            assert before.end_ms == after.start_ms
        assert all(w.end_ms >= w.start_ms for w in words)
        spoken = [w for w in words if w.word != "--"]
        assert all(w.end_ms - w.start_ms > 50.0 for w in spoken)


def test_a_number_word_lasts_longer_than_a_short_word(backend: PiperBackend) -> None:
    (result,) = backend.step([backend.prepare(request("I paid 1,234,567 dollars."))])
    assert result.words is not None
    length = {w.word: w.end_ms - w.start_ms for w in result.words}
    assert length["1,234,567"] > 3 * length["I"]


def test_alignment_survives_merged_expanded_and_silent_words() -> None:
    # espeak: "of the" -> "ʌvðə", "42" -> two words, "--" -> nothing
    utterance = list("ʌvðə fˈɔːɹɾi tˈuː")
    alone = [list("ʌv"), list("ðə"), list("--"), list("fˈɔːɹɾi tˈuː")]
    spans = align_words(alone, utterance)
    assert [("".join(utterance[a:b])) for a, b in spans] == ["ʌv", "ðə", "", "fˈɔːɹɾi tˈuː"]


def test_items_of_similar_length_share_a_call_and_ragged_ones_do_not() -> None:
    assert pack_by_length([100, 50, 95, 48], max_waste=0.1) == [[0, 2], [1, 3]]
    assert pack_by_length([100, 50, 95, 48], max_waste=None) == [[0, 1, 2, 3]]
    assert pack_by_length([100, 100, 100], max_waste=0.0) == [[0, 1, 2]]
    assert pack_by_length([], max_waste=0.1) == []


def test_packed_steps_give_the_same_audio_as_one_call(backend: PiperBackend) -> None:
    one_call = synthesize(backend, *(request(t) for t in TEXTS))
    backend.config.max_padding_waste = 0.1
    try:
        packed = synthesize(backend, *(request(t) for t in TEXTS))
    finally:
        backend.config.max_padding_waste = None
    for a, b in zip(one_call, packed, strict=True):
        assert len(a) == len(b) and np.abs(a - b).max() < 1e-3


def test_unknown_voice_names_the_voices_it_expected(backend: PiperBackend) -> None:
    with pytest.raises(UnknownVoiceError, match="unknown voice 'nobody'; expected one of: joe"):
        backend.prepare(request("Hi.", voice="nobody"))


def test_the_voice_package_name_is_an_alias_of_joe(backend: PiperBackend) -> None:
    item = backend.prepare(request("Hi.", voice="en_US-joe-medium"))
    assert isinstance(item.state, PiperState)
    assert item.state.voice.info.voice_id == "joe"


def test_instructions_are_unsupported(backend: PiperBackend) -> None:
    req = request("Hi.")
    req.instructions = "speak warmly"
    with pytest.raises(UnsupportedOptionError):
        backend.prepare(req)


def test_speed_changes_duration_and_estimate(backend: PiperBackend) -> None:
    text = TEXTS[0]
    items = [backend.prepare(request(text, speed=s)) for s in (0.5, 1.0, 2.0)]
    slow, normal, fast = (len(p) for p in synthesize(backend, *(i.request for i in items)))
    assert slow > 1.7 * normal and fast < 0.7 * normal  # the edges of silence do not scale
    assert items[0].est_audio_s > items[1].est_audio_s > items[2].est_audio_s


def test_estimate_is_near_the_real_duration(backend: PiperBackend) -> None:
    item = backend.prepare(request(TEXTS[2]))
    (pcm,) = synthesize(backend, item.request)
    assert item.est_audio_s == pytest.approx(len(pcm) / backend.sample_rate, rel=0.3)


def test_items_with_different_scales_share_a_step(backend: PiperBackend) -> None:
    batched = synthesize(backend, request(TEXTS[0]), request(TEXTS[1], speed=1.5))
    solo = synthesize(backend, request(TEXTS[1], speed=1.5))
    assert len(batched[1]) == len(solo[0])
    assert np.abs(batched[1] - solo[0]).max() < 1e-3


def test_unspeakable_text_finishes_with_no_audio(backend: PiperBackend) -> None:
    (result,) = backend.step([backend.prepare(request("..."))])
    assert result.is_finished and result.error is None and len(result.pcm) == 0


def test_a_broken_item_fails_alone(backend: PiperBackend) -> None:
    broken = BackendRequest(request=request("Hi."), state="not prepared")
    good, bad = backend.step([backend.prepare(request("Hi.")), broken])
    assert good.error is None and len(good.pcm) > 0
    assert bad.error is not None and bad.is_finished


def test_a_voices_directory_adds_voices_by_file_stem(tmp_path: Path) -> None:
    joe = PiperBackend().get_files("joe")
    shutil.copy(joe.config_path, tmp_path / "my-voice.onnx.json")
    (tmp_path / "my-voice.onnx").symlink_to(joe.model_path)
    (tmp_path / "orphan.onnx").symlink_to(joe.model_path)  # no config: skipped
    piper = create_backend("piper", voices_dir=tmp_path, num_threads=1)
    piper.load()
    assert [v.voice_id for v in piper.voices()] == ["joe", "my-voice"]
    assert piper.prepare(request("Hi.", voice="my-voice")).est_audio_s > 0


def test_unknown_backend_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown backend 'festival'; expected one of: piper"):
        create_backend("festival")


def test_a_registered_voice_speaks_with_its_base_until_removed_and_unlisted_once_retired(
        backend: PiperBackend) -> None:
    info = backend.add_voice("alice", None, {"name": "Alice"})
    assert (info.voice_id, info.name, info.language, info.is_builtin) == (
        "alice", "Alice", "en-US", False)
    assert "alice" in [v.voice_id for v in backend.voices()]
    assert backend.prepare(request("Hi.", voice="alice")).state.voice.info.voice_id == "joe"
    backend.retire_voice("alice")
    assert "alice" not in [v.voice_id for v in backend.voices()]
    backend.prepare(request("Hi.", voice="alice"))  # a session holding it still speaks
    with pytest.raises(UnknownVoiceError, match="expected one of: joe$"):
        backend.prepare(request("Hi.", voice="bob"))  # retired voices are not offered
    backend.remove_voice("alice")
    with pytest.raises(UnknownVoiceError):
        backend.prepare(request("Hi.", voice="alice"))
    with pytest.raises(UnknownVoiceError, match="unknown registered voice 'alice'"):
        backend.remove_voice("alice")
    with pytest.raises(ValueError, match="piper voices take no prompt features"):
        backend.add_voice("carol", b"features", {})


def test_voices_declare_their_languages_from_their_config(tmp_path: Path) -> None:
    joe = PiperBackend().get_files("joe")
    config = json.loads(joe.config_path.read_text(encoding="utf-8"))
    config["espeak"], config["language"] = {"voice": "cmn"}, {"code": "zh_CN"}
    (tmp_path / "mandarin.onnx.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "mandarin.onnx").symlink_to(joe.model_path)
    piper = create_backend("piper", voices_dir=tmp_path, num_threads=1)
    piper.load()
    assert {v.voice_id: v.languages for v in piper.voices()} == {
        "joe": ("en",), "mandarin": ("zh",)}
    assert piper.add_voice("alice", None, {"base_voice": "mandarin"}).languages == ("zh",)


@pytest.mark.parametrize("windowed", [False, True])
def test_a_voice_of_another_rate_is_resampled_to_the_engines_and_its_words_tile_it(
        tmp_path: Path, windowed: bool) -> None:
    # joe's model under a config that says 16 kHz (piper's "low" quality): what it makes is
    # taken as 16 kHz audio, so at the engine's 22.05 kHz it is 22050/16000 times as long
    joe = PiperBackend().get_files("joe")
    config = json.loads(joe.config_path.read_text(encoding="utf-8"))
    config["audio"]["sample_rate"] = 16000
    (tmp_path / "low.onnx.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "low.onnx").symlink_to(joe.model_path)
    piper = create_backend("piper", voices_dir=tmp_path, num_threads=1, windowed=windowed)
    piper.load()
    assert piper.sample_rate == 22050 and "low" in [v.voice_id for v in piper.voices()]
    lengths, last_words = {}, {}
    for voice in ("joe", "low"):
        item = piper.prepare(request("Hello there, this is a test of another rate.", voice=voice))
        pieces = []
        while True:
            (result,) = piper.step([item])
            assert result.error is None
            pieces.append(result.pcm)
            if result.words:
                last_words[voice] = result.words[-1].end_ms
            if result.is_finished:
                break
        lengths[voice] = sum(len(p) for p in pieces)
        assert all(p.dtype == np.float32 for p in pieces)
    assert lengths["low"] == pytest.approx(lengths["joe"] * 22050 / 16000, abs=2)
    assert last_words["low"] == pytest.approx(1000 * lengths["low"] / 22050, abs=1.0)
