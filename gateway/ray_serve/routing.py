"""Engine-tier routing: a context's requests go to the replica that admitted it.

Serve's default router picks the less loaded of two random replicas for each
call. voxgate's admission is per context on one replica's scheduler, so a
call that names `replica=<unique id>` goes to that replica; a call without
one, or naming a replica that is gone, is routed the default way (and the
replica it reaches admits the context itself, or answers `busy`).

Each process's routers also publish the replica ids they can reach
(`live_replicas`), which is how a `RemoteEngine` learns the engine tier's
membership without asking the controller.
"""

from __future__ import annotations

import asyncio
import importlib
import random
from typing import Any

from ray.serve.request_router import (  # type: ignore[attr-defined, unused-ignore]  # public, re-exported
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

_LIVE: dict[str, tuple[str, ...]] = {}  # deployment name -> replica unique ids


def live_replicas(deployment: str) -> tuple[str, ...]:
    """The replica ids this process's router last saw for `deployment` (empty before its first
    call)."""
    return _LIVE.get(deployment, ())


class PinnedRouter(RequestRouter):  # type: ignore[misc, unused-ignore]  # Any without Ray installed
    """Route to the replica a call names; otherwise to the less loaded of two."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # Through the imported module: Serve may ship this class by value, and a copy's
        # globals are not the module's.
        importlib.import_module(__name__)._LIVE[self._deployment_id.name] = tuple(
            r.replica_id.unique_id for r in replicas)

    async def _select_from_candidate_replicas(self, candidates: list[RunningReplica],
                                              backoff_index: int) -> RunningReplica | None:
        # Serve's version asks each candidate for its queue length first (an actor call
        # with a 0.1 s deadline). On a busy CPU node those time out, pile up in the
        # replica's task queue ahead of real calls, and starve it. The engine tier routes
        # by admission, so the choice made in `choose_replicas` is final.
        # It must still yield: a routing task with no request of its own loops here until
        # the task that holds the request has routed it, on the same event loop.
        await asyncio.sleep(0)
        for replica in candidates:
            live = self._replicas.get(replica.replica_id)
            if live is not None:
                return live
        return None

    async def choose_replicas(
            self, candidate_replicas: list[RunningReplica],
            pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:  # a routing task without a request of its own: the oldest
            pending_request = self._oldest_unrouted()
        wanted = _wanted(pending_request)
        if pending_request is not None:
            # Back off between tries when the chosen replica is full or still starting
            # (without this Serve retries at once, in a tight loop of queue probes).
            pending_request.routing_context.should_backoff = True
        if wanted:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == wanted:
                    return [[replica]]
        if len(candidate_replicas) <= 2:
            return [list(candidate_replicas)]
        return [random.sample(candidate_replicas, 2)]

    def _fulfill_next_pending_request(self, replica: RunningReplica,
                                      request_metadata: Any = None) -> None:
        # Serve's version hands a replica chosen by a task without a request of its own to
        # nobody (and such a task may have taken a request off the routing queue): that
        # request would wait forever. Here it goes to the oldest request that may use it.
        matched = self._get_pending_request_matching_internal_request_id(request_metadata)
        if matched is None:
            live = {r.replica_id.unique_id for r in self._replicas_list}
            chosen = replica.replica_id.unique_id
            matched = next((pr for pr in self._pending_requests_to_fulfill if not pr.future.done()
                            and _wanted(pr) in ("", chosen) or (not pr.future.done()
                                                               and _wanted(pr) not in live)), None)
        if matched is not None:
            self._record_queue_wait_time(matched)
            matched.future.set_result(replica)
            self._remove_pending_request_from_indices(matched)

    def _oldest_unrouted(self) -> PendingRequest | None:
        return next((pr for pr in self._pending_requests_to_fulfill if not pr.future.done()), None)


def _wanted(pending_request: PendingRequest | None) -> str:
    """The replica a call names (`replica=` keyword), or ""."""
    if pending_request is None:
        return ""
    return str(pending_request.kwargs.get("replica") or "")
