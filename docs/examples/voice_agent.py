"""A voice agent in 15 lines: an LLM's token stream in, speakers out, Enter to barge in
(docs/client.md). pip install openai './clients/python[av,sounddevice]'"""

import asyncio
import sys

from openai import AsyncOpenAI

from voxgate_client import AsyncVoxgate, Player, Speakers, key_press


async def main(url: str = "ws://127.0.0.1:8000/v1/stream") -> None:
    llm = AsyncOpenAI()  # OPENAI_API_KEY; OPENAI_BASE_URL for any compatible server
    history = [{"role": "user", "content": "Tell me about Paris in a few sentences."}]
    async with AsyncVoxgate(url) as vg, Player(Speakers()) as player:
        stream = await llm.chat.completions.create(model="gpt-4o-mini", messages=history,
                                                   stream=True)
        turn = vg.speak(c.choices[0].delta.content async for c in stream if c.choices)
        print("Speaking; press Enter to interrupt.")
        heard = await player.play(turn, until=key_press())
        history.append({"role": "assistant", "content": heard.spoken_text})
        print("The listener heard:", heard.spoken_text)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
