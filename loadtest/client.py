"""One simulated dialogue system and its listener on a voxgate WebSocket.

A session holds one connection and plays turns one after another: it streams
an answer as token deltas (like an LLM), its listener "plays" the audio on a
virtual playback clock, may barge in after a random share of the audio, waits
for playback to end, thinks, and starts the next turn. Everything the listener
would feel lands in a `TurnRecord`.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import msgpack
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from gateway.text.language import runs_of
from loadtest.config import LoadConfig
from loadtest.corpus import Answer, first_segment_token, tokenize
from loadtest.metrics import Outcome, PlaybackClock, TurnRecord

_CANCEL_TIMEOUT_S = 5.0
_RETRY_PAUSE_S = 1.0
_MAX_KEPT_TURNS = 4
# Errors that end the turn they name; others (e.g. for a session.update) do not.
_NON_ENDING = frozenset({"context_closed", "unsupported_option"})


@dataclass(slots=True)
class TurnPlan:
    """An answer cut into deltas, with its send intervals and listener behaviour."""

    answer: Answer
    tokens: list[str]
    intervals_s: list[float]  # pause after each token
    first_segment_index: int | None  # token completing the first segment; None: flush does
    barge_in_share: float | None  # cancel after this share of the audio; None: listen to the end

    @property
    def generation_s(self) -> float:
        return sum(self.intervals_s)


def plan_turn(answer: Answer, config: LoadConfig, rng: random.Random) -> TurnPlan:
    tokens = tokenize(answer.text)
    base = 1.0 / config.token_rate
    j = config.token_jitter
    intervals = [base * rng.uniform(1.0 - j, 1.0 + j) for _ in tokens]
    low, high = config.barge_in_shares
    share = rng.uniform(low, high) if rng.random() < config.barge_in_rate else None
    return TurnPlan(answer, tokens, intervals, first_segment_token(tokens), share)


@dataclass(slots=True)
class SpeechRate:
    """Audio ms per character, learnt from finished turns; sizes a barge-in's target."""

    ms_per_char: dict[str, float] = field(default_factory=lambda: {"en": 65.0, "zh": 230.0})

    def estimate_ms(self, answer: Answer) -> float:
        return self.ms_per_char.get(answer.lang, 65.0) * len(answer.text)

    def learn(self, answer: Answer, audio_ms: float) -> None:
        if audio_ms > 0:
            old = self.ms_per_char.get(answer.lang, 65.0)
            self.ms_per_char[answer.lang] = 0.8 * old + 0.2 * audio_ms / len(answer.text)


