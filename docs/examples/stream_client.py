"""Stream an answer into voxgate token by token and save the speech as a WAV file.

    python docs/examples/stream_client.py ws://127.0.0.1:8000/v1/stream answer.wav

Needs only `websockets` and `msgpack`: it asks for PCM16 audio at 24 kHz, so no
Opus decoder is involved.
"""

import asyncio
import json
import sys
import wave

import msgpack
import websockets

ANSWER = "Sure! The capital of France is Paris. It has been the capital since the tenth century."


async def main(url: str, out_path: str) -> None:
    async with websockets.connect(url + "?codec=pcm16&sample_rate=24000") as ws:
        ready = json.loads(await ws.recv())
        print("connected:", ready["session_id"])

        async def write_tokens() -> None:
            for token in ANSWER.replace(" ", "\0 ").split("\0"):   # word-sized deltas
                await ws.send(json.dumps({"type": "text", "context_id": "turn-1", "text": token}))
                await asyncio.sleep(0.02)                           # an LLM writing
            await ws.send(json.dumps({"type": "flush", "context_id": "turn-1"}))

        writer = asyncio.create_task(write_tokens())
        pcm = bytearray()
        while True:
            frame = await ws.recv()
            if isinstance(frame, bytes):
                message = msgpack.unpackb(frame)          # {"type": "audio", "data": PCM16 LE, ...}
                pcm += message["data"]
                continue
            event = json.loads(frame)
            if event["type"] == "segment":
                print(f"segment at {event['pts_ms']:.0f} ms: {event['text']}")
            elif event["type"] == "error":
                print("error:", event["code"], event["message"])
            elif event["type"] == "context.done":
                print(f"done: {event['audio_ms']:.0f} ms of audio")
                break
        await writer

    with wave.open(out_path, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(24000)
        wav.writeframes(bytes(pcm))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
