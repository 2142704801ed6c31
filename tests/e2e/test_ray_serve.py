"""voxgate on Ray Serve, end to end on a local cluster (docs/scaling.md, "What is tested here").

One Ray cluster (`ray.init(num_cpus=2)`) for the module: the app of 2 gateway
and 2 engine replicas (piper) behind Serve's proxy on loopback, real WebSocket
clients, and a second, autoscaled app for the scaling test. Every wait is
bounded. Replicas ask for a quarter CPU each so both apps fit in two.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

with warnings.catch_warnings():  # Ray's modules warn on import (pydantic v1-style fields)
    warnings.simplefilter("ignore", DeprecationWarning)
    ray = pytest.importorskip("ray", reason="the ray extra: pip install -e '.[ray]'")
    from ray import serve

    from gateway.ray_serve.app import REPLICA_HEADER, build_app
from tests.e2e.test_voices import register
from tests.support.wait import async_wait_until, wait_until
from tests.support.wsclient import Client, speak

pytestmark = [pytest.mark.ray, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::ResourceWarning")]

LONG_TEXT = " ".join(["This is a long answer that keeps the engine busy for a good while."] * 12)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(predicate: Any, timeout_s: float, what: str, period_s: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class Cluster:
    def __init__(self, url: str, data_dir: Path) -> None:
        self.url = url
        self.ws_url = url.replace("http://", "ws://")
        self.data_dir = data_dir

    def engine_reports(self, app: str = "voxgate") -> list[dict[str, Any]]:
        """Every live engine replica's own counters, asked through a handle (pinned per replica)."""
        from gateway.ray_serve import routing

        handle = serve.get_deployment_handle("Engine", app_name=app)
        first = handle.options(method_name="capacity").remote().result(timeout_s=30)
        ids = set(routing.live_replicas("Engine")) | {first["replica"]}
        reports = [handle.options(method_name="capacity").remote(replica=rid).result(timeout_s=30)
                   for rid in sorted(ids)]
        return [r for r in reports if r["replica"] in ids]

    def gateway_metric(self, name: str, samples: int = 12) -> set[float]:
        """A gauge's values as several scrapes (spread over the gateway replicas) saw it."""
        values = set()
        for _ in range(samples):
            for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
                if line.startswith(name + " "):
                    values.add(float(line.split()[1]))
        return values


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    data_dir = tmp_path_factory.mktemp("ray-voices")
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # One client address opens every socket here: no fair-share cap between them.
        gateway = {"data_dir": str(data_dir), "max_batch_size": 4, "max_engine_share": 1.0}
        serve.run(build_app({"gateway_replicas": 2, "engine_replicas": 2, "gateway_cpus": 0.25,
                             "engine_cpus": 0.25, "gateway": gateway}),
                  name="voxgate", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: httpx.get(url + "/readyz", timeout=10).status_code == 200, 120, "readyz")
        yield Cluster(url, data_dir)
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


async def _connect(cluster: Cluster, query: str = "") -> tuple[Client, str]:
    client = await Client.connect(cluster.ws_url + "/v1/stream" + query)
    return client, client.ws.response.headers[REPLICA_HEADER.decode()]


def test_eight_sessions_speak_through_the_proxy_each_on_one_gateway_replica(
        cluster: Cluster) -> None:
    async def one(i: int) -> tuple[str, list[float]]:
        client, replica = await _connect(cluster)
        try:
            audio_ms = []
            for turn in range(2):  # two turns on one socket: the same connection, one replica
                try:
                    sentence = f"Session {i} says hello, turn {turn}. The weather is fine."
                    done = await asyncio.wait_for(speak(client, f"c{turn}", sentence), 60)
                except asyncio.TimeoutError:
                    events = [{k: e.get(k)
                               for k in ("type", "context_id", "segment_id", "code", "message")}
                              for e in client.received.events]
                    raise AssertionError(f"session {i} turn {turn}: {events}") from None
                audio_ms.append(done["audio_ms"])
            return replica, audio_ms
        finally:
            await client.close()

    async def run() -> list[tuple[str, list[float]]]:
        return await asyncio.gather(*(one(i) for i in range(8)))

    results = asyncio.run(run())
    assert all(ms > 500 for _, turns in results for ms in turns), results
    assert len({replica for replica, _ in results}) == 2, "both gateway replicas took sockets"
    reports = cluster.engine_reports()
    assert len(reports) == 2
    assert sum(r["stats"]["num_finished"] for r in reports) >= 16 * 2  # >= 2 segments a turn
    assert all(r["num_contexts"] == 0 for r in reports), "every context was released"


