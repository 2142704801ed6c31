"""What every route and socket of one app shares: the config, the engine, the open sockets,
the voice catalog, the admission counters, the engine's fair share and the audio encoders.

Its own module so that the parts that read it (gateway/access/admission.py, the
sockets, Ray's replicas) need not import the app that builds it (gateway/app.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.client import EngineClient
from gateway.access.fair_share import FairShare, FairShareConfig
from gateway.access.keyless import KeylessPool
from gateway.access.keys import KeyCounter
from gateway.access.tokens import SessionTokens
from gateway.audio.encoders import EncoderFactory
from gateway.config import GatewayConfig
from gateway.metrics import Metrics
from gateway.stream.encoding import EncodeQueue, EncodeWorker
from gateway.text.routing import Languages
from gateway.voices.catalog import VoiceCatalog


class OpenSocket(Protocol):
    """An open socket as the app sees it (gateway/stream/endpoint.py's `Connection`): counted
    in the gauges, closed at shutdown."""

    @property
    def num_open_contexts(self) -> int: ...

    def close_going_away(self) -> None: ...


@dataclass(slots=True)
class AppState:
    config: GatewayConfig
    engine: EngineClient
    metrics: Metrics
    connections: set[OpenSocket] = field(default_factory=set)
    catalog: VoiceCatalog = field(default_factory=VoiceCatalog)  # what sessions may speak with
    languages: Languages = field(init=False)  # what each voice speaks, for routing by language
    # admitted sockets (access/admission.py)
    key_counter: KeyCounter = field(default_factory=KeyCounter)
    # sockets waiting for a first-message key (access/keyless.py)
    keyless: KeylessPool = field(init=False)
    session_tokens: SessionTokens = field(default_factory=SessionTokens)
    encoders: EncoderFactory = field(default_factory=EncoderFactory)  # every output's encoder
    #: what runs the sockets' encodes: the event loop, most urgent first, or with
    #: `encode_on_thread` a worker thread, in arrival order (gateway/stream/encoding.py)
    encoding: EncodeQueue | EncodeWorker = field(init=False)
    is_shutting_down: bool = False
    # engine contexts per client (gateway/access/fair_share.py)
    fair_share: FairShare = field(init=False)

    def __post_init__(self) -> None:
        engine = self.engine
        self.encoding = EncodeWorker() if self.config.encode_on_thread else EncodeQueue()
        self.keyless = KeylessPool(self.config.max_keyless_sockets,
                                   self.config.max_keyless_sockets_per_address)
        self.languages = Languages.from_listing(lambda: engine.voices, self.config.voice_for)
        self.fair_share = FairShare(self.engine.admit, self.engine.release_context,
                                    self.engine.scheduler.max_contexts,
                                    FairShareConfig(self.config.engine_share))
        self.metrics.track_state(lambda: len(self.connections), self.num_open_contexts)

    def num_open_contexts(self) -> int:
        return sum(c.num_open_contexts for c in self.connections)
