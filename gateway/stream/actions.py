"""What the sans-I/O session asks its I/O loop to do: actions as frozen dataclasses.

`Session` returns a list of these from every call; `gateway/stream/endpoint.py` carries
them out in order (`Connection._execute`), and tests read them directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.types import RequestId, SynthesisRequest
from gateway.stream.events import AudioEvent, Event


@dataclass(slots=True, frozen=True)
class Send:
    """A server event for the socket, encoded in the session's encoding (audio as audio frames)."""

    message: Event

    @property
    def is_audio(self) -> bool:
        return isinstance(self.message, AudioEvent)


@dataclass(slots=True, frozen=True)
class SendFrame:
    """A frame already in its wire shape (the vendor sockets, gateway/compat, shape their own)."""

    frame: str | bytes


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


Action = Send | SendFrame | Submit | Cancel | Close | Observe
