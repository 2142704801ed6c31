"""Prometheus metrics, one registry per app (so tests may build many apps).

Gauges of the app's state are read at scrape time (the engine's through a
collector, the sessions' and contexts' through `track_state`), never written
on the audio path.

Several processes: where prometheus_client runs in its multiprocess mode
(PROMETHEUS_MULTIPROC_DIR set before it is imported, as `voxgate serve
--workers N` does for its workers), each worker's counters and histograms live
in files in that folder, and `render` sums every worker's, so a scrape through
any worker reports the totals. The open sessions and contexts are summed over
the live workers from what each last wrote (`refresh`, which a worker runs
every half second and before its own scrape). The engine's counters come from
the engine, as always.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from engine.client import EngineClient
from engine.stats import FIRST_AUDIO_BUCKETS, STEP_BUCKETS

TTFA_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0)
# Late audio: how long after its playback time a message left (the server's view of a gap).
LATE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _EngineCollector(Collector):
    """Reads the engine's counters at scrape time."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self):  # type: ignore[no-untyped-def]
        e, s = self.engine.stats, self.engine.scheduler
        values = {
            "voxgate_engine_queue_depth": ("requests held by the scheduler", s.num_queued),
            "voxgate_engine_batch_size": ("size of the last batch", e.last_batch_size),
            "voxgate_engine_step_seconds": ("duration of the last backend step",
                                            e.last_step_seconds),
            "voxgate_engine_steps_total": ("backend steps run", e.num_steps),
            "voxgate_engine_busy_seconds_total": ("seconds spent in backend steps", e.busy_seconds),
            "voxgate_engine_audio_seconds_total": ("audio seconds synthesized", e.audio_seconds),
            "voxgate_engine_requests_submitted_total": ("requests submitted", e.num_submitted),
            "voxgate_engine_requests_cancelled_total": ("requests cancelled", e.num_cancelled),
            "voxgate_engine_requests_failed_total": ("requests failed", e.num_failed),
            "voxgate_engine_deadline_misses_total": ("batches that ended after a member's deadline",
                                                     s.stats.num_deadline_misses),
            "voxgate_engine_contexts_admitted_total": ("contexts admitted", s.stats.num_admitted),
            "voxgate_engine_contexts_refused_total": ("contexts refused with busy",
                                                      s.stats.num_refused),
            "voxgate_engine_active_contexts": ("contexts holding engine capacity", s.num_contexts),
            "voxgate_engine_max_contexts": ("admission limit on talking contexts",
                                            s.max_contexts()),
            "voxgate_engine_ready": ("1 when the engine is loaded and warmed",
                                     int(self.engine.is_ready)),
        }
        for name, (doc, value) in values.items():
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], float(value))
            yield family
        waits = GaugeMetricFamily("voxgate_engine_waits_total",
                                  "requests of a step the backend could not run yet, by reason",
                                  labels=["reason"])
        for reason, count in sorted(e.waits.items()):
            waits.add_metric([reason], float(count))
        yield waits
        yield _histogram("voxgate_engine_step_duration_seconds", "backend step durations",
                         STEP_BUCKETS, e.step_bucket_counts, e.busy_seconds)
        yield _histogram("voxgate_engine_first_audio_seconds",
                         "a context's first audio: from when it was needed to the step that "
                         "made it (the engine's share of TTFA)",
                         FIRST_AUDIO_BUCKETS, e.first_audio_bucket_counts, e.first_audio_seconds)


def _histogram(name: str, doc: str, bounds: tuple[float, ...], counts: list[int],
               total_s: float) -> HistogramMetricFamily:
    """An engine histogram from its bucket counts (summed over replicas when it is remote)."""
    family = HistogramMetricFamily(name, doc)
    cumulative, buckets = 0, []
    # a replica of another build may count other buckets: the shorter of the two
    for bound, count in zip((*bounds, float("inf")), counts, strict=False):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(cumulative)))
    family.add_metric([], buckets, sum_value=total_s)
    return family


class Metrics:
    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.engine = engine
        #: the folder of every worker's metric files, in multiprocess mode (the module doc)
        self.multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
        self.sessions = Gauge("voxgate_sessions", "open WebSocket sessions", registry=r,
                              multiprocess_mode="livesum")
        self.contexts = Gauge("voxgate_contexts", "open contexts across sessions", registry=r,
                              multiprocess_mode="livesum")
        self._num_sessions: Callable[[], int] = lambda: 0
        self._num_contexts: Callable[[], int] = lambda: 0
        self.ttfa = Histogram("voxgate_ttfa_seconds",
                              "first segment complete in the input -> first audio frame sent",
                              buckets=TTFA_BUCKETS, registry=r)
        self.late_audio = Histogram("voxgate_late_audio_seconds",
                                    "audio messages sent after their playback time, by how late",
                                    buckets=LATE_BUCKETS, registry=r)
        self.audio_seconds = Counter("voxgate_audio_sent_seconds", "audio seconds sent", registry=r)
        self.errors = Counter("voxgate_errors", "error events sent, by code", ["code"], registry=r)
        self.admissions = Counter("voxgate_socket_admissions",
                                  "socket handshakes by protocol (native, elevenlabs, "
                                  "cartesia, deepgram) and result (admitted, or why not)",
                                  ["protocol", "result"], registry=r)
        self.cancels = Counter("voxgate_cancels", "contexts cancelled by clients", registry=r)
        # labelled by the detected language: a bounded set (gateway/text/language.py)
        self.text_skipped = Counter("voxgate_text_skipped_characters", "characters no voice could "
                                    "say, skipped (docs/voices.md, Languages), by language",
                                    ["language"], registry=r)
        self.http_speech = Counter("voxgate_http_speech_requests", "POST /v1/audio/speech requests",
                                   registry=r)
        r.register(_EngineCollector(engine))

    def track_state(self, num_sessions: Callable[[], int], num_contexts: Callable[[], int]) -> None:
        """Read the open sessions and contexts from the app at scrape time (in multiprocess
        mode, at each `refresh`)."""
        self._num_sessions, self._num_contexts = num_sessions, num_contexts
        if self.multiprocess_dir is None:
            self.sessions.set_function(lambda: float(num_sessions()))
            self.contexts.set_function(lambda: float(num_contexts()))

    def refresh(self) -> None:
        """Write this process's open sessions and contexts for the others' scrapes."""
        self.sessions.set(self._num_sessions())
        self.contexts.set(self._num_contexts())

    def observe(self, name: str, value: float) -> None:
        if name == "ttfa":
            self.ttfa.observe(value)
        elif name == "late_audio":
            self.late_audio.observe(value)
        elif name == "audio_ms":
            self.audio_seconds.inc(value / 1000.0)
        elif name == "cancel":
            self.cancels.inc()
        elif name.startswith("error:"):
            self.errors.labels(code=name[6:]).inc()
        elif name.startswith("skipped:"):
            self.text_skipped.labels(language=name[8:]).inc(value)

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        self.refresh()
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]
        registry.register(_EngineCollector(self.engine))
        return generate_latest(registry)
