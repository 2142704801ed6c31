"""What one tick runs, as the scheduler planned it: the LM's run, then the token-to-wave run.

The runs carry a plan out and nothing else: they touch the LM driver, the
token-to-wave streams and the flow thread, and move each sequence along the
table's states (sequences.py) as its work is done. Every choice (who starts,
who gives a slot up, which flow rows run) was the scheduler's (scheduler.py).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from engine.backends.cosyvoice.frontend.frontend import LMInput
from engine.backends.cosyvoice.frontend.voice_prompts import CosyVoice
from engine.backends.cosyvoice.lm.driver import LMStart, SpeechLMDriver
from engine.backends.cosyvoice.scheduler import LMPlan
from engine.backends.cosyvoice.sequences import SeqState, Sequence, SequenceTable
from engine.backends.cosyvoice.t2w.streams import TokenToWave
from engine.backends.cosyvoice.t2w.worker import FlowWorker, HostChunk, chunks_to_host
from engine.errors import EngineBusyError


@dataclass(slots=True)
class SeqInputs:
    """What a sequence speaks and how (`Sequence.inputs`): its voice, its LM input (or the
    backend's CPU executor's future of it: text normalization and tokenization run off the
    worker thread), its speed (the mel is stretched before the vocoder), and whether its
    request brought its own seed (SamplingParams.seed)."""

    voice: CosyVoice
    frontend_work: LMInput | Future[LMInput]
    speed: float = 1.0
    is_seeded: bool = False

    @property
    def lm_input(self) -> LMInput:
        """The LM input, waited for if the frontend still runs (raising its error, if any)."""
        work = self.frontend_work
        return work.result() if isinstance(work, Future) else work

    @property
    def is_input_ready(self) -> bool:
        return not isinstance(self.frontend_work, Future) or self.frontend_work.done()


def inputs_of(seq: Sequence) -> SeqInputs:
    inputs = seq.inputs
    if not isinstance(inputs, SeqInputs):
        raise TypeError(f"expected a cosyvoice sequence's inputs, got {inputs!r}")
    return inputs


def run_lm(plan: LMPlan, table: SequenceTable, lm: SpeechLMDriver, t2w: TokenToWave,
           is_greedy: bool) -> dict[str, Exception]:
    """Preempt, start (one batched prefill), then one LM step for every slot holder of the plan;
    new tokens go into their flow streams. Returns the sequences that failed, by key (a bad
    prompt fails only its own request; what it held is freed by its release)."""
    for victim in plan.preempt:
        lm.stop(victim.key)
        table.move(victim, SeqState.PARKED)  # its flow stream and tokens stay: it resumes from them
    starts = []
    for seq in plan.start:
        inputs = inputs_of(seq)
        starts.append(LMStart(seq.key, inputs.lm_input, is_greedy, seq.tokens, seq.seed,
                              inputs.is_seeded))
    failed = lm.start(starts) if starts else {}
    errors: dict[str, Exception] = {}
    for seq in plan.start:
        if seq.key in failed:
            errors[seq.key] = failed[seq.key]
            continue
        if seq.state is SeqState.WAITING:  # new: its flow stream now (the room was counted)
            inputs = inputs_of(seq)
            try:
                t2w.add_stream(seq.key, inputs.voice.flow, seed=seq.seed, speed=inputs.speed)
            except EngineBusyError as exc:  # refused, never out of memory
                lm.stop(seq.key)
                errors[seq.key] = exc
                continue
        table.move(seq, SeqState.PREFILLING)
    decoding = [s for s in plan.decode if s.holds_slot]
    outputs = lm.step([s.key for s in decoding]) if decoding else {}
    for seq in decoding:
        out = outputs[seq.key]
        if out.tokens:
            seq.tokens += out.tokens
            t2w.feed(seq.key, out.tokens)
            if seq.state is SeqState.PREFILLING:
                table.move(seq, SeqState.DECODING)
        if not out.is_finished:
            continue
        if seq.tokens:  # its flow computes the last chunks
            t2w.finish(seq.key)
            table.move(seq, SeqState.FLUSHING)
        else:  # stopped before its first token: no audio at all
            t2w.drop(seq.key)
            table.move(seq, SeqState.DONE)
    return errors


class FlowRows(Protocol):
    def __call__(self, ready: list[str]) -> list[str]: ...


def run_flow(table: SequenceTable, t2w: TokenToWave, worker: FlowWorker | None, rows: FlowRows,
             wait: bool) -> None:
    """Compute a tick's flow rows (`rows`: the scheduler's pick among the streams ready then),
    each chunk's audio into its sequence's outbox.

    Serial (the CPU default): computed now. With the flow thread: the batch in
    flight is collected if it is done (waited for when `wait`: the LM had nothing
    to do, so an idle tick never spins), and the next one is submitted at once,
    so it computes while the LM decodes its next step.
    """
    if worker is None:
        keys = rows(t2w.ready())
        _deliver(table, chunks_to_host(t2w.run(keys)) if keys else [])
        return
    _deliver(table, worker.collect(wait=wait and worker.is_busy))
    if not worker.is_busy:
        keys = rows(t2w.ready())  # what the collected batch moved on is ready again
        if keys:
            worker.submit(keys)


def _deliver(table: SequenceTable, chunks: list[HostChunk]) -> None:
    for chunk in chunks:
        seq = table.get(chunk.stream_id)
        if seq is None:
            continue  # released while its chunk was computed
        seq.outbox.append(chunk.pcm)
        if chunk.is_final:  # its flow stream and cache blocks are gone with it (t2w/streams.py)
            seq.is_last_out = True
            table.move(seq, SeqState.DONE)
