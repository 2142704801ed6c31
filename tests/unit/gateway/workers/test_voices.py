"""The engine process's one voice table: a voice leaves the engine when no worker counts it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.errors import UnknownVoiceError
from engine.types import VoiceInfo
from gateway.workers.voices import SharedVoices


class VoiceEngine:
    """The engine's voice verbs and listing, as plain data (no backend behind them)."""

    def __init__(self) -> None:
        self.listed: dict[str, VoiceInfo] = {}
        self.retired: set[str] = set()
        self.calls: list[str] = []

    @property
    def voices(self) -> list[VoiceInfo]:
        return list(self.listed.values())

    async def add_voice(self, voice_id: str, features: bytes | None,
                        meta: dict[str, Any]) -> VoiceInfo:
        self.calls.append(f"add:{voice_id}")
        info = VoiceInfo(voice_id, meta["name"], "en", "scripted", 16000, is_builtin=False)
        self.listed[voice_id] = info
        self.retired.discard(voice_id)
        return info

    async def retire_voice(self, voice_id: str) -> None:
        self.calls.append(f"retire:{voice_id}")
        self.listed.pop(voice_id)
        self.retired.add(voice_id)

    async def remove_voice(self, voice_id: str) -> None:
        self.calls.append(f"remove:{voice_id}")
        if voice_id not in self.listed and voice_id not in self.retired:
            raise UnknownVoiceError(f"unknown voice {voice_id!r}")
        self.listed.pop(voice_id, None)
        self.retired.discard(voice_id)


def _run(engine: VoiceEngine, *steps: tuple[str, int, str]) -> SharedVoices:
    voices = SharedVoices(engine)  # type: ignore[arg-type]  # the verbs it uses, no more

    async def go() -> None:
        for verb, worker, voice_id in steps:
            if verb == "add":
                await voices.add(worker, voice_id, b"f", {"name": voice_id})
            elif verb == "drop":
                await voices.drop_worker(worker)
            else:
                await getattr(voices, verb)(worker, voice_id)

    asyncio.run(go())
    return voices


def test_the_same_voice_added_by_every_worker_reaches_the_engine_once() -> None:
    engine = VoiceEngine()
    voices = _run(engine, ("add", 0, "x"), ("add", 1, "x"), ("add", 2, "x"))
    assert engine.calls == ["add:x"] and voices.num_holders("x") == 3


def test_a_voice_stays_in_the_engine_until_the_last_worker_removes_it() -> None:
    engine = VoiceEngine()
    _run(engine, ("add", 0, "x"), ("add", 1, "x"), ("retire", 0, "x"), ("remove", 0, "x"))
    assert engine.calls == ["add:x", "retire:x"] and "x" in engine.retired  # worker 1 holds it
    engine = VoiceEngine()
    _run(engine, ("add", 0, "x"), ("add", 1, "x"), ("retire", 0, "x"), ("retire", 1, "x"),
         ("remove", 0, "x"), ("remove", 1, "x"))
    assert engine.calls == ["add:x", "retire:x", "remove:x"] and not engine.retired


def test_a_worker_that_goes_away_lets_go_of_retired_voices_only() -> None:
    engine = VoiceEngine()
    _run(engine, ("add", 0, "kept"), ("add", 0, "gone"), ("retire", 0, "gone"), ("drop", 0, ""))
    assert engine.calls == ["add:kept", "add:gone", "retire:gone", "remove:gone"]
    assert list(engine.listed) == ["kept"]


def test_a_voice_added_again_with_other_features_replaces_it_and_a_retired_one_comes_back() -> None:
    engine = VoiceEngine()
    voices = SharedVoices(engine)  # type: ignore[arg-type]

    async def go() -> None:
        await voices.add(0, "x", b"one", {"name": "x"})
        await voices.add(1, "x", b"two", {"name": "x"})
        await voices.retire(1, "x")
        await voices.add(1, "x", b"two", {"name": "x"})

    asyncio.run(go())
    assert engine.calls == ["add:x", "add:x", "retire:x", "add:x"] and "x" in engine.listed


def test_removing_a_voice_no_worker_added_is_the_engines_answer() -> None:
    with pytest.raises(UnknownVoiceError):
        _run(VoiceEngine(), ("remove", 0, "nobody"))
