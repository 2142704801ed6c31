"""`voxgate ray-serve`: start (or join) a Ray cluster and serve voxgate's two tiers on it."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("voxgate.gateway")


def add_parser(sub: Any) -> None:
    """The `ray-serve` subcommand's flags (gateway/cli.py calls this)."""
    parser = sub.add_parser("ray-serve", help="serve on Ray Serve: a gateway tier and an engine tier "
                            "(needs the extra: pip install 'voxgate[ray]')")
    parser.add_argument("--gateway-replicas", default="1",
                        help="gateway replicas, or 'auto' to autoscale on open sessions (default 1)")
    parser.add_argument("--engine-replicas", type=int, default=1, help="engine replicas (default 1)")
    parser.add_argument("--host", default="127.0.0.1", help="the Serve proxy's bind address")
    parser.add_argument("--port", type=int, default=8000, help="the Serve proxy's port (default 8000)")
    parser.add_argument("--address", help="join this Ray cluster (default: start a local one)")
    parser.add_argument("--engine", choices=["piper", "cosyvoice"], help="speech engine (default piper)")
    parser.add_argument("--engine-gpus", type=float, default=0.0,
                        help="GPUs per engine replica (1 for cosyvoice)")
    parser.add_argument("--gateway-cpus", type=float, default=1.0,
                        help="CPUs Ray reserves per gateway replica (default 1)")
    parser.add_argument("--engine-cpus", type=float, default=1.0,
                        help="CPUs Ray reserves per engine replica (default 1)")
    parser.add_argument("--data-dir", help="the voice registry's folder: a path every replica "
                        "shares (docs/scaling.md)")
    parser.add_argument("--max-batch-size", type=int, help="most segments per engine step")
    parser.add_argument("--sessions-per-gateway", type=int, default=200,
                        help="sockets one gateway replica holds (Serve's max_ongoing_requests)")
    parser.add_argument("--no-auth", action="store_true",
                        help="allow a non-loopback --host without API keys")


def run(args: argparse.Namespace) -> int:
    """Deploy and block until SIGINT/SIGTERM, then shut Serve down: each gateway replica lets its
    open turns finish and closes its sockets with 1001 (drain.py)."""
    try:
        import ray
        from ray import serve

        from gateway.ray_serve.app import RayServeConfig, build_app
    except ImportError as exc:
        print(f"voxgate ray-serve needs Ray Serve: pip install 'voxgate[ray]' ({exc})")
        return 2
    gateway: dict[str, Any] = {}
    for name in ("engine", "data_dir", "max_batch_size"):
        value = getattr(args, name)
        if value is not None:
            gateway[name] = str(value) if name == "data_dir" else value
    replicas: int | str = args.gateway_replicas
    try:
        replicas = "auto" if args.gateway_replicas == "auto" else int(args.gateway_replicas)
        RayServeConfig(gateway_replicas=replicas, engine_replicas=args.engine_replicas,
                       gateway_cpus=args.gateway_cpus, engine_cpus=args.engine_cpus)
    except ValueError as exc:
        print(f"voxgate: bad configuration: {exc}")
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.no_auth:
        print("voxgate: a non-loopback --host needs API keys (VOXGATE_API_KEYS) or --no-auth")
        return 2
    ray.init(address=args.address)
    # A signal during the deploy stops Serve once it is up (the proxy may already answer);
    # a second one stops at once.
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            signal.default_int_handler(signum, frame)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    # request_timeout_s stays unset: a socket lives as long as its conversation.
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app({"gateway_replicas": replicas, "engine_replicas": args.engine_replicas,
                         "engine_gpus": args.engine_gpus, "gateway_cpus": args.gateway_cpus,
                         "engine_cpus": args.engine_cpus,
                         "sessions_per_gateway": args.sessions_per_gateway, "gateway": gateway}),
              name="voxgate", route_prefix="/")
    log.info("voxgate on Ray Serve: http://%s:%d (gateway %s, engine %d)", args.host, args.port,
             replicas, args.engine_replicas)
    stop.wait()
    log.info("stopping: each gateway replica lets its open turns finish, then closes with 1001")
    serve.shutdown()  # type: ignore[no-untyped-call, unused-ignore]  # typed where Ray is installed
    return 0
