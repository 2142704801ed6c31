"""One simulated dialogue system and its listener on a voxgate WebSocket.

A session holds one connection and plays turns one after another: it streams
an answer as token deltas (like an LLM), its listener "plays" the audio on a
virtual playback clock, may barge in after a random share of the audio, waits
for playback to end, thinks, and starts the next turn. Everything the listener
would feel lands in a `TurnRecord`.

The protocol is the client's (`voxgate_client`, docs/client.md): its socket,
frames, routing, `cancel` and its answer. The load tool asks it for raw audio
(no decoding: durations come from the frames) and listens to each turn's
events as they are read (a `TurnListener`), so that it costs no more per
frame than a client written for it, and drives 128-256 sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.text.language import runs_of
from loadtest.config import LoadConfig
from loadtest.corpus import Answer, first_segment_token, tokenize
from loadtest.metrics import Outcome, TurnRecord
from loadtest.text_lead import TextLead
from voxgate_client import (
    AsyncVoxgate,
    Audio,
    Cancelled,
    ConnectionLost,
    Done,
    NoAnswer,
    PlaybackClock,
    Segment,
    ServerError,
    TextSkipped,
    Turn,
    TurnListener,
    VoxgateError,
)

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


class TurnState(TurnListener):
    """The live side of a TurnRecord while its context is open.

    The client's reader calls it for each of the turn's events as the frame is
    read (`voxgate_client.TurnListener`): raw, no queue, no decoding, each event
    stamped with the loop's time at arrival (`received_at`).

    It also remembers when the input text reached each point and where each
    segment ends in it (`text`, loadtest/text_lead.py), so that a gap before a
    segment says how long before the listener ran out its text was complete.
    """

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
        "on_lost",
        "record",
        "segment_complete_at",
        "text",
    )

    def __init__(self, record: TurnRecord, playout_delay_ms: float,
                 on_lost: Callable[[TurnState], None] | None = None) -> None:
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
        self.on_lost = on_lost  # the connection went: the session decides what it means
        self.text = TextLead()

    def end(self, outcome: Outcome) -> None:
        if not self.ended.is_set():
            self.record.outcome = outcome
            self.ended.set()
            self.frame_arrived.set()  # wakes a barge-in waiting for audio that will not come

    def on_audio(self, event: Audio) -> None:
        record = self.record
        if self.cancelled_at is not None:
            record.violations.append("audio_after_cancelled")
            return
        if event.seq != self.next_seq:
            record.violations.append("seq_gap")
        self.next_seq = event.seq + 1
        now, duration_ms = event.received_at, event.duration_ms
        record.audio_ms += duration_ms
        record.num_frames += 1
        self.last_frame_at = now
        if self.first_frame_at is None:
            self.first_frame_at = now
        if self.cancel_sent_at is None:  # the listener stops listening at barge-in
            clock = self.clock
            heard_ms, run_out_at, num_gaps = clock.audio_ms, clock.run_out_at, clock.num_gaps
            clock.on_frame(now, duration_ms)
            if clock.num_gaps > num_gaps:  # one entry per gap counted: parallel to gaps_ms
                record.gaps_text_lead_ms.append(
                    self.text.lead_ms(heard_ms, duration_ms, run_out_at))
        self.frame_arrived.set()

    def on_segment(self, event: Segment) -> None:
        letters = self.record.spoken_letters
        for run in runs_of(event.text):
            letters[run.script] = letters.get(run.script, 0) + run.end - run.start
        self.text.segment(event.text, event.pts_ms)

    def on_skipped(self, event: TextSkipped) -> None:
        skipped = self.record.skipped_chars
        skipped[event.language] = skipped.get(event.language, 0) + len(event.text)

    def on_done(self, event: Done) -> None:
        self.record.server_audio_ms = event.audio_ms
        self.end(Outcome.COMPLETED)

    def on_cancelled(self, event: Cancelled) -> None:
        self.cancelled_at = event.received_at
        if self.record.is_cancelled_after_done:
            self.record.outcome = Outcome.CANCELLED
        else:
            self.record.server_audio_ms = event.audio_ms_sent
            self.end(Outcome.CANCELLED)
        self.cancel_answered.set()

    def on_error(self, error: ServerError) -> None:
        self.record.error_codes.append(error.code)
        if error.fatal or error.code not in _NON_ENDING:
            self.end(Outcome.FAILED)

    def on_failed(self, error: BaseException) -> None:
        if isinstance(error, ConnectionLost) and self.on_lost is not None:
            self.on_lost(self)

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
        self._vg: AsyncVoxgate | None = None
        self._turns: dict[str, TurnState] = {}
        self._num_turns = 0
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
                refused: ServerError | None = None
                if self._vg is None or not self._vg.is_connected:
                    try:
                        if not await self._connect():
                            await asyncio.sleep(1.0)
                            continue
                    except ServerError as exc:  # turned away at the door: a failed turn
                        refused = exc
                self.turn_budget[0] -= 1
                state = await self._play_turn(deadline, refused)
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
        """A new socket (the client's, raw audio: nothing is decoded); False when none
        could be opened. A socket refused with an `error` (busy, unauthorized) raises it."""
        if self._vg is not None:
            await self._vg.close()  # the connection was lost: its turns have failed
        self._vg = None
        config = self.config
        options: dict[str, Any] = {**config.query, **config.session_options}
        vg = AsyncVoxgate(config.url, audio="raw", encoding=config.encoding, max_size=None,
                          on_error=self._on_session_error, **options)
        try:
            await vg.connect()
        except ServerError:
            raise
        except VoxgateError:
            self.num_connect_failures += 1
            return False
        self._vg = vg
        return True

    async def _close(self) -> None:
        self._is_closing = True  # turns still open now are aborted by the run, not failed
        vg, self._vg = self._vg, None
        if vg is not None:
            await vg.close()
        for state in self._turns.values():
            state.finalize()

    async def _play_turn(self, deadline: float, refused: ServerError | None = None,
                         ) -> TurnState | None:
        loop = asyncio.get_running_loop()
        plan = plan_turn(self.rng.choice(self.corpus), self.config, self.rng)
        context_id = f"s{self.index}-t{self._num_turns}"
        self._num_turns += 1
        record = TurnRecord(self.index, context_id, len(plan.tokens), len(plan.answer.text))
        self.records.append(record)
        state = TurnState(record, self.config.playout_delay_ms, self._on_lost)
        self._turns[context_id] = state
        if len(self._turns) > _MAX_KEPT_TURNS:  # keep recent ones for session-level errors
            del self._turns[next(iter(self._turns))]
        if refused is not None:  # the socket was refused: the turn fails with its error
            state.on_error(refused)
            state.finalize()
            return state
        assert self._vg is not None
        turn = self._vg.speak(context_id=context_id, listener=state)
        barge = None
        if plan.barge_in_share is not None:
            barge = asyncio.create_task(self._barge_in(state, plan, turn))
        try:
            await self._stream_text(state, plan, turn)
            remaining = self.config.turn_timeout_s - (loop.time() - (state.first_token_at or 0))
            try:
                await asyncio.wait_for(state.ended.wait(), timeout=max(0.0, remaining))
            except asyncio.TimeoutError:
                state.end(Outcome.TIMED_OUT)
                with contextlib.suppress(VoxgateError):  # free the server's work for it
                    await turn.cancel(timeout=_CANCEL_TIMEOUT_S)
            if record.outcome is Outcome.COMPLETED:
                self.rate.learn(plan.answer, record.audio_ms)
                if barge is not None:  # all audio is sent, the listener may still interrupt
                    await asyncio.wait_for(barge, max(0.0, state.clock.run_out_at - loop.time())
                                           + _CANCEL_TIMEOUT_S)
        except ConnectionLost:
            self._fail(state, "connection_closed")
        except asyncio.TimeoutError:  # no answer to a cancel sent after context.done
            record.error_codes.append("cancel_unanswered")
        finally:
            if barge is not None:
                barge.cancel()
            state.finalize()
        return state

    async def _stream_text(self, state: TurnState, plan: TurnPlan, turn: Turn) -> None:
        loop = asyncio.get_running_loop()
        try:
            for i, token in enumerate(plan.tokens):
                if state.ended.is_set() or state.cancel_sent_at is not None:
                    return  # an interrupted LLM stops generating
                await turn.push(token)
                now = loop.time()
                state.text.sent(token, now)
                if i == 0:
                    state.first_token_at = now
                if i == plan.first_segment_index:
                    state.segment_complete_at = now
                await asyncio.sleep(plan.intervals_s[i])
            if state.ended.is_set() or state.cancel_sent_at is not None:
                return
            await turn.flush()
        except ConnectionLost:
            raise
        except VoxgateError:
            return  # the turn ended (an error, a cancel) while a delta was going out
        if state.segment_complete_at is None:
            state.segment_complete_at = loop.time()

    async def _barge_in(self, state: TurnState, plan: TurnPlan, turn: Turn) -> None:
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
        try:  # answered: the turn's listener took the `cancelled` as it was read
            await turn.cancel(played_ms=round(played), timeout=self.config.turn_timeout_s)
        except NoAnswer:
            if state.record.is_cancelled_after_done:
                raise asyncio.TimeoutError from None  # counted as cancel_unanswered
        except VoxgateError:
            return  # the connection went, or the turn failed: counted where that happened

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

    def _on_lost(self, state: TurnState) -> None:
        if not self._is_closing:  # turns open when the run closes are aborted, not failed
            self._fail(state, "connection_closed")

    def _on_session_error(self, error: ServerError) -> None:
        """An error naming no open turn: charged to the first open turn (or the last
        one), and a fatal one ends every open turn."""
        targets = [s for s in self._turns.values() if not s.ended.is_set()]
        for target in targets[:1] or list(self._turns.values())[-1:]:
            target.record.error_codes.append(error.code)
        if error.fatal:
            for target in targets:
                target.end(Outcome.FAILED)
