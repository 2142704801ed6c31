"""Stream an answer into voxgate token by token, save the speech as a WAV file, and optionally
barge in: the voxgate client with nothing but websockets installed (docs/client.md).

    pip install ./clients/python
    python docs/examples/stream_client.py ws://127.0.0.1:8000/v1/stream answer.wav
    python docs/examples/stream_client.py ws://127.0.0.1:8000/v1/stream cut.wav --barge-in-ms 1500

It asks for PCM16 at 24 kHz in raw mode, so no Opus decoder (and no numpy) is involved.
"""

import argparse
import asyncio
import wave

from voxgate_client import AsyncVoxgate

ANSWER = ("Sure! The capital of France is Paris. It has been the capital since the tenth "
          "century, apart from a few short spells.")


async def llm_tokens():
    """An offline stand-in for an LLM's stream: word-sized deltas, a little apart."""
    for token in ANSWER.replace(" ", "\0 ").split("\0"):
        yield token
        await asyncio.sleep(0.02)


async def main(url: str, out_path: str, barge_in_ms: float | None) -> None:
    async with AsyncVoxgate(url, codec="pcm16", sample_rate=24000, audio="raw") as vg:
        print("connected:", vg.session_id)
        turn = vg.speak(llm_tokens())
        pcm = bytearray()
        async for chunk in turn:
            if chunk.segment is not None and chunk.pts_ms == chunk.segment.pts_ms:
                print(f"segment at {chunk.pts_ms:.0f} ms: {chunk.segment.text}")
            pcm += chunk.data or b""
            if barge_in_ms is not None and chunk.pts_ms + chunk.duration_ms >= barge_in_ms:
                heard = await turn.cancel(played_ms=barge_in_ms)
                print(f"barge-in at {barge_in_ms:.0f} ms; heard: {heard.spoken_text!r}; "
                      f"not heard: {heard.unspoken_text!r}")
        if turn.done is not None:
            print(f"done: {turn.done.audio_ms:.0f} ms of audio")

    with wave.open(out_path, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(24000)
        wav.writeframes(bytes(pcm))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--barge-in-ms", type=float, help="cancel once this much has played")
    args = parser.parse_args()
    asyncio.run(main(args.url, args.out, args.barge_in_ms))