def test_a_cancel_frees_the_work_on_the_engine_replica(cluster: Cluster) -> None:
    before = {r["replica"]: r["stats"]["num_cancelled"] for r in cluster.engine_reports()}

    async def run() -> dict[str, Any]:
        client, _ = await _connect(cluster)
        try:
            await client.send({"type": "text", "context_id": "long", "text": LONG_TEXT,
                               "flush": True})
            while not client.received.audio:
                await client.recv(timeout=30)
            await client.send({"type": "cancel", "context_id": "long"})
            return await client.until("cancelled", "long", timeout=30)
        finally:
            await client.close()

    cancelled = asyncio.run(run())
    assert cancelled["unspoken_text"]

    def freed() -> list[dict[str, Any]] | None:
        reports = cluster.engine_reports()
        done = all(r["num_queued"] == 0 and r["num_contexts"] == 0 for r in reports)
        return reports if done else None

    reports = _wait(freed, 10, "the engine replicas to drop the cancelled work")
    after = {r["replica"]: r["stats"]["num_cancelled"] for r in reports}
    assert sum(after.values()) > sum(before.get(k, 0) for k in after), (before, after)


def test_a_voice_registered_through_one_gateway_replica_speaks_through_the_other(
        cluster: Cluster) -> None:
    response = register(cluster.url, "ray-voice", name="Ray voice")
    assert response.status_code == 201, response.text
    first = response.headers[REPLICA_HEADER.decode()]

    async def run() -> dict[str, Any]:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the proxy picks the replica: retry until the other
            try:
                client, replica = await _connect(cluster, "?voice=ray-voice")
            except AssertionError:  # refused: that replica has not synced the voice yet
                await asyncio.sleep(0.5)
                continue
            try:
                if replica == first:
                    continue
                return await asyncio.wait_for(speak(client, "v", "Hello from the other replica."),
                                              60)
            finally:
                await client.close()
        raise AssertionError("no socket reached the other gateway replica with the voice")

    done = asyncio.run(run())
    assert done["audio_ms"] > 300
    assert (cluster.data_dir / "voices.sqlite3").exists()  # the shared store both replicas read


def test_an_engine_replica_killed_mid_turn_errors_within_5_s_and_the_next_turn_succeeds(
        cluster: Cluster) -> None:
    async def run() -> tuple[float, dict[str, Any]]:
        client, _ = await _connect(cluster)
        try:
            await client.send({"type": "text", "context_id": "k1", "text": LONG_TEXT,
                               "flush": True})
            while not client.received.audio:
                await client.recv(timeout=30)
            serving = [r["replica"] for r in await asyncio.to_thread(cluster.engine_reports)
                       if r["num_contexts"] > 0]
            assert len(serving) == 1, serving
            actor = ray.get_actor(f"SERVE_REPLICA::voxgate#Engine#{serving[0]}", namespace="serve")
            ray.kill(actor, no_restart=True)
            killed_at = time.monotonic()
            error = await client.until("error", "k1", timeout=30)
            waited = time.monotonic() - killed_at
            assert error["code"] == "internal", error
            done = await asyncio.wait_for(speak(client, "k2", "The next turn works again."), 90)
            return waited, done
        finally:
            await client.close()

    waited, done = asyncio.run(run())
    assert waited < 5.0, f"the error came {waited:.1f} s after the kill"
    assert done["audio_ms"] > 300
    _wait(lambda: cluster.gateway_metric("voxgate_contexts") == {0.0}, 20,
          "no open context on any gateway")
    _wait(lambda: all(r["num_contexts"] == 0 for r in cluster.engine_reports()), 30,
          "no context held on any engine replica")


DRAIN_TEXT = " ".join(["This sentence is spoken while the replica under it is being removed."] * 4)


def _gateway_states(app: str) -> dict[str, int]:
    status = serve.status().applications.get(app)
    if status is None or "Gateway" not in status.deployments:
        return {}
    return {str(k): int(v) for k, v in status.deployments["Gateway"].replica_states.items()}


async def _read_until_done_or_closed(client: Client, context_id: str,
                                     timeout_s: float) -> int | None:
    """Read (recording) until `context_id` is done, then until the socket closes or `timeout_s`
    pass; the close code, or None while it stays open."""
    loop = asyncio.get_running_loop()
    try:
        while not client.received.of("context.done", context_id):
            await client.recv(timeout=60)
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            with contextlib.suppress(asyncio.TimeoutError):
                await client.recv(timeout=deadline - loop.time())
    except websockets.ConnectionClosed as closed:
        return closed.rcvd.code if closed.rcvd else -1
    return None