class TurnState:
    """The live side of a TurnRecord while its context is open."""

    __slots__ = (
        "cancel_answered",
        "cancel_sent_at",
        "cancelled_at",
        "clock",
        "ended",
        "first_frame_at",
        "first_token_at",
        "frame_arrived",
        "last_frame_at",
        "next_seq",
        "record",
        "segment_complete_at",
    )

    def __init__(self, record: TurnRecord, playout_delay_ms: float) -> None:
        self.record = record
        self.clock = PlaybackClock(playout_delay_ms)
        self.ended = asyncio.Event()
        self.frame_arrived = asyncio.Event()
        self.cancel_answered = asyncio.Event()
        self.first_token_at: float | None = None
        self.segment_complete_at: float | None = None
        self.first_frame_at: float | None = None
        self.last_frame_at: float | None = None
        self.cancel_sent_at: float | None = None
        self.cancelled_at: float | None = None
        self.next_seq = 0

    def end(self, outcome: Outcome) -> None:
        if not self.ended.is_set():
            self.record.outcome = outcome
            self.ended.set()
            self.frame_arrived.set()  # wakes a barge-in waiting for audio that will not come

    def on_audio(self, now: float, message: dict[str, Any]) -> None:
        record = self.record
        if self.cancelled_at is not None:
            record.violations.append("audio_after_cancelled")
            return
        if message.get("seq") != self.next_seq:
            record.violations.append("seq_gap")
        self.next_seq = int(message.get("seq", self.next_seq)) + 1
        duration_ms = float(message.get("duration_ms", 0.0))
        record.audio_ms += duration_ms
        record.num_frames += 1
        self.last_frame_at = now
        if self.first_frame_at is None:
            self.first_frame_at = now
        if self.cancel_sent_at is None:  # the listener stops listening at barge-in
            self.clock.on_frame(now, duration_ms)
        self.frame_arrived.set()

    def finalize(self) -> TurnRecord:
        """Fold the timestamps into the record's milliseconds (idempotent)."""
        r = self.record
        if self.first_frame_at is not None:
            if self.first_token_at is not None:
                r.ttfa_first_token_ms = (self.first_frame_at - self.first_token_at) * 1000.0
            if self.segment_complete_at is not None:
                # negative when the server spoke a clause before the sentence was complete
                r.ttfa_segment_ms = (self.first_frame_at - self.segment_complete_at) * 1000.0
        r.num_gaps, r.gap_ms, r.gaps_ms = self.clock.num_gaps, self.clock.gap_ms, self.clock.gaps
        r.gaps_at_ms = list(self.clock.gaps_at)
        if self.cancel_sent_at is not None and self.cancelled_at is not None:
            r.cancel_latency_ms = (self.cancelled_at - self.cancel_sent_at) * 1000.0
            last = self.last_frame_at
            r.cancel_to_last_frame_ms = (
                max(0.0, (last - self.cancel_sent_at) * 1000.0) if last is not None else 0.0)
        return r


def stream_url(base: str, config: LoadConfig) -> str:
    """ws(s)://host:port/v1/stream?encoding=...&codec=... from an http(s) or ws(s) base."""
    parts = urlsplit(base)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path if parts.path not in ("", "/") else "/v1/stream"
    query = {"encoding": config.encoding, **config.query}
    return urlunsplit((scheme, parts.netloc, path, urlencode(query), ""))


