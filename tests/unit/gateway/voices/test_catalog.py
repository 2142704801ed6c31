"""The voice catalog: listing, hold counts, and retired voices leaving at their last release.

The first tests drive the catalog and the sans-I/O session synchronously; the
last ones run the real engine (a scripted backend that can register voices),
the real voice service and its SQLite store.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from engine.backend import BackendRequest
from engine.engine import Engine, EngineConfig
from engine.errors import UnknownVoiceError
from engine.types import SynthesisRequest, VoiceInfo
from gateway.stream.actions import Action, Send, Submit
from gateway.stream.options import SessionOptions
from gateway.stream.session import Session
from gateway.voices.catalog import VoiceCatalog
from gateway.voices.service import VoiceConfig, VoiceService
from gateway.voices.upload import VoiceUpload, VoiceUploadError
from tests.e2e.test_voices import make_wav
from tests.support.scripted_backend import ScriptedBackend
from tests.support.wait import async_wait_until


def sent(actions: list[Action], kind: str) -> list[dict[str, Any]]:
    return [a.message.to_wire() for a in actions if isinstance(a, Send) and a.message.type == kind]


def say(session: Session, context_id: str, text: str, now: float = 0.0) -> list[Action]:
    frame = json.dumps({"type": "text", "context_id": context_id, "text": text, "flush": True})
    return session.receive_frame(frame, now)


def test_a_voice_counts_its_holders_and_refuses_a_release_nobody_holds() -> None:
    catalog = VoiceCatalog({"joe"})
    catalog.hold("joe")
    catalog.hold("joe")
    assert catalog.num_holders("joe") == 2
    catalog.release("joe")
    catalog.release("joe")
    assert catalog.num_holders("joe") == 0
    with pytest.raises(ValueError, match="expected a held voice, got 'joe'"):
        catalog.release("joe")


def test_a_retired_voice_is_unlisted_at_once_and_reported_when_its_last_holder_lets_go() -> None:
    unheld: list[str] = []
    catalog = VoiceCatalog({"joe", "ada"}, on_unheld=unheld.append)
    catalog.hold("ada")
    catalog.hold("ada")
    assert catalog.retire("ada") is False  # held: it waits
    assert catalog.listed == {"joe"} and catalog.is_retired("ada")
    catalog.release("ada")
    assert unheld == []
    catalog.release("ada")
    assert unheld == ["ada"]
    assert catalog.retire("joe") is True and unheld == ["ada"]  # unheld: the caller removes it now


def test_a_voice_registered_again_before_its_last_release_is_kept() -> None:
    unheld: list[str] = []
    catalog = VoiceCatalog({"ada"}, on_unheld=unheld.append)
    catalog.hold("ada")
    catalog.retire("ada")
    catalog.add("ada")
    catalog.release("ada")
    assert unheld == [] and "ada" in catalog.listed and not catalog.is_retired("ada")


def test_a_session_holds_its_voice_and_each_open_context_voice_until_it_lets_go() -> None:
    catalog = VoiceCatalog({"joe", "ada"})
    session = Session("s", catalog=catalog, sample_rate=16000, options=SessionOptions(voice="ada"))
    assert catalog.num_holders("ada") == 1
    say(session, "c1", "Hello there. ")
    assert catalog.num_holders("ada") == 2
    session.receive_frame(json.dumps({"type": "session.update", "voice": "joe"}), 0.0)
    assert (catalog.num_holders("ada"), catalog.num_holders("joe")) == (1, 1)  # c1 keeps ada
    session.receive_frame(json.dumps({"type": "cancel", "context_id": "c1"}), 0.0)
    assert catalog.num_holders("ada") == 0
    say(session, "c2", "Now joe. ")
    assert catalog.num_holders("joe") == 2
    session.disconnect()
    session.disconnect()  # idempotent: nothing is released twice
    assert catalog.num_holders("joe") == 0


def test_a_session_speaking_a_deleted_voice_keeps_speaking_while_newcomers_are_refused() -> None:
    unheld: list[str] = []
    catalog = VoiceCatalog({"joe", "ada"}, on_unheld=unheld.append)
    holder = Session("s1", catalog=catalog, sample_rate=16000, options=SessionOptions(voice="ada"))
    assert catalog.retire("ada") is False
    newcomer = Session("s2", catalog=catalog, sample_rate=16000)
    refused = sent(newcomer.receive_frame(json.dumps({"type": "session.update", "voice": "ada"}),
                                          0.0),
                   "error")
    assert refused[0]["code"] == "unknown_voice"
    (request,) = [a.request for a in say(holder, "c", "Still speaking. ") if isinstance(a, Submit)]
    assert request.voice == "ada"
    holder.disconnect()
    assert unheld == ["ada"]


class RegisteringBackend(ScriptedBackend):
    """The scripted backend plus registered voices, which it speaks as its own voice."""

    can_register_voices = True

    def __init__(self) -> None:
        super().__init__()
        self.registered: dict[str, str] = {}  # id -> name
        self.retired: set[str] = set()
        self.removed: list[str] = []

    def voices(self) -> list[VoiceInfo]:
        return super().voices() + [VoiceInfo(v, name, "en", self.name, self.sample_rate,
                                             is_builtin=False)
                                   for v, name in self.registered.items()]

    def prepare(self, request: SynthesisRequest) -> BackendRequest:
        if request.voice not in self.registered and request.voice not in self.retired:
            return super().prepare(request)
        return BackendRequest(request, state={"left": self.chunks_per_request})

    def add_voice(self, voice_id: str, features: bytes | None, meta: dict[str, Any]) -> VoiceInfo:
        self.retired.discard(voice_id)
        self.registered[voice_id] = str(meta["name"])
        return VoiceInfo(voice_id, str(meta["name"]), "en", self.name, self.sample_rate,
                         is_builtin=False)

    def retire_voice(self, voice_id: str) -> None:
        if self.registered.pop(voice_id, None) is None:
            raise UnknownVoiceError(voice_id)
        self.retired.add(voice_id)

    def remove_voice(self, voice_id: str) -> None:
        if self.registered.pop(voice_id, None) is None and voice_id not in self.retired:
            raise UnknownVoiceError(voice_id)
        self.retired.discard(voice_id)
        self.removed.append(voice_id)


def run_with_service(tmp_path: Path, body: Any) -> Any:
    async def main() -> Any:
        backend = RegisteringBackend()
        engine = Engine(backend, EngineConfig(warmup_text=""))
        await engine.start()
        service = VoiceService(VoiceConfig(data_dir=tmp_path, default_voice="v"), engine,
                               VoiceCatalog())
        await service.start()
        try:
            await service.register(VoiceUpload(audio=make_wav(2.0, rate=16000), transcript="Hi.",
                                               voice_id="ada", name="Ada"))
            return await body(backend, engine, service)
        finally:
            await service.stop()
            await engine.stop()

    return asyncio.run(main())


def test_the_engine_forgets_a_deleted_voice_only_when_the_session_speaking_it_lets_go(
        tmp_path: Path) -> None:
    async def body(backend: RegisteringBackend, engine: Engine, service: VoiceService) -> None:
        session = Session("s", catalog=service.catalog, sample_rate=engine.sample_rate,
                          options=SessionOptions(voice="ada", codec="pcm16", sample_rate=16000))
        await service.delete("ada")
        assert "ada" not in service.catalog.listed
        assert "ada" not in {v.voice_id for v in engine.voices}
        assert backend.retired == {"ada"} and backend.removed == []
        # The session still speaks it, through the real engine.
        (request,) = [a.request for a in say(session, "c", "Still here. ") if isinstance(a, Submit)]
        actions = [a for chunk in [c async for c in engine.submit(request)]
                   for a in session.receive_audio(chunk, 0.1)]
        assert sent(actions, "context.done")[0]["audio_ms"] > 0
        assert backend.removed == []  # the session itself still holds it
        session.disconnect()
        # the service removes it in a task of its own
        await async_wait_until(lambda: backend.removed, timeout=5.0, message="never removed")
        assert backend.removed == ["ada"] and backend.retired == set()

    run_with_service(tmp_path, body)


def test_a_deleted_voice_nobody_holds_leaves_the_engine_at_once(tmp_path: Path) -> None:
    async def body(backend: RegisteringBackend, engine: Engine, service: VoiceService) -> None:
        assert "ada" in service.catalog.listed and "ada" in {v.voice_id for v in engine.voices}
        await service.delete("ada")
        assert backend.removed == ["ada"] and "ada" not in service.catalog.listed

    run_with_service(tmp_path, body)


def test_a_voice_registered_again_while_held_is_not_removed_by_the_old_holder(
        tmp_path: Path) -> None:
    async def body(backend: RegisteringBackend, engine: Engine,
                   service: VoiceService) -> tuple[RegisteringBackend, VoiceService]:
        session = Session("s", catalog=service.catalog, sample_rate=engine.sample_rate,
                          options=SessionOptions(voice="ada"))
        await service.delete("ada")
        await service.register(VoiceUpload(audio=make_wav(2.0, rate=16000), transcript="Hi again.",
                                           voice_id="ada", name="Ada 2"))
        assert not service.catalog.is_retired("ada")
        session.disconnect()
        assert service.catalog.num_holders("ada") == 0  # the old holder let go
        return backend, service

    # Checked after the service stopped: `stop` waits for every removal it scheduled, so one
    # the old holder's release had set off would have run by then.
    backend, service = run_with_service(tmp_path, body)
    assert backend.removed == [] and backend.registered == {"ada": "Ada 2"}
    assert "ada" in service.catalog.listed


def test_a_socket_holding_a_deleted_voice_never_gets_another_tenants_voice_under_its_id(
        tmp_path: Path) -> None:
    from gateway.access.keys import Principal

    alice, bob = Principal("a" * 32), Principal("b" * 32)

    async def body(backend: RegisteringBackend, engine: Engine, service: VoiceService) -> None:
        def upload(name: str) -> VoiceUpload:
            return VoiceUpload(audio=make_wav(2.0, rate=16000), transcript="Hi.", voice_id="x",
                               name=name)

        await service.register(upload("Alice's"), owner=alice.tenant)
        session = Session("s", catalog=service.catalog.view(alice), sample_rate=engine.sample_rate,
                          options=SessionOptions(voice="x"))
        await service.delete("x", alice)
        assert service.catalog.is_retired("x")  # the socket still speaks with it
        for owner in (bob.tenant, ""):  # another tenant, or the operator (an --voice-for id alike)
            with pytest.raises(VoiceUploadError) as taken:
                await service.register(upload("Other"), owner=owner)
            assert (taken.value.status, taken.value.code) == (409, "voice_exists")
        # no add reached the engine: Alice's voice stays retired there, under her socket
        assert "x" in backend.retired and "x" not in backend.registered
        session.disconnect()
        await async_wait_until(lambda: backend.removed == ["x"], timeout=5.0)
        with pytest.raises(VoiceUploadError, match="is taken"):  # nobody holds it: still Alice's
            await service.register(upload("Bob's"), owner=bob.tenant)
        await service.register(upload("Alice's again"), owner=alice.tenant)
        assert backend.registered["x"] == "Alice's again"

    run_with_service(tmp_path, body)


def test_a_tenant_chooses_its_own_voices_and_the_shared_ones_and_an_admin_all() -> None:
    from gateway.access.keys import OPERATOR, Principal

    alice, bob = Principal("a" * 32), Principal("b" * 32)
    catalog = VoiceCatalog({"joe", "alice-1", "bob-1"}, owners={"alice-1": alice.tenant,
                                                                "bob-1": bob.tenant})
    catalog.add("alice-2", owner=alice.tenant)
    assert set(catalog.view(alice).listed) == {"joe", "alice-1", "alice-2"}
    assert "bob-1" not in catalog.view(alice).listed and "bob-1" in catalog.view(bob).listed
    assert len(catalog.view(bob).listed) == 2
    assert set(catalog.view(Principal("")).listed) == {"joe"}  # a keyless caller: the shared ones
    assert set(catalog.view(OPERATOR).listed) == catalog.listed  # an admin key, or auth off
    assert set(catalog.view(Principal("c" * 32, is_admin=True)).listed) == catalog.listed


def test_a_view_holds_in_the_shared_catalog_and_can_be_rekeyed() -> None:
    from gateway.access.keys import Principal

    alice = Principal("a" * 32)
    catalog = VoiceCatalog({"joe", "alice-1"}, owners={"alice-1": alice.tenant})
    view = catalog.view(Principal(""))
    assert "alice-1" not in view.listed
    view.rekey(alice)  # a socket whose key came in its first message
    assert "alice-1" in view.listed
    view.hold("alice-1")
    assert catalog.num_holders("alice-1") == 1
    view.release("alice-1")
    assert catalog.num_holders("alice-1") == 0


def test_the_catalog_lists_an_id_for_the_owner_of_its_last_registration() -> None:
    # Bookkeeping only: the service registers a deleted id again for its owner alone
    # (test_a_socket_holding_a_deleted_voice_never_gets_another_tenants_voice_under_its_id).
    from gateway.access.keys import Principal

    alice, bob = Principal("a" * 32), Principal("b" * 32)
    catalog = VoiceCatalog({"joe"})
    catalog.add("x", owner=alice.tenant)
    catalog.retire("x")
    catalog.add("x", owner=bob.tenant)
    assert "x" in catalog.view(bob).listed and "x" not in catalog.view(alice).listed
    catalog.retire("x")
    catalog.add("x")  # the operator's now: everyone's
    assert "x" in catalog.view(alice).listed and catalog.owner("x") == ""


def test_a_session_on_a_tenants_view_cannot_switch_to_another_tenants_voice() -> None:
    from gateway.access.keys import Principal

    alice, bob = Principal("a" * 32), Principal("b" * 32)
    catalog = VoiceCatalog({"joe", "alice-1"}, owners={"alice-1": alice.tenant})
    session = Session("s", catalog=catalog.view(bob), sample_rate=16000)
    (error,) = sent(session.receive_frame(json.dumps({"type": "session.update",
                                                      "voice": "alice-1"}),
                                          0.0), "error")
    assert error["code"] == "unknown_voice" and "joe" not in error["message"]
    assert catalog.num_holders("alice-1") == 0


def test_the_unknown_voice_message_names_the_id_asked_for_and_nothing_else() -> None:
    from gateway.voices.catalog import unknown_voice_message

    assert unknown_voice_message("nope") == ("unknown voice 'nope'; GET /v1/voices lists the "
                                             "voices this key may use")
    assert len(unknown_voice_message("x" * 10000)) < 200