def test_a_gateway_replica_the_autoscaler_removes_finishes_its_turn_then_closes_with_1001(
        cluster: Cluster) -> None:
    # Autoscaled on open sockets (short delays, one per replica): 1 -> 2 -> 1. Serve removes
    # the newest replica first.
    serve.run(build_app({
        "gateway_replicas": "auto", "min_gateway_replicas": 1, "max_gateway_replicas": 2,
        "target_sessions_per_gateway": 1.0, "upscale_delay_s": 0.5, "downscale_delay_s": 2.0,
        "look_back_period_s": 2.0, "engine_replicas": 1, "gateway_cpus": 0.25, "engine_cpus": 0.25,
        "shutdown_grace_s": 60.0,  # the drain's grace: 50 s, far past the turn
        "gateway": {"data_dir": str(cluster.data_dir), "max_batch_size": 2}}),
        name="drain", route_prefix="/drain")
    url = cluster.ws_url + "/drain/v1/stream?pacing=realtime"  # a turn lasts as long as its audio

    def states() -> dict[str, int]:
        return _gateway_states("drain")

    async def connect() -> tuple[Client, str]:
        client = await Client.connect(url)
        return client, client.ws.response.headers[REPLICA_HEADER.decode()]

    async def scenario() -> dict[str, Any]:
        assert states() == {"RUNNING": 1}
        first, older = await connect()
        second, _ = await connect()  # two sockets: the autoscaler adds a second replica
        await asyncio.to_thread(wait_until, lambda: states().get("RUNNING") == 2, timeout=90,
                                interval=0.25, message="a second gateway replica")
        for _ in range(40):  # the proxy picks the less loaded replica: soon the new one
            client, newer = await connect()
            if newer != older:
                break
            await client.close()
        assert newer != older, "no socket reached the second gateway replica"
        await second.close()
        await client.send({"type": "text", "context_id": "turn", "text": DRAIN_TEXT, "flush": True})
        while not client.received.audio_of("turn"):
            await client.recv(timeout=60)
        reader = asyncio.create_task(_read_until_done_or_closed(client, "turn", 30.0))
        await first.close()  # one socket left: the autoscaler removes the newer replica, under it
        await async_wait_until(lambda: asyncio.to_thread(lambda: states().get("STOPPING")),
                               timeout=60, interval=0.2, message="a gateway replica stopping")
        done_when_stopping = bool(client.received.of("context.done", "turn"))
        newcomers = []  # sockets opened while the replica drains: the proxy sends them elsewhere
        for _ in range(3):
            try:
                other, replica = await connect()
            except AssertionError as refused:  # not session.ready
                newcomers.append(f"refused: {refused}")
                continue
            newcomers.append(replica)
            await other.close()
        code = await reader
        await asyncio.to_thread(wait_until, lambda: states() == {"RUNNING": 1}, timeout=90,
                                interval=0.25, message="the gateway back to one replica")
        return {"client": client, "drained": newer, "survivor": older, "code": code,
                "done_when_stopping": done_when_stopping, "newcomers": newcomers}

    try:
        result = asyncio.run(asyncio.wait_for(scenario(), 300))
    finally:
        serve.delete("drain")
    assert result["done_when_stopping"] is False, \
        "the replica was stopped after the turn, not during it"
    assert result["code"] == 1001
    # The whole turn came before the close: every sentence, and all of its audio.
    got = result["client"].received
    (done,) = got.of("context.done", "turn")
    assert done["segments"] == len(got.of("segment", "turn")) == 4
    assert sum(frame["duration_ms"] for frame in got.audio_of("turn")) == pytest.approx(
        done["audio_ms"], abs=100)
    assert done["audio_ms"] > 4 * 2000
    assert got.of("error") == []
    assert result["drained"] not in result["newcomers"], result["newcomers"]
    assert not [n for n in result["newcomers"] if n.startswith("refused")], result["newcomers"]


def test_the_serve_config_file_is_valid_for_serve_deploy_and_the_builder() -> None:
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from gateway.ray_serve.app import RayServeConfig, _engine_options, _gateway_options

    config = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "deploy" / "serve-config.yaml").read_text())
    ServeDeploySchema(**config)
    (app,) = config["applications"]
    assert app["import_path"] == "gateway.ray_serve.app:build_app"
    cfg = RayServeConfig(**app["args"])
    assert _engine_options(cfg)["ray_actor_options"]["num_gpus"] == 1
    gateway = _gateway_options(cfg)
    assert gateway["max_ongoing_requests"] == 200  # not Serve's default of 5 sockets
    assert gateway["graceful_shutdown_timeout_s"] > 20  # not Serve's default, which cuts turns
    assert "request_timeout_s" not in config["http_options"]


def test_a_bad_tier_size_is_refused_with_a_clear_message() -> None:
    from gateway.ray_serve.app import RayServeConfig

    with pytest.raises(ValueError, match="engine_replicas must be >= 1, got 0"):
        RayServeConfig(engine_replicas=0)
    with pytest.raises(ValueError, match="gateway_replicas must be >= 1 or 'auto'"):
        RayServeConfig(gateway_replicas="many")


def test_voxgate_ray_serve_refuses_a_bad_tier_size_before_starting_ray(
        capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main

    assert main(["ray-serve", "--engine-replicas", "0"]) == 2
    assert "engine_replicas must be >= 1, got 0" in capsys.readouterr().out
