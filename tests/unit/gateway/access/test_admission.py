"""The one admission of every socket, driven without a socket: checks in order, counts, re-keying.

`admit` reads only the handshake's headers and client address, so a Starlette
`HTTPConnection` over a plain scope stands in for the socket here; the routes
themselves are tested over real sockets in tests/e2e/test_admission.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.requests import HTTPConnection

from engine.engine import Engine, EngineConfig
from engine.scheduler import SchedulerConfig
from gateway.access.admission import Admission, Refused, admit
from gateway.access.keys import AuthConfig, tenant_of
from gateway.config import GatewayConfig
from gateway.errors import ShareExceededError
from gateway.metrics import Metrics
from gateway.state import AppState
from tests.support.scripted_backend import ScriptedBackend

KEY = "sk-admission-0001"
OTHER = "sk-admission-0002"
HINT = "Authorization: Bearer <key>"


def make_state(tmp_path: Path, *, max_engine_contexts: int = 16, **config: object) -> AppState:
    engine = Engine(ScriptedBackend(),
                    EngineConfig(scheduler=SchedulerConfig(max_contexts=max_engine_contexts),
                                 warmup_text=""))
    gateway = GatewayConfig(voice="v", data_dir=tmp_path, auth=AuthConfig(api_keys=(KEY, OTHER)),
                            **config)  # type: ignore[arg-type]
    return AppState(gateway, engine, Metrics(engine))


def handshake(origin: str | None = None, host: str = "10.0.0.7") -> HTTPConnection:
    headers = [(b"host", b"voice.example")]
    if origin:
        headers.append((b"origin", origin.encode()))
    return HTTPConnection({"type": "websocket", "path": "/v1/stream", "headers": headers,
                           "client": (host, 5000), "query_string": b""})


def refusal(state: AppState, key: str | None, **kwargs: object) -> Refused:
    with pytest.raises(Refused) as caught:
        admit(state, kwargs.pop("connection", handshake()), key, protocol="native",  # type: ignore[arg-type]
              key_hint=HINT, **kwargs)  # type: ignore[arg-type]
    return caught.value


def test_the_checks_run_in_order_key_origin_shutdown_sessions_owner(tmp_path: Path) -> None:
    state = make_state(tmp_path, max_sessions=2, max_sockets_per_key=1)
    state.is_shutting_down = True
    evil = handshake(origin="https://evil.example")
    first = refusal(state, None, connection=evil)  # everything is wrong: the key is said first
    assert (first.code, first.close_code, first.reason) == ("unauthorized", 4401, "unauthorized")
    assert HINT in first.message and first.fatal
    second = refusal(state, KEY, connection=evil)
    assert (second.close_code, second.reason) == (4403, "forbidden_origin")
    third = refusal(state, KEY)
    assert (third.code, third.close_code, third.reason) == ("busy", 1001, "shutting_down")
    state.is_shutting_down = False
    with admit(state, handshake(), KEY, protocol="native", key_hint=HINT):
        fourth = refusal(state, KEY)
        assert (fourth.code, fourth.close_code) == ("rate_limited", 1013)
        assert "this key" in fourth.message
        with admit(state, handshake(), OTHER, protocol="native", key_hint=HINT):
            fifth = refusal(state, OTHER)  # the session cap comes before the owner's
            assert (fifth.code, fifth.close_code) == ("busy", 1013)
            assert "2 sessions" in fifth.message
    assert state.key_counter.num_open == 0 and state.key_counter.counts == {}


def test_an_admitted_socket_holds_its_place_until_it_is_left_and_a_second_release_is_nothing(
        tmp_path: Path) -> None:
    state = make_state(tmp_path, max_sessions=5, max_sockets_per_key=5)
    admission = admit(state, handshake(), KEY, protocol="cartesia", key_hint=HINT)
    assert state.key_counter.num_open == 1 and admission.is_authorized
    assert admission.principal.tenant == tenant_of(KEY)
    with admission:
        pass
    admission.release()
    assert state.key_counter.num_open == 0
    text = state.metrics.render().decode()
    assert 'voxgate_socket_admissions_total{protocol="cartesia",result="admitted"} 1.0' in text


def test_a_deferred_key_is_admitted_on_its_address_then_rekeyed_onto_the_keys_count(
        tmp_path: Path) -> None:
    state = make_state(tmp_path, max_sockets_per_key=1)
    keyless = admit(state, handshake(), None, protocol="elevenlabs", key_hint="xi_api_key",
                    defer_auth=True)
    assert not keyless.is_authorized and keyless.owner == "addr:10.0.0.7"
    with pytest.raises(Refused) as wrong:
        keyless.rekey("sk-not-a-key-000")
    assert (wrong.value.code, wrong.value.close_code) == ("unauthorized", 4401)
    keyless.rekey(KEY)
    assert keyless.is_authorized and keyless.owner.startswith("key:")
    assert keyless.principal.tenant == tenant_of(KEY)
    assert state.key_counter.counts == {keyless.owner: 1}  # the address let go
    # the key's one place is taken: a second socket with it is refused, at the door or on rekey
    assert refusal(state, KEY).code == "rate_limited"
    late = admit(state, handshake(host="10.0.0.8"), None, protocol="elevenlabs", key_hint="x",
                 defer_auth=True)
    with pytest.raises(Refused) as full:
        late.rekey(KEY)
    assert (full.value.code, full.value.close_code) == ("rate_limited", 1013)
    late.release()
    keyless.release()
    assert state.key_counter.num_open == 0


def test_contexts_take_engine_capacity_in_the_owners_fair_share(tmp_path: Path) -> None:
    state = make_state(tmp_path, max_engine_contexts=2, max_engine_share=0.5)
    with admit(state, handshake(), KEY, protocol="native", key_hint=HINT) as admission:
        admission.admit_context("s/a")
        assert state.fair_share.num_held(admission.owner) == 1
        with pytest.raises(ShareExceededError):
            admission.admit_context("s/b")  # one of two contexts is this owner's share
        admission.release_context("s/a")
        assert state.fair_share.num_held(admission.owner) == 0


def keyless(state: AppState, host: str = "10.0.0.7") -> Admission:
    return admit(state, handshake(host=host), None, protocol="elevenlabs", key_hint="xi_api_key",
                 defer_auth=True)


def test_sockets_waiting_for_their_key_take_the_keyless_pool_not_the_session_cap(
        tmp_path: Path) -> None:
    state = make_state(tmp_path, max_sessions=1, max_keyless_sockets=3,
                       max_keyless_sockets_per_address=2)
    waiting = [keyless(state), keyless(state), keyless(state, host="10.0.0.8")]
    assert state.key_counter.num_open == 0 and state.keyless.num_open == 3
    with admit(state, handshake(), KEY, protocol="native", key_hint=HINT):  # the server is not full
        assert refusal(state, OTHER).code == "busy"  # but now it is: one session
    full = refusal(state, None, connection=handshake(host="10.0.0.9"), defer_auth=True)
    assert (full.code, full.close_code) == ("busy", 1013)
    assert "3 sockets are waiting" in full.message
    waiting[2].release()
    mine = refusal(state, None, defer_auth=True)  # 10.0.0.7 holds its two places
    assert (mine.code, mine.close_code) == ("rate_limited", 1013)
    assert "from this address" in mine.message
    third = keyless(state, host="10.0.0.9")
    for admission in (*waiting, third):
        admission.release()
    assert state.keyless.num_open == 0 and state.keyless.counts == {}


def test_a_key_that_comes_takes_a_session_place_and_gives_its_keyless_one_back(
        tmp_path: Path) -> None:
    state = make_state(tmp_path, max_sessions=1)
    first, second = keyless(state), keyless(state)
    first.rekey(KEY)
    assert state.keyless.num_open == 1 and state.key_counter.num_open == 1
    with pytest.raises(Refused) as full:  # the session cap counts it once its key came
        second.rekey(OTHER)
    assert (full.value.code, full.value.close_code) == ("busy", 1013)
    assert state.keyless.num_open == 1  # still waiting, until its session closes it
    second.release()
    first.release()
    first.release()
    assert state.keyless.num_open == 0 and state.key_counter.num_open == 0


def test_the_keyless_pool_checks_its_sizes() -> None:
    with pytest.raises(ValueError, match="max_keyless_sockets_per_address <= max_keyless_sockets"):
        GatewayConfig(max_keyless_sockets=4, max_keyless_sockets_per_address=5)
    with pytest.raises(ValueError, match="got 0 and 64"):
        GatewayConfig(max_keyless_sockets_per_address=0)
