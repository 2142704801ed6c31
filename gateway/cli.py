"""`voxgate serve`: run the gateway with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from gateway.config import GatewayConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voxgate", description="Realtime voice gateway.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the server")
    serve.add_argument("--host", help="bind address (default 127.0.0.1; VOXGATE_HOST)")
    serve.add_argument("--port", type=int, help="port (default 8000, or $PORT; VOXGATE_PORT)")
    serve.add_argument("--engine", choices=["piper", "cosyvoice"], help="speech engine (default piper)")
    serve.add_argument("--voice", help="default voice id (default joe)")
    serve.add_argument("--max-batch-size", type=int, help="most segments per engine step (default 8)")
    serve.add_argument("--max-contexts", type=int,
                       help="admission limit on talking contexts (default 0: measured)")
    serve.add_argument("--data-dir", help="where registered voices are stored")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    port = args.port if args.port is not None else (int(os.environ["PORT"]) if "PORT" in os.environ else None)
    try:
        config = GatewayConfig.from_env(host=args.host, port=port, engine=args.engine, voice=args.voice,
                                        max_batch_size=args.max_batch_size,
                                        max_contexts=args.max_contexts, data_dir=args.data_dir)
    except (TypeError, ValueError) as exc:
        print(f"voxgate: bad configuration: {exc}", file=sys.stderr)
        return 2
    from gateway.app import create_app

    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level,
                ws_max_size=max(4 * config.limits.max_message_bytes, 1 << 20),
                ws_ping_interval=config.ws_ping_interval_s, ws_ping_timeout=config.ws_ping_interval_s,
                timeout_graceful_shutdown=int(config.shutdown_grace_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
