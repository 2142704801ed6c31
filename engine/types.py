"""Plain data that crosses the engine's public face.

Nothing here imports a model library: the gateway imports these types, and the
scheduler and backends share them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NewType

import numpy as np

RequestId = NewType("RequestId", str)

#: The speaking rates every backend honours (1.0 is the voice's own pace).
MIN_SPEED, MAX_SPEED = 0.5, 2.0
#: Seconds of speech per character of text at speed 1.0: a rough guess (English,
#: piper's joe speaks ~15 characters a second), used to predict when audio that
#: is not made yet will run out.
EST_S_PER_CHAR = 0.065
#: A Han character or a Hangul block is a syllable: Mandarin is spoken at 4-5
#: syllables a second, Korean at 5-7; 0.18 s keeps to the short side of both.
EST_S_PER_SYLLABLE = 0.18
#: A kana is about one mora: Japanese is spoken at 7-8 morae a second.
EST_S_PER_KANA = 0.12
_SYLLABLES = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7a3]")
_KANA = re.compile(r"[\u3041-\u3096\u30a1-\u30fa\u30fc\uff66-\uff9d]")


def estimate_audio_s(text: str, speed: float = 1.0, s_per_char: float = EST_S_PER_CHAR) -> float:
    """How long `text` will take to speak at `speed`, before any audio exists.

    The engine's guess for a request not prepared yet (when the audio after it
    is due, engine/clock.py); a backend's own estimate, once it has prepared
    the request, is `BackendRequest.est_audio_s` (cosyvoice's starts from this
    one, with its own `s_per_char`). Characters count by script: a CJK one is a
    syllable or a mora, three or two Latin letters' time, so a Chinese answer is
    not guessed three times shorter than it plays (its next segment would then
    look due seconds before it is).
    """
    num_syllables = len(_SYLLABLES.findall(text))
    num_kana = len(_KANA.findall(text))
    num_other = len(text) - num_syllables - num_kana
    return (num_other * s_per_char + num_syllables * EST_S_PER_SYLLABLE
            + num_kana * EST_S_PER_KANA) / speed


@dataclass(slots=True, frozen=True)
class WordTiming:
    """One word of a segment and where its audio lies, in ms from the segment start."""

    word: str
    start_ms: float
    end_ms: float


@dataclass(slots=True, frozen=True)
class VoiceInfo:
    """A voice a backend can speak with.

    `language` is the voice's own tag (`en-US`); `languages` the languages it can
    speak, as lower-case primary subtags (`("en",)`, `("zh", "en", "ja")`), which
    the gateway routes segments by (docs/voices.md, "Languages"); empty: not
    declared, the voice is given everything.
    """

    voice_id: str
    name: str
    language: str
    backend: str
    sample_rate: int
    is_builtin: bool = True
    supports_instructions: bool = False
    languages: tuple[str, ...] = ()


@dataclass(slots=True)
class SamplingParams:
    """Backend knobs a request may carry (vLLM's vocabulary).

    `noise_scale`/`noise_w_scale` are VITS's; None keeps the voice's defaults.
    `seed` makes sampling backends reproducible.
    """

    speed: float = 1.0
    noise_scale: float | None = None
    noise_w_scale: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not MIN_SPEED <= self.speed <= MAX_SPEED:
            raise ValueError(f"speed must be within {MIN_SPEED}-{MAX_SPEED}, got {self.speed}")


@dataclass(slots=True)
class SynthesisRequest:
    """One segment of text to speak, and where its audio plays: the order, never a time.

    `context_key` groups the requests of one spoken turn: admission counts
    turns, not segments, and a context's requests play one after another in
    the order they are submitted. `plays_after` names the context whose audio
    this context plays after (the same listener's turn before it), or is empty.
    The engine owns every due time (engine/clock.py): a request is due when the
    audio before it runs out, by the engine's own count; a request with nothing
    before it (a context's first, playing after nothing still known to the
    engine) is due at once, its "first audio now" (docs/architecture.md,
    "Deadline scheduling"). A monotonic time never crosses the seam, so a
    request means the same in another process or on another machine.
    """

    request_id: RequestId
    text: str
    voice: str
    context_key: str = ""
    plays_after: str = ""
    language: str | None = None
    instructions: str | None = None
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(slots=True)
class AudioChunk:
    """PCM produced for one request.

    `pcm` is mono float32 in [-1, 1] at `sample_rate`. `words` is set on the
    chunk that carries timings (piper gives them for the whole segment with its
    only chunk). `is_last` marks the request's final chunk. `step_ms` is the wall
    time of the engine step that made it (shared by every request of that batch):
    what a client is told the server spent on its audio (docs/compat.md, "What
    differs from the vendors": Cartesia's `step_time`).
    """

    request_id: RequestId
    pcm: np.ndarray
    sample_rate: int
    is_last: bool
    words: list[WordTiming] | None = None
    step_ms: float = 0.0

    @property
    def duration_ms(self) -> float:
        return 1000.0 * len(self.pcm) / self.sample_rate
