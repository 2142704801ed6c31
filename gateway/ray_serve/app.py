"""The Serve application: Gateway (ingress, sticky sockets) -> Engine (batching, streaming).

`build_app(args)` is the application builder both `voxgate ray-serve` and
`serve deploy` (deploy/serve-config.yaml, `import_path:
gateway.ray_serve.app:build_app`) use. Its settings, each with the trap it
avoids (docs/scaling.md):

- Gateway `max_ongoing_requests` = sockets per replica. Serve's default is 5,
  and a WebSocket is one ongoing request for its whole life.
- Gateway autoscaling on ongoing requests, i.e. open sessions.
- `graceful_shutdown_timeout_s` above a turn's length: Serve's default 20 s
  cuts live turns when a replica is scaled down or redeployed. A gateway
  replica being stopped drains within it (drain.py): turns finish, then 1001.
- No request timeout for sockets: `request_timeout_s` stays unset in the
  proxy's `http_options` (launch.py; the config file says so too).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from gateway.ray_serve.drain import drain_grace_s
from gateway.ray_serve.drain import install as install_drain
from gateway.ray_serve.engine_replica import EngineReplica, replica_id
from gateway.ray_serve.remote import RemoteEngine
from gateway.ray_serve.replica_config import proxy_address, replica_config
from gateway.ray_serve.routing import PinnedRouter

if TYPE_CHECKING:
    from gateway.state import AppState

log = logging.getLogger("voxgate.gateway")

REPLICA_HEADER = b"x-voxgate-gateway-replica"

#: A gateway's router asks each engine replica for its queue length before the first call
#: (and when its cache lapses), and gives up after 0.1 s by default: on a busy CPU node that
#: fails over and over and delays every call. Engine routing is by admission, not queue length.
ROUTER_ENV = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "0.5",
              "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "3.0"}


@dataclass(slots=True)
class RayServeConfig:
    """The two tiers' sizes and Serve settings (`build_app` args; all optional)."""

    gateway_replicas: int | str = 1  # "auto": autoscale between min and max
    engine_replicas: int = 1
    min_gateway_replicas: int = 1
    max_gateway_replicas: int = 4
    sessions_per_gateway: int = 200  # max_ongoing_requests of a gateway replica
    target_sessions_per_gateway: float = 100.0  # the autoscaler's target
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0  # the window the autoscaler averages open sessions over
    gateway_cpus: float = 1.0
    engine_cpus: float = 1.0
    engine_gpus: float = 0.0  # 1 for cosyvoice on a GPU node
    shutdown_grace_s: float = 120.0  # a replica going away lets its turns finish
    #: `load_config` options for both tiers: GatewayConfig fields and the auth options (keys files,
    #: origins, no_auth); keys themselves come from each replica's environment (replica_config.py)
    gateway: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.gateway_replicas != "auto" and (not isinstance(self.gateway_replicas, int)
                                                or self.gateway_replicas < 1):
            raise ValueError("gateway_replicas must be >= 1 or 'auto', got "
                             f"{self.gateway_replicas!r}")
        if self.engine_replicas < 1:
            raise ValueError(f"engine_replicas must be >= 1, got {self.engine_replicas}")
        if not 1 <= self.min_gateway_replicas <= self.max_gateway_replicas:
            raise ValueError("expected 1 <= min_gateway_replicas <= max_gateway_replicas, got "
                             f"{self.min_gateway_replicas} and {self.max_gateway_replicas}")
        if self.sessions_per_gateway < 1 or self.target_sessions_per_gateway <= 0:
            raise ValueError(
                "sessions_per_gateway and target_sessions_per_gateway must be positive")
        if self.gateway_cpus < 0 or self.engine_cpus < 0:
            raise ValueError(f"gateway_cpus and engine_cpus must be >= 0, got {self.gateway_cpus} "
                             f"and {self.engine_cpus}")


