"""Voice uploads: the multipart form of `POST /v1/voices`, checked field by field.

Every way an upload can be wrong has its own error code (docs/voices.md lists
them) and a 4xx answer that says what was expected; nothing a client sends
reaches a 500. Work is checked before it is done: the container's header
(sample rate, channels, declared duration) is read by PyAV before any sample
is decoded, and decoding stops as soon as it passes the allowed rate x
duration, so a small compressed file that claims 655 kHz x 8 channels, or
expands to hours, costs no more than a header read. The body must arrive
whole within the upload deadline, however slowly it trickles (408,
gateway/bodies.py); file parts past 1 MiB spool to a temporary file while
it is read. Decoding runs off the event loop; how many run at once is the
voice service's bound, taken once the body is complete (gateway/voices/routes.py).
"""

from __future__ import annotations

import io
import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import av
import numpy as np
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request

from engine.errors import VoxgateError
from gateway.bodies import BodyTimeoutError, within

FIELDS = ("audio", "text", "name", "language", "id", "base_voice")
VOICE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
LANGUAGE_RE = re.compile(r"[A-Za-z]{2,3}([-_][A-Za-z0-9]{2,8})*")
MAX_NAME_CHARS = 100
#: Below this peak (about -60 dBFS) the reference is silence, whatever its length.
MIN_PEAK = 1e-3


class VoiceUploadError(VoxgateError):
    """A registration the gateway refuses: HTTP status, error code, message for the client."""

    status: int = 400

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(slots=True)
class UploadLimits:
    max_upload_bytes: int = 10 * 1024 * 1024
    min_duration_s: float = 1.0
    max_duration_s: float = 30.0
    min_sample_rate: int = 16000
    max_sample_rate: int = 192000
    max_channels: int = 2
    max_transcript_chars: int = 1000

    def __post_init__(self) -> None:
        if self.max_upload_bytes < 1024:
            raise ValueError(f"max_upload_bytes must be >= 1024, got {self.max_upload_bytes}")
        if not 0 < self.min_duration_s < self.max_duration_s:
            raise ValueError("expected 0 < min_duration_s < max_duration_s, got "
                             f"{self.min_duration_s} and {self.max_duration_s}")
        if not 0 < self.min_sample_rate <= self.max_sample_rate:
            raise ValueError("expected 0 < min_sample_rate <= max_sample_rate, got "
                             f"{self.min_sample_rate} and {self.max_sample_rate}")
        if self.max_channels < 1:
            raise ValueError(f"max_channels must be >= 1, got {self.max_channels}")
        if self.max_transcript_chars < 1:
            raise ValueError(f"max_transcript_chars must be >= 1, got {self.max_transcript_chars}")


@dataclass(slots=True)
class VoiceUpload:
    """The form's fields, checked for presence and type (not yet the audio itself)."""

    audio: bytes
    transcript: str = ""
    voice_id: str | None = None
    name: str | None = None
    language: str = ""
    base_voice: str | None = None


@dataclass(slots=True, frozen=True)
class ReferenceAudio:
    """Decoded reference audio. pcm: [T] mono float32 in [-1, 1] at `sample_rate`."""

    pcm: np.ndarray
    sample_rate: int
    duration_s: float
    format: str


async def _capped(request: Request, limit: int, timeout_s: float) -> AsyncGenerator[bytes, None]:
    total = 0
    async for chunk in within(request, timeout_s):
        total += len(chunk)
        if total > limit:
            raise VoiceUploadError(413, "upload_too_large",
                                   f"the upload is over {limit} bytes; the limit is {limit} bytes")
        yield chunk


