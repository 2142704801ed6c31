"""What crosses the handle hop between the tiers: the engine's plain data, and Ray's extras.

Ray pickles whatever a call carries; the maps are engine/wire.py's (requests,
chunks, errors, voices), so the tiers may differ by a build during a rolling
upgrade. A request also names the gateway that sent it (the replica's lease on
its contexts), and still carries `deadline_in_s` for a replica of a build
before the engine owned every due time: 0.0, due on arrival. A chunk goes
under its request's stream, and an older replica's has no id: the caller
gives it (`chunk_from_wire`).
"""

from __future__ import annotations

from typing import Any

from engine import wire
from engine.types import SynthesisRequest
from engine.wire import (
    chunk_from_wire,
    chunk_to_wire,
    error_from_wire,
    request_from_wire,
    voice_from_wire,
    voice_to_wire,
)

__all__ = ["chunk_from_wire", "chunk_to_wire", "error_from_wire", "error_to_wire",
           "request_from_wire", "request_to_wire", "voice_from_wire", "voice_to_wire"]


def request_to_wire(request: SynthesisRequest, gateway_id: str) -> dict[str, Any]:
    # `deadline_in_s` is read by a replica of the build before only: due on arrival
    return {**wire.request_to_wire(request), "gateway": gateway_id, "deadline_in_s": 0.0}


def error_to_wire(exc: BaseException) -> dict[str, Any]:
    """An error for the gateway: its wire code and a message safe to show a client."""
    return wire.error_to_wire(exc, "speech synthesis failed for this segment")
