"""`voxgate ray-serve`: start (or join) a Ray cluster and serve voxgate's two tiers on it."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from gateway.access.origins import check_exposure
from gateway.config import load_config

log = logging.getLogger("voxgate.gateway")


def add_parser(sub: Any) -> None:
    """The `ray-serve` subcommand's flags (gateway/cli.py calls this)."""
    parser = sub.add_parser("ray-serve",
                            help="serve on Ray Serve: a gateway tier and an engine tier "
                            "(needs the extra: pip install 'voxgate[ray]')")
    parser.add_argument("--gateway-replicas", default="1",
                        help="gateway replicas, or 'auto' to autoscale on open sessions "
                        "(default 1)")
    parser.add_argument("--engine-replicas", type=int, default=1,
                        help="engine replicas (default 1)")
    parser.add_argument("--host", default="127.0.0.1", help="the Serve proxy's bind address")
    parser.add_argument("--port", type=int, default=8000,
                        help="the Serve proxy's port (default 8000)")
    parser.add_argument("--address", help="join this Ray cluster (default: start a local one)")
    parser.add_argument("--engine", choices=["piper", "cosyvoice"],
                        help="speech engine (default piper)")
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
    parser.add_argument("--api-keys-file",
                        help="file of API keys, one per line (also VOXGATE_API_KEYS); "
                        "every gateway replica reads it, so a path on every node "
                        "(docs/operations.md)")
    parser.add_argument("--admin-keys-file", help="file of admin keys, one per line (also "
                        "VOXGATE_ADMIN_KEYS); a path on every node, like --api-keys-file")
    parser.add_argument("--allowed-origins", help="comma-separated browser origins allowed on the "
                        "socket (VOXGATE_ALLOWED_ORIGINS)")
    parser.add_argument("--no-auth", action="store_true",
                        help="allow a non-loopback --host without API keys")


def _gateway_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as the replicas' `load_config` options. Paths are made absolute (a replica's
    working directory is Ray's); key values stay out: they are in no Ray argument (app.py)."""
    options: dict[str, Any] = {}
    for name in ("engine", "data_dir", "max_batch_size", "api_keys_file", "admin_keys_file",
                 "allowed_origins"):
        value = getattr(args, name)
        if value is not None:
            is_path = name.endswith(("_dir", "_file"))
            options[name] = str(Path(value).absolute()) if is_path else value
    if args.no_auth:
        options["no_auth"] = True
    return options


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
    gateway = _gateway_options(args)
    replicas: int | str = args.gateway_replicas
    try:
        replicas = "auto" if args.gateway_replicas == "auto" else int(args.gateway_replicas)
        RayServeConfig(gateway_replicas=replicas, engine_replicas=args.engine_replicas,
                       gateway_cpus=args.gateway_cpus, engine_cpus=args.engine_cpus)
    except ValueError as exc:
        print(f"voxgate: bad configuration: {exc}")
        return 2
    try:  # what `voxgate serve` would refuse, refused before Ray starts; each replica checks again
        config = load_config({**gateway, "host": args.host, "port": args.port})
        log.info(check_exposure(config.host, config.auth))
    except (TypeError, ValueError, OSError) as exc:
        print(f"voxgate: bad configuration: {exc}")
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
    try:
        serve.run(build_app({"gateway_replicas": replicas, "engine_replicas": args.engine_replicas,
                             "engine_gpus": args.engine_gpus, "gateway_cpus": args.gateway_cpus,
                             "engine_cpus": args.engine_cpus,
                             "sessions_per_gateway": args.sessions_per_gateway,
                             "gateway": gateway}),
                  name="voxgate", route_prefix="/")
    except RuntimeError as exc:  # a replica refused to start (no keys where it runs, a bad option)
        print(f"voxgate: the deploy failed: {exc}")
        serve.shutdown()  # type: ignore[no-untyped-call, unused-ignore]  # typed where Ray is installed
        return 2
    log.info("voxgate on Ray Serve: http://%s:%d (gateway %s, engine %d)", args.host, args.port,
             replicas, args.engine_replicas)
    stop.wait()
    log.info("stopping: each gateway replica lets its open turns finish, then closes with 1001")
    serve.shutdown()  # type: ignore[no-untyped-call, unused-ignore]  # typed where Ray is installed
    return 0