async def read_upload(request: Request, limits: UploadLimits, timeout_s: float) -> VoiceUpload:
    """Parse and check the multipart form, whole within `timeout_s`; raises VoiceUploadError."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise VoiceUploadError(415, "not_multipart", "expected a multipart/form-data body with an "
                               "'audio' file and its 'text' transcript, got "
                               f"{content_type or 'none'!r}")
    limit = limits.max_upload_bytes + 64 * 1024  # room for the other fields
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise VoiceUploadError(413, "upload_too_large",
                               f"the upload is {declared} bytes; the limit is {limit} bytes")
    parser = MultiPartParser(request.headers, _capped(request, limit, timeout_s),
                             max_files=len(FIELDS), max_fields=2 * len(FIELDS),
                             max_part_size=64 * 1024)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise VoiceUploadError(400, "bad_multipart",
                               f"the multipart body is malformed: {exc.message}") from None
    except BodyTimeoutError as exc:
        raise VoiceUploadError(408, "upload_timeout", f"{exc}; send it faster, or a smaller "
                               "recording") from None
    except ClientDisconnect:
        raise VoiceUploadError(400, "bad_request",
                               "the client went away while sending the body") from None
    try:
        return await _fields(form.multi_items())
    finally:
        await form.close()


async def _fields(items: list[tuple[str, str | UploadFile]]) -> VoiceUpload:
    seen: dict[str, str | UploadFile] = {}
    for key, value in items:
        if key not in FIELDS:
            raise VoiceUploadError(400, "unknown_field",
                                   f"unknown form field {key!r}; expected: {', '.join(FIELDS)}")
        if key in seen:
            raise VoiceUploadError(400, "duplicate_field", f"form field {key!r} appears twice")
        seen[key] = value
    audio = seen.get("audio")
    if audio is None:
        raise VoiceUploadError(400, "missing_audio",
                               "expected the reference recording as a file in the 'audio' field")
    if not isinstance(audio, UploadFile):
        raise VoiceUploadError(400, "audio_not_a_file",
                               "expected 'audio' to be a file part (with a filename), got a text "
                               "field")
    texts: dict[str, str] = {}
    for key in ("text", "name", "language", "id", "base_voice"):
        field_value = seen.get(key)
        if isinstance(field_value, UploadFile):
            raise VoiceUploadError(400, "bad_field",
                                   f"expected {key!r} to be a text field, got a file")
        texts[key] = (field_value or "").strip()
    data = await audio.read()
    if not data:
        raise VoiceUploadError(400, "empty_audio", "the 'audio' file is empty (0 bytes)")
    return VoiceUpload(audio=data, transcript=texts["text"], voice_id=texts["id"] or None,
                       name=texts["name"] or None, language=texts["language"],
                       base_voice=texts["base_voice"] or None)


def check_fields(upload: VoiceUpload, limits: UploadLimits, *, needs_transcript: bool) -> None:
    """The text fields: voice id, name, language, transcript. Raises VoiceUploadError."""
    if upload.voice_id is not None and not VOICE_ID_RE.fullmatch(upload.voice_id):
        raise VoiceUploadError(400, "bad_voice_id", "expected an id of 1-64 characters from "
                               "[A-Za-z0-9._-], starting with a letter or digit, got "
                               f"{upload.voice_id!r}")
    if upload.name is not None and len(upload.name) > MAX_NAME_CHARS:
        raise VoiceUploadError(400, "bad_field", f"expected a name of at most {MAX_NAME_CHARS} "
                               f"characters, got {len(upload.name)}")
    if upload.language and not LANGUAGE_RE.fullmatch(upload.language):
        raise VoiceUploadError(400, "bad_language",
                               "expected a language tag such as 'en' or 'en-US', got "
                               f"{upload.language!r}")
    if needs_transcript and not upload.transcript:
        raise VoiceUploadError(400, "missing_transcript",
                               "this engine clones from the reference and "
                               "needs what it says: expected the transcript in the 'text' field")
    if len(upload.transcript) > limits.max_transcript_chars:
        raise VoiceUploadError(400, "text_too_long", f"the transcript has {len(upload.transcript)} "
                               f"characters; the limit is {limits.max_transcript_chars}")


def decode_reference(data: bytes, limits: UploadLimits) -> ReferenceAudio:
    """Decode and check the reference recording (blocking: run it in a thread)."""
    if len(data) > limits.max_upload_bytes:
        raise VoiceUploadError(413, "upload_too_large", f"the audio is {len(data)} bytes; "
                               f"the limit is {limits.max_upload_bytes} bytes")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception:  # noqa: BLE001 - FFmpeg raises many kinds for foreign bytes
        raise VoiceUploadError(415, "not_audio", "the 'audio' file is not an audio format that "
                               "FFmpeg reads (expected WAV, FLAC, MP3, Ogg/Opus, M4A...)") from None
    with container:
        if not container.streams.audio:
            raise VoiceUploadError(415, "not_audio", "the 'audio' file holds no audio stream")
        stream = container.streams.audio[0]
        rate = int(stream.codec_context.sample_rate or stream.rate or 0)
        if rate <= 0:
            raise VoiceUploadError(415, "not_audio", "the 'audio' file's stream has no sample rate")
        _check_header(container, stream, rate, limits)  # before a single sample is decoded
        fmt = (container.format.name or "unknown").split(",")[0]
        pcm, is_truncated = _decode_mono(container, stream, rate, limits.max_duration_s)
    duration = len(pcm) / rate
    if is_truncated or duration > limits.max_duration_s:
        raise _too_long(limits)
    if duration < limits.min_duration_s:
        raise VoiceUploadError(422, "audio_too_short", f"the reference lasts {duration:.2f} s; "
                               f"expected {limits.min_duration_s:g}-{limits.max_duration_s:g} s of "
                               "speech")
    if not np.isfinite(pcm).all() or float(np.abs(pcm).max()) < MIN_PEAK:
        raise VoiceUploadError(422, "silent_audio", "the reference is silent; expected a recording "
                               "of the voice speaking")
    return ReferenceAudio(pcm, rate, duration, fmt)


def _too_long(limits: UploadLimits) -> VoiceUploadError:
    return VoiceUploadError(422, "audio_too_long", f"the reference is longer than "
                            f"{limits.max_duration_s:g} s; expected {limits.min_duration_s:g}-"
                            f"{limits.max_duration_s:g} s of speech")


def _check_header(container: av.container.InputContainer, stream: av.AudioStream, rate: int,
                  limits: UploadLimits) -> None:
    """Rate, channels and declared duration, from the container header alone."""
    if rate < limits.min_sample_rate:
        raise VoiceUploadError(422, "sample_rate_too_low",
                               f"the reference is sampled at {rate} Hz; "
                               f"expected at least {limits.min_sample_rate} Hz")
    if rate > limits.max_sample_rate:
        raise VoiceUploadError(422, "sample_rate_too_high",
                               f"the reference is sampled at {rate} Hz; "
                               f"expected at most {limits.max_sample_rate} Hz")
    channels = int(stream.codec_context.channels or 0)
    if channels > limits.max_channels:
        raise VoiceUploadError(422, "too_many_channels", f"the reference has {channels} channels; "
                               f"expected at most {limits.max_channels} (mono or stereo)")
    declared = container.duration  # microseconds, when the header says (None: it does not)
    if declared is not None and declared / 1e6 > limits.max_duration_s + 1.0:
        raise _too_long(limits)


def _decode_mono(container: av.container.InputContainer, stream: av.AudioStream, rate: int,
                 max_duration_s: float) -> tuple[np.ndarray, bool]:
    """[T] float32 mono at the stream's rate; stops (is_truncated) past the limit."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    limit = int((max_duration_s + 0.5) * rate)
    chunks: list[np.ndarray] = []
    total = 0
    try:
        for frame in container.decode(stream):
            for out in resampler.resample(frame):
                chunk = out.to_ndarray().reshape(-1)  # [n] flt mono is packed
                chunks.append(chunk)
                total += len(chunk)
            if total > limit:  # the cap on decoded samples: allowed rate x duration, no more
                return np.zeros(0, np.float32), True
        for out in resampler.resample(None):
            chunks.append(out.to_ndarray().reshape(-1))
    except Exception:  # noqa: BLE001 - a damaged stream is the client error, not ours
        raise VoiceUploadError(415, "not_audio", "the 'audio' file's stream does not decode; "
                               "expected a complete, undamaged recording") from None
    if not chunks:
        raise VoiceUploadError(415, "not_audio", "the 'audio' file decodes to no samples")
    return np.concatenate(chunks).astype(np.float32), False