class _ReplicaHeader:
    """Names the gateway replica in every answer (a WebSocket handshake's too): affinity is
    observable, and an operator can tell which replica served a request."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return

        async def tagged(message: dict[str, Any]) -> None:
            if message["type"] in ("websocket.accept", "http.response.start"):
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REPLICA_HEADER, self.replica)]}
            await send(message)

        await self.app(scope, receive, tagged)


@serve.ingress()
class GatewayReplica:
    """The gateway tier: voxgate's Starlette app, reaching the engine tier through a handle.

    Stopped by Serve, it drains like `voxgate serve` on SIGTERM (drain.py): no new
    socket, open contexts finish within `shutdown_grace_s` less Serve's margin, then
    every socket is closed with 1001.
    """

    async def __init__(self, engine: DeploymentHandle[Any],  # type: ignore[misc]  # Serve awaits it
                       gateway: dict[str, Any], shutdown_grace_s: float = 120.0) -> None:
        self.engine_handle = engine
        self.options = gateway
        # The host clients reach is the proxy's: it decides whether keys are required.
        self.proxy_host, self.proxy_port = await proxy_address()
        self.state: AppState | None = None  # the app's, once Serve has built it
        self.grace_s = drain_grace_s(shutdown_grace_s)
        # The loop the app's sockets run on: Serve stops the replica from another one.
        install_drain(self._drain, asyncio.get_running_loop(), timeout_s=self.grace_s + 5.0)

    def __serve_build_asgi_app__(self) -> Any:
        from gateway.app import create_app

        # voxgate serve's configuration, keys included; refuses an exposed proxy without keys
        config = replica_config(self.options, self.proxy_host, self.proxy_port)
        app = create_app(config, engine=RemoteEngine(self.engine_handle))
        self.state = app.state.voxgate
        return _ReplicaHeader(app, replica_id())

    async def _drain(self) -> None:  # called by drain.py in this process, not through a handle
        """Refuse new sockets, let open contexts finish, close every socket with 1001."""
        if self.state is None:
            return
        from gateway.app import drain

        log.info("gateway replica %s stopping: draining %d sockets (grace %.0f s)", replica_id(),
                 len(self.state.connections), self.grace_s)
        await drain(self.state, self.grace_s)


def _gateway_options(cfg: RayServeConfig) -> dict[str, Any]:
    options: dict[str, Any] = {
        "name": "Gateway", "max_ongoing_requests": cfg.sessions_per_gateway,
        "graceful_shutdown_timeout_s": cfg.shutdown_grace_s,
        "ray_actor_options": {"num_cpus": cfg.gateway_cpus,
                              "runtime_env": {"env_vars": dict(ROUTER_ENV)}},
    }
    if cfg.gateway_replicas == "auto":
        options["autoscaling_config"] = {
            "min_replicas": cfg.min_gateway_replicas, "max_replicas": cfg.max_gateway_replicas,
            "target_ongoing_requests": cfg.target_sessions_per_gateway,
            "upscale_delay_s": cfg.upscale_delay_s, "downscale_delay_s": cfg.downscale_delay_s,
            "look_back_period_s": cfg.look_back_period_s,
        }
        if cfg.look_back_period_s <= 10.0:  # replicas report every 10 s unless told otherwise
            options["autoscaling_config"]["metrics_interval_s"] = cfg.look_back_period_s / 2
    else:
        options["num_replicas"] = cfg.gateway_replicas
    return options


def _engine_options(cfg: RayServeConfig) -> dict[str, Any]:
    actor: dict[str, Any] = {"num_cpus": cfg.engine_cpus}
    if cfg.engine_gpus:
        actor["num_gpus"] = cfg.engine_gpus
    return {
        "name": "Engine", "num_replicas": cfg.engine_replicas,
        # Every segment of every context is one ongoing streaming call; admission, not
        # this limit, decides how many contexts a replica holds.
        "max_ongoing_requests": 4096,
        "graceful_shutdown_timeout_s": cfg.shutdown_grace_s,
        "ray_actor_options": actor,
        "request_router_config": RequestRouterConfig(request_router_class=cast(Any, PinnedRouter)),
        "health_check_period_s": 2.0, "health_check_timeout_s": 10.0,
    }


def build_app(args: dict[str, Any] | None = None) -> Any:
    """The Serve application (an application builder: `serve run/deploy` pass `args`)."""
    cfg = RayServeConfig(**(args or {}))
    deployment: Any = serve.deployment
    engine = deployment(EngineReplica).options(**_engine_options(cfg)).bind(cfg.gateway)
    gateway = deployment(GatewayReplica).options(**_gateway_options(cfg))
    return gateway.bind(engine, cfg.gateway, cfg.shutdown_grace_s)
