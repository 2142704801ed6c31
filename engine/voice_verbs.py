"""The engine's verbs for registered voices (docs/voices.md), mixed into `Engine`.

This module owns how callers list, make, add, retire and remove voices
without reaching into the backend: the backend's voice capabilities
(`can_register_voices`, `needs_transcript`, `voice_features_version`), the
cached `voices` listing, and the verbs themselves. Each verb runs on the
engine's worker thread, between steps, or beside the lanes' steps for a
backend that declares `concurrent_steps` (backends need no locks; the thread
contract is engine.engine's), and refreshes `voices` itself. The engine
supplies the backend, the listing and the worker's executor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from engine.backend import Backend
from engine.types import VoiceInfo

T = TypeVar("T")


class VoiceVerbs:
    """The voice half of `Engine`: its listing and the verbs that change it."""

    backend: Backend
    _voices: list[VoiceInfo]
    _executor: ThreadPoolExecutor

    @property
    def voices(self) -> list[VoiceInfo]:
        return self._voices

    def refresh_voices(self) -> None:
        self._voices = self.backend.voices()

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def can_register_voices(self) -> bool:
        """Whether `add_voice` can work (the backend declares it)."""
        return self.backend.can_register_voices

    @property
    def needs_transcript(self) -> bool:
        """Registration needs the reference audio's transcript (cosyvoice's prompt text)."""
        return self.backend.needs_transcript

    @property
    def voice_features_version(self) -> str:
        """Names the format of `make_voice_features`' output; stored features of another are
        stale."""
        return self.backend.voice_features_version

    async def make_voice_features(self, audio: np.ndarray, sample_rate: int,
                                  transcript: str) -> bytes | None:
        """A reference voice's prompt features (audio: [T] mono float32 at `sample_rate`).

        Raises ValueError for audio the backend cannot use.
        """
        executor = self.backend.voice_features_executor()
        if executor is None:
            return await self._on_worker(self.backend.make_voice_features, audio, sample_rate,
                                         transcript)
        loop = asyncio.get_running_loop()  # the backend's own executor: steps go on meanwhile
        return await loop.run_in_executor(executor, self.backend.make_voice_features,
                                          audio, sample_rate, transcript)

    async def add_voice(self, voice_id: str, features: bytes | None,
                        meta: dict[str, Any]) -> VoiceInfo:
        """Make a registered voice speakable and listed (replacing one of the same id)."""
        return await self._change_voices(self.backend.add_voice, voice_id, features, meta)

    async def retire_voice(self, voice_id: str) -> None:
        """Unlist a registered voice; requests that name it keep speaking until it is removed."""
        await self._change_voices(self.backend.retire_voice, voice_id)

    async def remove_voice(self, voice_id: str) -> None:
        """Forget a registered or retired voice; raises UnknownVoiceError for any other id."""
        await self._change_voices(self.backend.remove_voice, voice_id)

    async def _change_voices(self, verb: Callable[..., T], *args: Any) -> T:
        def change() -> tuple[T, list[VoiceInfo]]:  # worker thread: the verb, then the new listing
            return verb(*args), self.backend.voices()

        result, self._voices = await self._on_worker(change)
        return result

    async def _on_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """The one place the voice verbs meet the worker's executor."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)
