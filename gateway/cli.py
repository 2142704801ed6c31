"""`voxgate serve`: run the gateway with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time
from types import FrameType
from typing import Any

import uvicorn

from gateway.access.origins import check_exposure
from gateway.access.redaction import install_log_redaction
from gateway.config import load_config
from gateway.http.timeouts import uvicorn_limits
from gateway.text.routing import parse_voice_for

log = logging.getLogger("voxgate.gateway")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voxgate", description="Realtime voice gateway.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the server")
    serve.add_argument("--host", help="bind address (default 127.0.0.1; VOXGATE_HOST)")
    serve.add_argument("--port", type=int, help="port (default 8000, or $PORT; VOXGATE_PORT)")
    serve.add_argument("--engine", choices=["piper", "cosyvoice"],
                       help="speech engine (default piper)")
    serve.add_argument("--voice", help="default voice id (default joe)")
    serve.add_argument("--voice-for", action="append", default=[], metavar="LANGUAGE=VOICE",
                       help="the voice for segments in a language the session's voice "
                       "cannot speak, repeatable: --voice-for zh=NAME "
                       "(VOXGATE_VOICE_FOR=zh=NAME,ru=OTHER; docs/voices.md, Languages)")
    serve.add_argument("--max-batch-size", type=int,
                       help="most segments per engine step (default: the engine's; piper 8, "
                       "cosyvoice 256 on a GPU)")
    serve.add_argument("--max-contexts", type=int,
                       help="admission limit on talking contexts (default 0: measured)")
    serve.add_argument("--scheduler", choices=["edf", "fifo"],
                       help="edf: deadline-aware batching (default); "
                       "fifo: one at a time (baseline)")
    serve.add_argument("--lm-backend", choices=["torch", "vllm"],
                       help="cosyvoice: run the speech LM in torch (default) or on vLLM's async "
                       "engine (same as --engine-option lm_backend=...)")
    serve.add_argument("--model-dir", help="cosyvoice: the official CosyVoice 2/3 model directory "
                       "(same as --engine-option model_dir=...; VOXGATE_COSYVOICE_MODEL_DIR)")
    serve.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                       help="a backend option, repeatable (cosyvoice: model_dir=PATH; "
                       "docs/cosyvoice.md)")
    serve.add_argument("--data-dir", help="where registered voices are stored")
    serve.add_argument("--voice-assets", help="folder of name.wav + name.txt voices registered at "
                       "start-up (default <data-dir>/assets; VOXGATE_VOICE_ASSETS)")
    serve.add_argument("--api-keys-file",
                       help="file of API keys, one per line (also VOXGATE_API_KEYS)")
    serve.add_argument("--admin-keys-file",
                       help="file of admin keys, one per line: API keys that also "
                       "see and delete every tenant's voices (also VOXGATE_ADMIN_KEYS)")
    serve.add_argument("--allowed-origins",
                       help="comma-separated browser origins allowed on the socket "
                       "(same-origin pages and clients without Origin are always allowed; "
                       "* allows all)")
    serve.add_argument("--no-auth", action="store_true",
                       help="allow listening on a non-loopback address without API keys")
    serve.add_argument("--max-sessions", type=int, help="most open sockets (default 1000)")
    serve.add_argument("--shutdown-grace", type=float,
                       help="seconds open contexts may finish after SIGTERM (default 10)")
    serve.add_argument("--memory-profile", choices=["compact", "fast"],
                       help="fast (default): two malloc arenas; compact: also a fixed 1 MiB mmap "
                       "threshold, ~70 MB less RSS for ~40%% less synthesis per second "
                       "(VOXGATE_MEMORY_PROFILE; docs/operations.md)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--ssl-certfile",
                       help="serve https/wss with this PEM certificate (with --ssl-keyfile)")
    serve.add_argument("--ssl-keyfile", help="the private key of --ssl-certfile (PEM)")
    serve.add_argument("--workers", type=int, default=1,
                       help="gateway processes feeding one engine process (default 1: one "
                       "process; docs/scaling.md, Workers)")
    for hidden in ("--worker-channel", "--worker-fd", "--worker-index", "--worker-parent"):
        serve.add_argument(hidden, help=argparse.SUPPRESS)  # how the engine process starts one
    from gateway.ray_serve.launch import add_parser  # imports no Ray: `ray-serve` checks for it

    add_parser(sub)
    return parser


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains open contexts before exiting.

    uvicorn's own shutdown fails open WebSockets at once (1012); voxgate lets
    them finish up to the grace period and then closes them with 1001.
    """

    def __init__(self, config: uvicorn.Config, state: Any, grace_s: float) -> None:
        super().__init__(config)
        self.voxgate_state = state
        self.grace_s = grace_s
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self.should_exit:
            return super().handle_exit(sig, frame)  # a second signal: stop now
        from gateway.app import drain

        log.info("signal %d: draining open contexts (grace %.0f s)", sig, self.grace_s)

        async def drain_then_exit() -> None:
            await drain(self.voxgate_state, self.grace_s)
            self.should_exit = True

        loop = asyncio.get_running_loop()
        self._drain_task = loop.create_task(drain_then_exit())


def _engine_options(items: list[str]) -> dict[str, str] | None:
    """`--engine-option KEY=VALUE` flags as a dict (None when there are none)."""
    options: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--engine-option expects KEY=VALUE, got {item!r}")
        options[key.strip()] = value
    return options or None


def _shorthand_options(args: argparse.Namespace) -> list[str]:
    """`--engine-option` items, `--lm-backend` and `--model-dir` as the options they name."""
    items = list(args.engine_option)
    if args.lm_backend:
        items.append(f"lm_backend={args.lm_backend}")
    if args.model_dir:
        items.append(f"model_dir={args.model_dir}")
    return items