class VoxgateSession:
    """One connection playing turns until its deadline, its turn budget, or a stop."""

    def __init__(self, index: int, config: LoadConfig, corpus: list[Answer],
                 records: list[TurnRecord], rate: SpeechRate, turn_budget: list[int]) -> None:
        self.index = index
        self.config = config
        self.corpus = corpus
        self.records = records  # shared sink: every started turn is appended once
        self.rate = rate
        self.turn_budget = turn_budget  # [turns left] shared by all sessions of a run
        self.rng = random.Random(config.seed * 1_000_003 + index)
        self.num_connect_failures = 0
        self._ws: ClientConnection | None = None
        self._turns: dict[str, TurnState] = {}
        self._num_turns = 0
        self._reader: asyncio.Task[None] | None = None
        self._is_closing = False

    async def run(self, deadline: float, max_turns: int | None = None,
                  first_think: bool = True) -> None:
        loop = asyncio.get_running_loop()
        try:
            if first_think:  # spread the fleet's first turns over one think time
                await asyncio.sleep(min(self.rng.uniform(0, self.config.think_s),
                                        max(0.0, deadline - loop.time())))
            while loop.time() < deadline and (max_turns is None or self._num_turns < max_turns):
                if self.turn_budget[0] <= 0:
                    break
                if self._ws is None and not await self._connect():
                    await asyncio.sleep(1.0)
                    continue
                self.turn_budget[0] -= 1
                state = await self._play_turn(deadline)
                if max_turns is not None and self._num_turns >= max_turns:
                    break
                if state is not None and state.record.outcome is Outcome.COMPLETED:
                    await self._listen_out(state, deadline)
                pause = self.config.think_s * self.rng.uniform(0.5, 1.5)
                if state is not None and state.record.outcome is Outcome.FAILED:
                    pause = max(pause, _RETRY_PAUSE_S)  # a turned-away user tries again later
                await asyncio.sleep(max(0.0, min(pause, deadline - loop.time())))
        finally:
            await self._close()

    async def _connect(self) -> bool:
        try:
            self._ws = await asyncio.wait_for(
                connect(stream_url(self.config.url, self.config), compression=None,
                        max_size=None, open_timeout=None, close_timeout=2.0), timeout=10.0)
        except (OSError, asyncio.TimeoutError, ConnectionClosed, Exception):  # noqa: BLE001
            self.num_connect_failures += 1
            self._ws = None
            return False
        self._reader = asyncio.create_task(self._read_loop(self._ws))
        if self.config.session_options:
            await self._send({"type": "session.update", **self.config.session_options})
        return True

    async def _close(self) -> None:
        self._is_closing = True  # turns still open now are aborted by the run, not failed
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for state in self._turns.values():
            state.finalize()

    async def _send(self, message: dict[str, Any]) -> None:
        ws = self._ws
        if ws is None:
            raise ConnectionError("expected an open connection, got none (it was lost)")
        if self.config.encoding == "msgpack":
            await ws.send(msgpack.packb(message))
        else:
            await ws.send(json.dumps(message, ensure_ascii=False))

    async def _play_turn(self, deadline: float) -> TurnState | None:
        loop = asyncio.get_running_loop()
        plan = plan_turn(self.rng.choice(self.corpus), self.config, self.rng)
        context_id = f"s{self.index}-t{self._num_turns}"
        self._num_turns += 1
        record = TurnRecord(self.index, context_id, len(plan.tokens), len(plan.answer.text))
        self.records.append(record)
        state = TurnState(record, self.config.playout_delay_ms)
        self._turns[context_id] = state
        if len(self._turns) > _MAX_KEPT_TURNS:  # keep recent ones to catch late frames
            del self._turns[next(iter(self._turns))]
        barge = None
        if plan.barge_in_share is not None:
            barge = asyncio.create_task(self._barge_in(state, plan))
        try:
            await self._stream_text(state, plan, context_id)
            remaining = self.config.turn_timeout_s - (loop.time() - (state.first_token_at or 0))
            try:
                await asyncio.wait_for(state.ended.wait(), timeout=max(0.0, remaining))
            except asyncio.TimeoutError:
                state.end(Outcome.TIMED_OUT)
                if self._ws is not None:  # free the server's work for it
                    await self._send({"type": "cancel", "context_id": context_id})
            if record.outcome is Outcome.COMPLETED:
                self.rate.learn(plan.answer, record.audio_ms)
                if barge is not None:  # all audio is sent, the listener may still interrupt
                    await asyncio.wait_for(barge, max(0.0, state.clock.run_out_at - loop.time())
                                           + _CANCEL_TIMEOUT_S)
        except (ConnectionClosed, ConnectionError):
            self._fail(state, "connection_closed")
        except asyncio.TimeoutError:  # no answer to a cancel sent after context.done
            record.error_codes.append("cancel_unanswered")
        finally:
            if barge is not None:
                barge.cancel()
            state.finalize()
        return state

    async def _stream_text(self, state: TurnState, plan: TurnPlan, context_id: str) -> None:
        loop = asyncio.get_running_loop()
        for i, token in enumerate(plan.tokens):
            if state.ended.is_set() or state.cancel_sent_at is not None:
                return  # an interrupted LLM stops generating
            await self._send({"type": "text", "context_id": context_id, "text": token})
            now = loop.time()
            if i == 0:
                state.first_token_at = now
            if i == plan.first_segment_index:
                state.segment_complete_at = now
            await asyncio.sleep(plan.intervals_s[i])
        if state.ended.is_set() or state.cancel_sent_at is not None:
            return
        await self._send({"type": "flush", "context_id": context_id})
        if state.segment_complete_at is None:
            state.segment_complete_at = loop.time()

    async def _barge_in(self, state: TurnState, plan: TurnPlan) -> None:
        """Cancel once the listener has heard `share` of the (estimated) audio.

        The listener may interrupt while audio still arrives, or after
        `context.done` while the rest plays out; then the turn counts as
        cancelled after done and stays out of the cancel latency figures.
        """
        assert plan.barge_in_share is not None
        loop = asyncio.get_running_loop()
        target_ms = plan.barge_in_share * self.rate.estimate_ms(plan.answer)
        while True:
            if state.ended.is_set() and state.record.outcome is not Outcome.COMPLETED:
                return
            at = state.clock.time_at_played(target_ms)
            if at is None:  # that audio has not arrived yet
                if state.ended.is_set():
                    return  # it never will: the answer was shorter than estimated
                state.frame_arrived.clear()
                await state.frame_arrived.wait()
                continue
            if at > loop.time():
                await asyncio.sleep(at - loop.time())
                continue
            break
        played = state.clock.played_ms(loop.time())
        state.cancel_sent_at = loop.time()
        state.record.played_ms_at_cancel = played
        state.record.is_cancelled_after_done = state.ended.is_set()
        try:
            await self._send({"type": "cancel", "context_id": state.record.context_id,
                              "played_ms": round(played)})
        except (ConnectionClosed, ConnectionError):
            return  # the reader fails the turn
        if state.record.is_cancelled_after_done:
            await state.cancel_answered.wait()

    async def _listen_out(self, state: TurnState, deadline: float) -> None:
        """The user hears the answer to its end before replying."""
        loop = asyncio.get_running_loop()
        wait = min(state.clock.run_out_at, deadline) - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)

    def _fail(self, state: TurnState, code: str) -> None:
        if not state.ended.is_set():
            state.record.error_codes.append(code)
            state.end(Outcome.FAILED)

    async def _read_loop(self, ws: ClientConnection) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for frame in ws:
                now = loop.time()
                message = msgpack.unpackb(frame) if isinstance(frame, bytes) else json.loads(frame)
                if isinstance(message, dict):
                    self._dispatch(now, message)
        except ConnectionClosed:
            pass
        finally:
            if self._ws is ws:
                self._ws = None
            if not self._is_closing:
                for state in self._turns.values():
                    self._fail(state, "connection_closed")

    def _dispatch(self, now: float, message: dict[str, Any]) -> None:
        kind = message.get("type")
        state = self._turns.get(str(message.get("context_id")))
        if kind == "audio":
            if state is not None:
                state.on_audio(now, message)
        elif kind == "segment":
            if state is not None:
                letters = state.record.spoken_letters
                for run in runs_of(str(message.get("text", ""))):
                    letters[run.script] = letters.get(run.script, 0) + run.end - run.start
        elif kind == "text.skipped":
            if state is not None:
                skipped = state.record.skipped_chars
                language = str(message.get("language"))
                skipped[language] = skipped.get(language, 0) + len(str(message.get("text", "")))
        elif kind == "context.done":
            if state is not None:
                state.record.server_audio_ms = message.get("audio_ms")
                state.end(Outcome.COMPLETED)
        elif kind == "cancelled":
            if state is not None:
                state.cancelled_at = now
                if state.record.is_cancelled_after_done:
                    state.record.outcome = Outcome.CANCELLED
                else:
                    state.record.server_audio_ms = message.get("audio_ms_sent")
                    state.end(Outcome.CANCELLED)
                state.cancel_answered.set()
        elif kind == "error":
            self._on_error(message, state)

    def _on_error(self, message: dict[str, Any], state: TurnState | None) -> None:
        code = str(message.get("code", "unknown"))
        if state is None:  # a session-level error: charge it to the open turns
            targets = [s for s in self._turns.values() if not s.ended.is_set()]
        else:
            targets = [state]
        for target in targets[:1] or list(self._turns.values())[-1:]:
            target.record.error_codes.append(code)
        if message.get("fatal") or (state is not None and code not in _NON_ENDING):
            for target in targets:
                target.end(Outcome.FAILED)
