"""permessage-deflate on audio messages: what it costs the server and what it saves.

    python -m bench.bench_ws_deflate [--repeats 5]

uvicorn (0.55, its websockets-sansio protocol, the one `voxgate serve` runs) offers
permessage-deflate to every client that asks (`ws_per_message_deflate=True`): window bits 12
both ways, zlib memLevel 5, context takeover kept. Browsers and the websockets client ask by
default (the load tool turns it off: `compression=None`). This compresses the gateway's real
`audio` messages with websockets' own extension set up that way, as one connection sends them:
a piper joe utterance (bench.bench_opus_settings) encoded by the gateway's encoder (Opus 48 kHz,
complexity 5; and PCM16 at 24 kHz for contrast), packed `frames` 20 ms frames to a message
(`gateway.stream.playout.FRAMES_PER_MESSAGE` is 5) as msgpack. Per row: the compressor's CPU
per audio second (the best of `--repeats`), what msgpack packing costs beside it, and the
bytes after over before.
"""

from __future__ import annotations

import argparse
import time
from importlib.metadata import version
from typing import Any

import msgpack
from websockets.extensions.permessage_deflate import PerMessageDeflate
from websockets.frames import Frame, Opcode

from bench.bench_opus_settings import joe_utterance
from gateway.audio.codecs import make_encoder
from gateway.stream.events import AudioEvent

RATE_IN = 24000


def messages(
    codec: str, rate_out: int, frames_per_message: int
) -> tuple[list[dict[str, Any]], float]:
    """The `audio` messages of one context speaking the utterance, and its seconds of audio."""
    pcm = joe_utterance(RATE_IN)
    encoder = make_encoder(codec, rate_out, 20, None, RATE_IN)
    frames = [*encoder.encode(pcm), *encoder.flush()]
    out, pts = [], 0.0
    for seq, at in enumerate(range(0, len(frames), frames_per_message)):
        group = frames[at : at + frames_per_message]
        duration = sum(f.duration_ms for f in group)
        out.append(
            AudioEvent("ctx-1", seq, pts, duration, codec, tuple(f.data for f in group)).to_wire()
        )
        pts += duration
    return out, len(pcm) / RATE_IN


def uvicorn_deflate() -> PerMessageDeflate:
    """The server side of the extension as uvicorn's websockets-sansio protocol negotiates it."""
    return PerMessageDeflate(
        remote_no_context_takeover=False,
        local_no_context_takeover=False,
        remote_max_window_bits=12,
        local_max_window_bits=12,
        compress_settings={"memLevel": 5},
    )


def measure(codec: str, rate_out: int, frames_per_message: int, repeats: int) -> dict[str, Any]:
    wire, audio_s = messages(codec, rate_out, frames_per_message)
    pack_s, deflate_s, size_in, size_out = [], [], 0, 0
    for _ in range(repeats):
        start = time.thread_time()
        payloads = [msgpack.packb(m, use_bin_type=True) for m in wire]
        pack_s.append(time.thread_time() - start)
        extension = uvicorn_deflate()  # a new connection: its own compression context
        start = time.thread_time()
        sent = [extension.encode(Frame(Opcode.BINARY, p)) for p in payloads]
        deflate_s.append(time.thread_time() - start)
        size_in, size_out = sum(map(len, payloads)), sum(len(f.data) for f in sent)
    return {
        "codec": codec,
        "rate_out": rate_out,
        "frames_per_message": frames_per_message,
        "messages_per_audio_s": len(wire) / audio_s,
        "deflate_ms_per_audio_s": 1000.0 * min(deflate_s) / audio_s,
        "msgpack_ms_per_audio_s": 1000.0 * min(pack_s) / audio_s,
        "bytes_per_audio_s": size_in / audio_s,
        "ratio": size_out / size_in,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"websockets {version('websockets')}; joe: {len(joe_utterance(RATE_IN)) / RATE_IN:.1f} s")
    print(
        "| codec | frames a message | messages per audio-s | deflate CPU ms per audio-s "
        "| msgpack ms per audio-s | bytes per audio-s | after / before |\n"
        "|---|---:|---:|---:|---:|---:|---:|"
    )
    rows = []
    for codec, rate_out, frames in (
        ("opus", 48000, 1),
        ("opus", 48000, 5),
        ("opus", 48000, 15),
        ("pcm16", 24000, 5),
    ):
        row = measure(codec, rate_out, frames, args.repeats)
        rows.append(row)
        print(
            f"| {codec} {rate_out // 1000} kHz | {frames} | {row['messages_per_audio_s']:.0f} "
            f"| {row['deflate_ms_per_audio_s']:.3f} | {row['msgpack_ms_per_audio_s']:.3f} "
            f"| {row['bytes_per_audio_s']:.0f} | {row['ratio']:.3f} |",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