def _serve_options(args: argparse.Namespace) -> dict[str, Any]:
    """`voxgate serve`'s flags as `load_config` options (None: not given, the environment's)."""
    return {"host": args.host, "port": args.port, "engine": args.engine, "voice": args.voice,
            "voice_for": parse_voice_for(args.voice_for) or None,
            "max_batch_size": args.max_batch_size, "max_contexts": args.max_contexts,
            "data_dir": args.data_dir, "scheduler_policy": args.scheduler,
            "max_sessions": args.max_sessions, "shutdown_grace_s": args.shutdown_grace,
            "engine_options": _engine_options(_shorthand_options(args)),
            "voice_assets": args.voice_assets, "api_keys_file": args.api_keys_file,
            "admin_keys_file": args.admin_keys_file, "allowed_origins": args.allowed_origins,
            "no_auth": args.no_auth}


#: seconds between returns of freed heap memory to the system (`tune_malloc`)
MALLOC_TRIM_PERIOD_S = 5.0


def tune_malloc(profile: str) -> None:
    """glibc malloc settings: "fast" (default) or "compact" (less RSS, slower synthesis).

    fast: two arenas, and freed heap pages handed back every
    MALLOC_TRIM_PERIOD_S (malloc_trim). Two lanes of onnxruntime calls free
    and allocate large buffers side by side, and without the trim the heap
    fragments: RSS grew 42-53 MB over 200 barge-in sessions, 9-40 MB with the
    trim every 5 s; a 2 s period held it to 9-13 MB but cost 7-11% of the
    engine's throughput at saturation (docs/benchmarks.md, "Memory under
    churn"; docs/operations.md, "Memory").
    compact: also a fixed 1 MiB mmap threshold. glibc otherwise raises its
    threshold as large blocks are freed and serves them from the heap; fixed,
    big inference buffers are mapped and unmapped on every call instead,
    which keeps RSS ~70 MB lower and costs page faults: the engine made 58%
    of the raw limit against 95% with fast, measured on the same box.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return  # not glibc
    m_mmap_threshold, m_arena_max = -3, -8
    libc.mallopt(m_arena_max, 2)
    if profile == "compact":
        libc.mallopt(m_mmap_threshold, 1 << 20)
    threading.Thread(target=_trim_forever, args=(trim, MALLOC_TRIM_PERIOD_S),
                     name="voxgate-malloc-trim", daemon=True).start()


def _trim_forever(trim: Any, period_s: float) -> None:
    while True:
        time.sleep(period_s)
        trim(0)  # releases free pages inside the heap too, not only at its top


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "ray-serve":  # its own flags (gateway/ray_serve/launch.py)
        from gateway.ray_serve.launch import run

        logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return run(args)
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        print("voxgate: bad configuration: --ssl-certfile and --ssl-keyfile go together",
              file=sys.stderr)
        return 2
    tune_malloc(args.memory_profile or os.environ.get("VOXGATE_MEMORY_PROFILE", "fast"))
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(_serve_options(args))
        if args.worker_channel:
            return _serve_worker(args, config)
        log.info(check_exposure(config.host, config.auth))
        if args.workers != 1:
            from gateway.workers.supervisor import Supervisor

            supervisor = Supervisor(config, args.workers, _without_workers(argv))
        else:
            from gateway.app import create_app

            app = create_app(config)  # builds the backend's config from the engine options
    except (TypeError, ValueError, OSError) as exc:
        print(f"voxgate: bad configuration: {exc}", file=sys.stderr)
        return 2
    if args.workers != 1:
        return supervisor.run()
    _run_server(app, config, args)
    return 0


def _without_workers(argv: list[str] | None) -> list[str]:
    """`voxgate serve`'s arguments as a worker gets them: all but --workers."""
    items = list(sys.argv[1:] if argv is None else argv)
    kept: list[str] = []
    skip = False
    for item in items:
        if skip:
            skip = False
        elif item == "--workers":
            skip = True
        elif not item.startswith("--workers="):
            kept.append(item)
    return kept


def _serve_worker(args: argparse.Namespace, config: Any) -> int:
    """One worker of `--workers N` (gateway/workers/child.py), on the socket handed down."""
    import socket
    from pathlib import Path

    from gateway.workers.child import build_worker_app, watch_parent

    watch_parent(int(args.worker_parent))
    index = int(args.worker_index)
    for handler in logging.getLogger().handlers:  # say which worker speaks
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s %(name)s[w{index}]: %(message)s"))
    app = build_worker_app(config, Path(args.worker_channel), index)
    _run_server(app, config, args, sockets=[socket.socket(fileno=int(args.worker_fd))])
    return 0


def _run_server(app: Any, config: Any, args: argparse.Namespace,
                sockets: list[Any] | None = None) -> None:
    uvicorn_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=args.log_level,
        # TLS: wss:// (docs/compat.md)
        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
        ws_max_size=max(4 * config.limits.max_message_bytes, 1 << 20),
        ws_ping_interval=config.ws_ping_interval_s, ws_ping_timeout=config.ws_ping_interval_s,
        ws_per_message_deflate=config.ws_per_message_deflate,
        timeout_graceful_shutdown=5,
        # connections: a head must arrive within header_timeout_s; past max_connections, 503
        **uvicorn_limits(header_timeout_s=config.header_timeout_s,
                         max_connections=config.max_connections or config.max_sessions + 256))
    install_log_redaction()  # after uvicorn configured its loggers: no key in the access log
    server = DrainingServer(uvicorn_config, app.state.voxgate, config.shutdown_grace_s)
    server.run(sockets=sockets)


if __name__ == "__main__":
    sys.exit(main())
