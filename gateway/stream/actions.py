"""What the sans-I/O session asks its I/O loop to do: actions as frozen dataclasses.

`Session` returns a list of these from every call; `gateway/stream/endpoint.py` carries
them out in order (`Connection._execute`), and tests read them directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.types import RequestId, SynthesisRequest


@dataclass(slots=True, frozen=True)
class Send:
    """A server message for the socket; `is_audio` ones are encoded as audio frames."""

    message: dict[str, Any]
    is_audio: bool = False


@dataclass(slots=True, frozen=True)
class Submit:
    """Start an engine request and feed its chunks back to `Session.receive_audio`."""

    request: SynthesisRequest


@dataclass(slots=True, frozen=True)
class Cancel:
    """Cancel an engine request; none of its audio reaches the session after this."""

    request_id: RequestId


@dataclass(slots=True, frozen=True)
class Close:
    """Close the socket with this code after what is queued."""

    code: int
    reason: str = ""


@dataclass(slots=True, frozen=True)
class Observe:
    """A measurement for metrics (name, value)."""

    name: str
    value: float


Action = Send | Submit | Cancel | Close | Observe
