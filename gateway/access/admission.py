"""The door of every socket: one admission, in one order, for `/v1/stream` and each vendor route.

`admit` runs before a socket is accepted, and nothing is done for a socket
before it passes (docs/protocol.md, "Errors": `unauthorized` closes with 4401):

1. the key, wherever the caller found it (each vendor sends it its own way);
   a caller may defer it to the first message (ElevenLabs' `xi_api_key`);
2. the browser origin (`--allowed-origins`; gateway/access/origins.py);
3. shutdown: a draining server takes no new socket;
4. the server's session cap (`max_sessions`);
5. the socket cap of the socket's owner (`max_sockets_per_key`).

A socket whose key is deferred and not yet come takes neither 4 nor 5: it takes
a place in the keyless pool (gateway/access/keyless.py), so sockets that never
send a key cannot fill the server; when the key comes, `rekey` takes 4 and 5
for it, as if the key had come at the handshake.

A refusal raises `Refused`, a fatal ProtocolError with its close code; the
caller shapes it (the native `error` event, or the vendor's error frame) and
closes. An admitted socket holds its place in the counts until its
`Admission` is left (it is a context manager), and its contexts take the
engine's capacity through the owner's fair share (`admit_context`).

The owner is who pays (gateway/access/fair_share.py, `owner_of`): the key with
auth on, the client's address with auth off or before a deferred key comes.
The principal is the tenant the key names (gateway/access/keys.py). `rekey`
takes a deferred key when it comes: it checks it, moves the socket from the
keyless pool into the session cap and the key owner's count, and so the engine
share of the contexts it opens from then on, and its principal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, final

from starlette.requests import HTTPConnection

from gateway.access.fair_share import owner_of
from gateway.access.keys import Principal, is_authorized, principal_of
from gateway.access.origins import is_origin_allowed
from gateway.errors import (
    CLOSE_FORBIDDEN,
    CLOSE_GOING_AWAY,
    CLOSE_TRY_AGAIN_LATER,
    CLOSE_UNAUTHORIZED,
    ProtocolError,
)

if TYPE_CHECKING:
    from types import TracebackType

    from gateway.state import AppState

#: results counted per protocol in `voxgate_socket_admissions_total`
RESULTS = ("admitted", "unauthorized", "forbidden_origin", "shutting_down", "busy", "rate_limited")


class Refused(ProtocolError):
    """A socket refused at the door: fatal, with the close code that follows its error and
    the `reason` it is counted under (one of RESULTS)."""

    def __init__(self, code: str, message: str, close_code: int, *,
                 reason: str | None = None) -> None:
        super().__init__(code, message, fatal=True)
        self.close_code = close_code
        self.reason = reason or code


@final
@dataclass(slots=True)
class Admission:
    """One admitted socket: its owner, its principal (the tenant its key names), whether
    its key was checked, and its place in the counts."""

    state: AppState
    protocol: str
    owner: str
    principal: Principal
    client_host: str | None
    key_hint: str
    is_authorized: bool
    is_held: bool = True  # a place in the counts: the keyless pool's until the key came

    def admit_context(self, context_key: str) -> None:
        """Engine capacity for one of this socket's contexts, within its owner's share."""
        self.state.fair_share.admit(self.owner, context_key)

    def release_context(self, context_key: str) -> None:
        self.state.fair_share.release(context_key)

    def rekey(self, key: str | None) -> None:
        """The key came after the handshake (in the first message): check it, and count the
        socket in the session cap and against the key's owner from now on. Raises `Refused`."""
        config = self.state.config
        if not is_authorized(config.auth, key):
            self.state.metrics.observe("error:unauthorized", 1)
            raise Refused("unauthorized", f"a valid API key is required: {self.key_hint}",
                          CLOSE_UNAUTHORIZED)
        owner = owner_of(key, self.client_host, is_auth_enabled=config.auth.is_enabled)
        if self.is_held and not self.is_authorized:  # from the keyless pool to the counts
            _take_place(self.state, owner, "key")
            self.state.keyless.release(self.client_host or "")
        self.owner = owner
        self.principal = principal_of(config.auth, key)
        self.is_authorized = True

    def release(self) -> None:
        """Give back the socket's place in the counts (idempotent)."""
        if self.is_held:
            self.is_held = False
            if self.is_authorized:
                self.state.key_counter.release(self.owner)
            else:
                self.state.keyless.release(self.client_host or "")

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()


