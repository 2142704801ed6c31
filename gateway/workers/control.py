"""A worker's synchronous calls to the engine process: admission, as the session needs it.

The sans-I/O session admits a context synchronously (engine/client.py), and a
socket's place in the counts is taken with no await between the check and the
count (gateway/access/keys.py). So these calls are a blocking round trip on a
connection of their own (`ControlLink`): the worker's event loop stops for it
once per turn and once per socket handshake (and for a session token, issued or
redeemed). Measured on a 2-core box against an idle engine process: 20-30 us at
the median, 0.3 ms at p99; it is longer while the engine process's own event
loop is busy (it answers between its other work). A view
refreshed by polling, as Ray's `RemoteEngine` keeps, would let two workers both
give away the last place of a key's share; a round trip keeps the one
`FairShare` and the one `KeyCounter` of the engine process (host.py) exact.
Releases need no answer and are only sent, on the same connection, so a release
is always counted before the next admission.

An engine process that does not answer within `timeout_s` is taken as full:
the call raises `EngineBusyError`, the link is dropped and opened again on the
next call (the engine process releases what the dropped link held).
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import Any

from engine.errors import EngineBusyError
from gateway.access.fair_share import FairShare
from gateway.access.keys import KeyCounter
from gateway.access.tokens import SessionTokens
from gateway.errors import ShareExceededError
from gateway.workers import wire
from gateway.workers.channel import FrameError, pack, recv_frame

log = logging.getLogger("voxgate.gateway")


class ControlLink:
    """The blocking connection for calls that must be answered before the caller goes on."""

    def __init__(self, path: Path, worker: int, timeout_s: float = 2.0) -> None:
        self.path = path
        self.worker = worker
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._next_id = 0

    def _connected(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(str(self.path))
            except OSError:
                sock.close()
                raise
            self._sock = sock
            self._round_trip("hello", {"worker": self.worker})
        return self._sock

    def call(self, op: str, **args: Any) -> Any:
        """The engine process's answer to `op`; raises its error as the engine would."""
        try:
            self._connected()
            return self._round_trip(op, args)
        except (OSError, FrameError) as exc:
            self.close()
            log.error("the engine process did not answer %s: %r", op, exc)
            raise EngineBusyError("the engine process did not answer; try again shortly") from None

    def _round_trip(self, op: str, args: dict[str, Any]) -> Any:
        assert self._sock is not None
        self._next_id += 1
        call_id = self._next_id
        self._sock.sendall(pack([{"op": op, "id": call_id, "args": args}]))
        while True:
            for message in recv_frame(self._sock):
                if message["op"] != "reply" or message.get("id") != call_id:
                    continue  # a late answer to a call that timed out
                if "error" in message:
                    raise wire.error_from_wire(message)
                return message.get("result")

    def send(self, op: str, **fields: Any) -> None:
        """Send `op` with no answer awaited; lost with the link if it is down."""
        try:
            self._connected().sendall(pack([{"op": op, **fields}]))
        except (OSError, FrameError, EngineBusyError) as exc:
            self.close()
            log.error("the engine process did not take %s: %r", op, exc)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class SharedFairShare(FairShare):
    """The engine process's one `FairShare`, reached through `ControlLink` (module doc)."""

    def __init__(self, control: ControlLink) -> None:
        super().__init__(_not_here, _not_here, lambda: 0)
        self.control = control

    def admit(self, owner: str, context_key: str) -> None:
        try:
            self.control.call("admit", owner=owner, key=context_key)
        except ShareExceededError:
            self.num_refused += 1  # this worker's refusals
            raise

    def release(self, context_key: str) -> None:
        self.control.send("release", key=context_key)


class SharedKeyCounter(KeyCounter):
    """The engine process's one count of open sockets per owner (module doc)."""

    def __init__(self, control: ControlLink) -> None:
        super().__init__()
        self.control = control

    def acquire(self, key: str, limit: int) -> bool:
        try:
            return bool(self.control.call("acquire_socket", owner=key, limit=limit))
        except EngineBusyError:
            return False

    def release(self, key: str) -> None:
        self.control.send("release_socket", owner=key)

    @property
    def num_open(self) -> int:
        """Every worker's open sockets; with no answer, as many as to refuse the next one."""
        try:
            return int(self.control.call("num_sockets"))
        except EngineBusyError:
            return sys.maxsize

    @num_open.setter
    def num_open(self, value: int) -> None:
        pass  # the count is the engine process's


class SharedSessionTokens(SessionTokens):
    """The engine process's one table of session tokens: a token issued through one worker
    opens a socket on any (the socket rarely reaches the worker that answered the POST)."""

    def __init__(self, control: ControlLink, ttl_s: float = 60.0) -> None:
        super().__init__(ttl_s=ttl_s)  # the engine process's, as this worker's answer says it
        self.control = control

    def issue(self, key: str, now: float) -> tuple[str, float] | None:
        try:
            issued = self.control.call("issue_token", key=key, now=now)
        except EngineBusyError:
            return None
        return None if issued is None else (str(issued[0]), float(issued[1]))

    def redeem(self, token: str, now: float) -> str | None:
        try:
            key = self.control.call("redeem_token", token=token, now=now)
        except EngineBusyError:
            return None
        return None if key is None else str(key)

    def num_outstanding(self, key: str) -> int:
        try:
            return int(self.control.call("num_tokens", key=key))
        except EngineBusyError:
            return 0


def _not_here(context_key: str) -> None:
    raise AssertionError("a worker's fair share is the engine process's")
