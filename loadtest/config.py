"""The load generator's settings, validated once, and the loopback guard."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from enum import Enum
from urllib.parse import urlsplit

MAX_DURATION_S = 3600.0
MAX_SESSIONS = 4096
MAX_RATE_PER_S = 500.0
MAX_TURNS = 1_000_000


class Protocol(str, Enum):
    """What the target speaks."""

    VOXGATE = "voxgate"  # the /v1/stream WebSocket (docs/protocol.md)
    PIPER_HTTP = "piper-http"  # piper's Flask server: POST /synthesize -> whole WAV


@dataclass(slots=True)
class LoadConfig:
    """How every simulated session behaves (the same for a target and its anchor)."""

    url: str
    protocol: Protocol = Protocol.VOXGATE
    corpus_path: str | None = None
    seed: int = 1
    token_rate: float = 40.0  # tokens per second an LLM streams
    token_jitter: float = 0.5  # each interval is 1/rate times U(1-j, 1+j)
    think_s: float = 2.0  # mean pause after playback ends, uniform within +-50%
    barge_in_rate: float = 0.0  # share of turns the listener interrupts
    barge_in_shares: tuple[float, float] = (0.1, 0.9)  # ... after U(low, high) of the audio
    playout_delay_ms: float = 0.0  # the player's jitter buffer
    turn_timeout_s: float = 60.0
    drain_s: float = 15.0  # how long running turns may finish after the run's end
    max_turns: int = MAX_TURNS  # per run (a load level), over all sessions
    encoding: str = "msgpack"  # event encoding asked of the server; client frames match
    query: dict[str, str] = field(default_factory=dict)  # codec, voice, ... (URL query)
    session_options: dict[str, object] = field(default_factory=dict)  # sent as session.update
    allow_remote: bool = False

    def __post_init__(self) -> None:
        self.protocol = Protocol(self.protocol)
        if self.token_rate <= 0 or self.token_rate > 10_000:
            raise ValueError(
                f"expected token_rate within (0, 10000] tokens/s, got {self.token_rate}")
        if not 0.0 <= self.token_jitter < 1.0:
            raise ValueError(f"expected token_jitter within [0, 1), got {self.token_jitter}")
        if self.think_s < 0:
            raise ValueError(f"expected think_s >= 0, got {self.think_s}")
        if not 0.0 <= self.barge_in_rate <= 1.0:
            raise ValueError(f"expected barge_in_rate within [0, 1], got {self.barge_in_rate}")
        low, high = self.barge_in_shares
        if not 0.0 <= low <= high <= 1.0:
            raise ValueError(f"expected barge-in shares 0 <= low <= high <= 1, got {low}, {high}")
        if self.playout_delay_ms < 0:
            raise ValueError(f"expected playout_delay_ms >= 0, got {self.playout_delay_ms}")
        if not 0 < self.turn_timeout_s <= MAX_DURATION_S:
            raise ValueError(f"expected turn_timeout_s within (0, 3600], got {self.turn_timeout_s}")
        if not 0 <= self.drain_s <= 600:
            raise ValueError(f"expected drain_s within [0, 600], got {self.drain_s}")
        if not 1 <= self.max_turns <= MAX_TURNS:
            raise ValueError(f"expected max_turns within 1-{MAX_TURNS}, got {self.max_turns}")
        if self.encoding not in ("msgpack", "json"):
            raise ValueError(f"expected encoding 'msgpack' or 'json', got {self.encoding!r}")
        check_target(self.url, self.allow_remote)


def check_target(url: str, allow_remote: bool) -> None:
    """Refuse a target that is not on loopback unless remote load is allowed.

    A load generator pointed at someone else's server is a denial of service;
    only an explicit --allow-remote lifts the guard.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https", "ws", "wss"):
        raise ValueError(f"expected an http(s):// or ws(s):// URL, got {url!r}")
    host = parts.hostname
    if not host:
        raise ValueError(f"expected a host in the URL, got {url!r}")
    if allow_remote or is_loopback(host):
        return
    raise ValueError(
        f"refusing non-loopback target {host!r}: expected 127.0.0.0/8, ::1 or localhost; "
        "pass --allow-remote to load a server you own elsewhere")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:  # a name: every address it resolves to must be loopback
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)
