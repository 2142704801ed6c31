"""voxgate-loadtest: a fleet of LLM dialogue systems and listeners against a voxgate URL.

    voxgate-loadtest run   --url http://127.0.0.1:8000 --sessions 8 --duration 60
    voxgate-loadtest sweep --url http://127.0.0.1:8000 --max-sessions 64 --duration 30 \\
                           --anchor-url http://127.0.0.1:5000 --plot-dir docs/img
    voxgate-loadtest rate  --url http://127.0.0.1:8000 --rate 2 --duration 60

See docs/loadtest.md for what each number means.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Any

from loadtest.anchor import piper_server
from loadtest.config import LoadConfig, Protocol
from loadtest.corpus import load_corpus
from loadtest.report import format_sweep, format_table, plot_capacity, plot_ttfa, write_json
from loadtest.runner import (
    LevelResult,
    run_fixed,
    run_open_loop,
    run_sweep,
    stderr_if,
    sweep_levels,
)


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag}: expected KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def _option_value(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value, value)


def _shares(text: str) -> tuple[float, float]:
    low, sep, high = text.partition("-")
    try:
        return (float(low), float(high)) if sep else (float(low), float(low))
    except ValueError:
        raise SystemExit("--barge-in-at: expected LOW-HIGH such as 0.1-0.9, "
                         f"got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voxgate-loadtest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("target")
    g.add_argument("--url", required=True, help="voxgate base URL (http://host:port) or ws URL")
    g.add_argument("--protocol", choices=[p.value for p in Protocol], default="voxgate",
                   help="what --url speaks (piper-http: piper's own Flask server)")
    g.add_argument("--anchor-url", help="also run the same load against piper's HTTP server "
                   "at this URL ('auto': start one with the joe voice)")
    g.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback target (default: refuse)")
    g.add_argument("--codec", help="audio codec asked for (opus, pcm16, mulaw)")
    g.add_argument("--voice")
    g.add_argument("--sample-rate", type=int)
    g.add_argument("--pacing", choices=["asap", "realtime"])
    g.add_argument("--encoding", choices=["msgpack", "json"], default="msgpack")
    g.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra session.update option (repeatable)")
    b = common.add_argument_group("behaviour")
    b.add_argument("--corpus", help="JSON-lines corpus (default: the bundled one)")
    b.add_argument("--seed", type=int, default=1)
    b.add_argument("--token-rate", type=float, default=40.0, help="LLM tokens per second")
    b.add_argument("--token-jitter", type=float, default=0.5)
    b.add_argument("--think", type=float, default=2.0, help="mean think time between turns (s)")
    b.add_argument("--barge-in-rate", type=float, default=0.0,
                   help="share of turns interrupted after a random share of their audio")
    b.add_argument("--barge-in-at", default="0.1-0.9", metavar="LOW-HIGH",
                   help="a barge-in comes after U(LOW, HIGH) of the answer's audio")
    b.add_argument("--playout-delay-ms", type=float, default=0.0,
                   help="listener's jitter buffer before playback starts")
    b.add_argument("--turn-timeout", type=float, default=60.0)
    b.add_argument("--drain", type=float, default=15.0,
                   help="seconds running turns may finish after the duration")
    b.add_argument("--max-turns", type=int, default=1_000_000, help="turn budget per level")
    b.add_argument("--duration", type=float, default=30.0, help="seconds per run or level")
    o = common.add_argument_group("output")
    o.add_argument("--json", help="write the report as JSON here ('-' for stdout)")
    o.add_argument("--turns", action="store_true", help="include every turn in the JSON")
    o.add_argument("--plot-dir", help="write PNG plots here")
    o.add_argument("--quiet", action="store_true", help="no live progress line")
    o.add_argument("--ttfa-target-ms", type=float, default=300.0)

    run = modes.add_parser("run", parents=[common], help="a fixed number of sessions")
    run.add_argument("--sessions", type=int, default=4)
    sweep = modes.add_parser("sweep", parents=[common], help="find capacity")
    sweep.add_argument("--levels", help="comma-separated session counts (default: doubling)")
    sweep.add_argument("--max-sessions", type=int, default=64)
    sweep.add_argument("--bisect", type=int, default=2, help="bisection steps after a failure")
    sweep.add_argument("--all-levels", action="store_true",
                       help="run every level even after one fails (the whole curve)")
    rate = modes.add_parser("rate", parents=[common], help="open-loop arrivals")
    rate.add_argument("--rate", type=float, required=True, help="new sessions per second")
    rate.add_argument("--turns-per-arrival", type=int, default=1)
    rate.add_argument("--max-inflight", type=int, default=256)
    return parser


def config_from_args(args: argparse.Namespace, url: str, protocol: str) -> LoadConfig:
    query = {k: str(v) for k, v in (("codec", args.codec), ("voice", args.voice),
                                    ("sample_rate", args.sample_rate)) if v is not None}
    options: dict[str, object] = {k: _option_value(v)
                                  for k, v in _pairs(args.option, "--option").items()}
    if args.pacing:
        options["pacing"] = args.pacing
    return LoadConfig(
        url=url, protocol=Protocol(protocol), corpus_path=args.corpus, seed=args.seed,
        token_rate=args.token_rate, token_jitter=args.token_jitter, think_s=args.think,
        barge_in_rate=args.barge_in_rate, barge_in_shares=_shares(args.barge_in_at),
        playout_delay_ms=args.playout_delay_ms,
        turn_timeout_s=args.turn_timeout, drain_s=args.drain, max_turns=args.max_turns,
        encoding=args.encoding, query=query, session_options=options,
        allow_remote=args.allow_remote)


async def _run_target(args: argparse.Namespace, name: str, config: LoadConfig,
                      levels: list[int] | None = None,
                      ) -> tuple[list[LevelResult], dict[str, Any]]:
    corpus = load_corpus(config.corpus_path)
    progress = stderr_if(not args.quiet)
    if args.mode == "run":
        result = await run_fixed(config, corpus, args.sessions, args.duration, name, progress,
                                 ttfa_target_ms=args.ttfa_target_ms)
        print(format_table(result))
        return [result], {"mode": "run", "result": result.to_dict(args.turns)}
    if args.mode == "rate":
        result = await run_open_loop(config, corpus, args.rate, args.duration,
                                     args.max_inflight, args.turns_per_arrival, progress,
                                     ttfa_target_ms=args.ttfa_target_ms)
        result.label = name
        print(format_table(result))
        return [result], {"mode": "rate", "result": result.to_dict(args.turns)}
    replay = levels is not None  # the anchor replays the target's levels, all of them
    if levels is None:
        levels = ([int(x) for x in args.levels.split(",")] if args.levels
                  else sweep_levels(args.max_sessions))
    results, capacity = await run_sweep(config, corpus, levels, args.duration,
                                        args.ttfa_target_ms, 0 if replay else args.bisect,
                                        progress, stop_at_failure=not (replay or args.all_levels))
    for r in results:
        r.label = name
        print(format_table(r))
    print(format_sweep(name, results, capacity, args.ttfa_target_ms))
    return results, {"mode": "sweep", "capacity": capacity,
                     "ttfa_target_ms": args.ttfa_target_ms,
                     "levels": [r.to_dict(args.turns) for r in results]}


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    config = config_from_args(args, args.url, args.protocol)
    report: dict[str, Any] = {"command": " ".join(["voxgate-loadtest", *sys.argv[1:]]),
                              "targets": {}}
    runs: dict[str, list[LevelResult]] = {}
    results, out = await _run_target(args, args.protocol, config)
    report["targets"][args.protocol] = {**out, "url": config.url}
    runs[args.protocol] = results
    if args.anchor_url:
        with contextlib.ExitStack() as stack:
            url = (stack.enter_context(piper_server()) if args.anchor_url == "auto"
                   else args.anchor_url)
            anchor = config_from_args(args, url, Protocol.PIPER_HTTP.value)
            levels = [r.sessions for r in results] if args.mode == "sweep" else None
            anchor_results, out = await _run_target(args, "piper-http", anchor, levels)
        report["targets"]["piper-http"] = {**out, "url": url}
        runs["piper-http"] = anchor_results
    if args.plot_dir:
        plot_dir = Path(args.plot_dir)
        plot_dir.mkdir(parents=True, exist_ok=True)
        if args.mode == "sweep":
            plot_capacity(runs, args.ttfa_target_ms, plot_dir / "loadtest_capacity.png")
        plot_ttfa(runs, args.ttfa_target_ms, plot_dir / "loadtest_ttfa.png")
        report["plots"] = sorted(str(p) for p in plot_dir.glob("loadtest_*.png"))
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = asyncio.run(_main(args))
    except (ValueError, TypeError, OSError, RuntimeError) as exc:  # bad settings, corpus or target
        print(f"voxgate-loadtest: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
