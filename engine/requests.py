"""The engine's request table: every submitted request between `submit` and its end.

Plain bookkeeping with the time passed in, no loop and no thread of its own:
each request's handle (engine/clock.py: its output queue and playback clock),
the new ones not yet prepared, each context's playback record, what waits
for its release on the worker thread, what is in a running step, and what a
backend said it could not run yet. Two threads read and change it: the
engine's loop thread (engine/loop.py) and the engine's face on the gateway's
event loop (engine/engine.py: submit, cancel, admission, a consumer taking a
chunk); each holds `lock` while it does, never across a wait, and the
scheduler's requests and admitted contexts are kept under the same lock.

A context's playback record lives while the context is admitted (until
`release_context`), so its next segment is due when the audio before it runs
out even once the requests before it have ended; the record of a context
that was never admitted (a request on its own, a bench) goes with its last
request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.backend import BackendRequest
from engine.clock import QUEUE_DEPTH, PlaybackRecord, RequestHandle
from engine.errors import EngineBusyError, EngineError
from engine.types import RequestId, SynthesisRequest


class RequestTable:
    """Submitted requests by id, and the contexts' playback records."""

    def __init__(self, max_pending: int, is_admitted: Callable[[str], bool]) -> None:
        """`max_pending`: requests held at most; `is_admitted(context_key)`: whether admission
        holds that context now (its record is then kept until `release_context`)."""
        self.max_pending = max_pending
        self.is_admitted = is_admitted
        #: held by whoever reads or changes the table or the scheduler (module doc)
        self.lock = threading.Lock()
        self.handles: dict[RequestId, RequestHandle] = {}
        self.incoming: list[RequestHandle] = []  # submitted, not yet prepared
        self.records: dict[str, PlaybackRecord] = {}
        self.to_release: list[BackendRequest] = []  # released on the worker before the next step
        self.in_flight: set[RequestId] = set()  # requests in a running step
        self.waiting: set[RequestId] = set()  # the backend could not run them yet

    def add(self, request: SynthesisRequest, now: float) -> RequestHandle:
        """A new request's handle, its clock placed after the audio before it (engine/clock.py)."""
        if request.request_id in self.handles:
            raise EngineError(f"request id {request.request_id!r} is already in use")
        if len(self.handles) >= self.max_pending:
            raise EngineBusyError(f"the engine holds {self.max_pending} requests already")
        key = request.context_key
        if key:
            record = self.records.get(key)
            if record is None:
                record = self.records[key] = PlaybackRecord(self.records.get(request.plays_after))
            handle = record.next_handle(request, now)
        else:  # a request on its own plays at once
            handle = RequestHandle(request, now)
        self.handles[request.request_id] = handle
        self.incoming.append(handle)
        return handle

    def end(self, handle: RequestHandle) -> None:
        """The request made its last audio, failed or was cancelled: it leaves the table."""
        handle.is_done = True
        self.handles.pop(handle.request.request_id, None)
        self.waiting.discard(handle.request.request_id)
        key = handle.request.context_key
        record = self.records.get(key) if key else None
        if record is not None and record.last is handle and not self.is_admitted(key):
            del self.records[key]  # no admission keeps it: it goes with its last request

    def release_context(self, context_key: str) -> None:
        """The context ended (admission released it): its record goes."""
        self.records.pop(context_key, None)

    def take_releases(self) -> list[BackendRequest]:
        """What was cancelled or finished and may be freed now: not in a running step."""
        releases = [item for item in self.to_release if item.request_id not in self.in_flight]
        self.to_release = [item for item in self.to_release if item.request_id in self.in_flight]
        return releases

    def is_runnable(self, item: BackendRequest) -> bool:
        """Not in a running step, not waiting on the backend, and its reader has room (fewer
        than `QUEUE_DEPTH` chunks routed and unread: a step adds at most one)."""
        request_id = item.request_id
        if request_id in self.in_flight or request_id in self.waiting:
            return False
        handle = self.handles.get(request_id)
        return handle is not None and handle.num_unread < QUEUE_DEPTH