def admit(state: AppState, connection: HTTPConnection, key: str | None, *, protocol: str,
          key_hint: str, defer_auth: bool = False) -> Admission:
    """Admit a socket (the checks in the module doc, in order) or raise `Refused`.

    `key`: the key the socket presented at the handshake, where its protocol puts
    it; `key_hint` says where that is, for the refusal. `defer_auth`: without a
    valid key the socket is still admitted, unauthorized, on its address; its
    session must take the key from its first message (`Admission.rekey`).
    """
    try:
        admission = _check(state, connection, key, protocol, key_hint, defer_auth)
    except Refused as refusal:
        state.metrics.admissions.labels(protocol=protocol, result=refusal.reason).inc()
        raise
    state.metrics.admissions.labels(protocol=protocol, result="admitted").inc()
    return admission


def _check(state: AppState, connection: HTTPConnection, key: str | None, protocol: str,
           key_hint: str, defer_auth: bool) -> Admission:
    config = state.config
    metrics = state.metrics
    authorized = is_authorized(config.auth, key)
    if not authorized and not defer_auth:
        metrics.observe("error:unauthorized", 1)
        raise Refused("unauthorized", f"a valid API key is required: {key_hint}",
                      CLOSE_UNAUTHORIZED)
    headers = connection.headers
    if not is_origin_allowed(config.auth, headers.get("origin"), headers.get("host")):
        raise Refused("unauthorized", "this origin is not allowed (see --allowed-origins)",
                      CLOSE_FORBIDDEN, reason="forbidden_origin")
    if state.is_shutting_down:
        raise Refused("busy", "the server is shutting down", CLOSE_GOING_AWAY,
                      reason="shutting_down")
    host = connection.client.host if connection.client else None
    if not authorized:  # its key is to come in its first message: it waits in the keyless pool
        pool = state.keyless
        why = pool.acquire(host or "")
        if why is not None:
            metrics.observe(f"error:{why}", 1)
            held = (f"{pool.max_sockets} sockets are" if why == "busy"
                    else f"{pool.max_per_address} sockets from this address are")
            raise Refused(why, f"{held} waiting for a key in their first message already; send "
                          f"the key at the handshake ({key_hint}) or try again later",
                          CLOSE_TRY_AGAIN_LATER)
        return Admission(state, protocol,
                         owner_of(None, host, is_auth_enabled=config.auth.is_enabled),
                         principal_of(config.auth, None), host, key_hint, is_authorized=False)
    # The key with auth on; with auth off, any key passes, so the client's address
    # (gateway/access/fair_share.py): the socket cap and the engine share are per owner.
    owner = owner_of(key, host, is_auth_enabled=config.auth.is_enabled)
    _take_place(state, owner, "key" if config.auth.is_enabled else "client address")
    return Admission(state, protocol, owner, principal_of(config.auth, key), host, key_hint,
                     is_authorized=True)


def _take_place(state: AppState, owner: str, who: str) -> None:
    """A place in the session cap and in `owner`'s socket count, or `Refused`."""
    config = state.config
    counter = state.key_counter
    if counter.num_open >= config.max_sessions:
        state.metrics.observe("error:busy", 1)
        raise Refused("busy", f"the server holds {config.max_sessions} sessions; try again later",
                      CLOSE_TRY_AGAIN_LATER)
    if not counter.acquire(owner, config.max_sockets_per_key):
        state.metrics.observe("error:rate_limited", 1)
        raise Refused("rate_limited", f"this {who} holds {config.max_sockets_per_key} sockets "
                      "already", CLOSE_TRY_AGAIN_LATER)
