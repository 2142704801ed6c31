"""A cancel in each state of the sequence table frees what the state holds: the LM slot, the flow
stream and its K/V cache blocks, and the table's counters return to zero (tiny random model, CPU;
the flow on its own thread, so a stream that is flushing, or whose last chunk is in flight, is
cancelled as the GPU default runs it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from engine.backend import BackendRequest
from engine.backends.cosyvoice.backend import CosyVoiceBackend
from engine.backends.cosyvoice.lm.driver import LMOutput, LMStart, SpeechLMDriver
from engine.backends.cosyvoice.sequences import SeqState, Sequence
from tests.support.cosyvoice_parity import one_torch_thread  # noqa: F401 (autouse)
from tests.support.cosyvoice_steps import Requests, make_backend
from tests.support.wait import wait_until

prepare = Requests("rel")
LONG = "A longer sentence that keeps the other stream speaking for a good while yet."
MAX_STEPS = 400


class SlowPrefill:
    """The torch LM driver, with a new stream's first step spent prefilling, as vLLM's is: a stream
    then holds its slot with no token yet (PREFILLING). A wrapper around the real driver, not a
    stand-in: slots and tokens are the runner's; only the first step of a start is deferred."""

    def __init__(self, driver: SpeechLMDriver) -> None:
        self.driver, self.prefilling = driver, set[str]()

    @property
    def num_free(self) -> int:
        return self.driver.num_free

    def start(self, requests: list[LMStart]) -> dict[str, Exception]:
        failed = self.driver.start(requests)
        self.prefilling.update(r.key for r in requests if r.key not in failed)
        return failed

    def step(self, keys: list[str]) -> dict[str, LMOutput]:
        out = {key: LMOutput([], False) for key in keys if key in self.prefilling}
        self.prefilling.difference_update(keys)
        out.update(self.driver.step([key for key in keys if key not in out]))
        return out

    def stop(self, key: str) -> None:
        self.prefilling.discard(key)
        self.driver.stop(key)

    def close(self) -> None:
        self.driver.close()


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CosyVoiceBackend]:
    made = make_backend(tmp_path_factory.getbasetemp(), max_batch_size=2, max_streams=2,
                        flow_thread="on")
    yield made
    made.close()


def state(item: BackendRequest) -> SeqState:
    seq = item.state
    assert isinstance(seq, Sequence)
    return seq.state


def step_until(backend: CosyVoiceBackend, batch: list[BackendRequest],
               done: Callable[[], bool]) -> None:
    for _ in range(MAX_STEPS):
        if done():
            return
        assert all(r.error is None for r in backend.step(batch))
    raise AssertionError(f"not reached in {MAX_STEPS} steps")


def to_waiting(backend: CosyVoiceBackend) -> list[BackendRequest]:
    return [prepare(backend, "Hello world.")]  # prepared, its text frontend maybe still running


def to_prefilling(backend: CosyVoiceBackend) -> list[BackendRequest]:
    real = backend.lm
    assert real is not None
    backend.lm = SlowPrefill(real)
    try:
        item = prepare(backend, "Hello world.")
        backend.step([item])
    finally:
        backend.lm = real
    return [item]


def to_decoding(backend: CosyVoiceBackend) -> list[BackendRequest]:
    item = prepare(backend, "Hello world, how are you?")
    for _ in range(3):
        backend.step([item])
    return [item]


def to_parked(backend: CosyVoiceBackend) -> list[BackendRequest]:
    victim = prepare(backend, LONG, due=9.0)
    for _ in range(3):
        backend.step([victim])
    urgent = [prepare(backend, "Hi.", due=1.0), prepare(backend, "Hello.", due=2.0)]
    backend.step(urgent)  # both slots for the batch: the one outside it, due last, gives its up
    return [victim, *urgent]


def to_flushing(backend: CosyVoiceBackend) -> list[BackendRequest]:
    item = prepare(backend, "Hi.")
    # its last chunk in flight
    step_until(backend, [item], lambda: state(item) is SeqState.FLUSHING)
    return [item]


def to_done_unreturned(backend: CosyVoiceBackend) -> list[BackendRequest]:
    item, other = prepare(backend, "Hi."), prepare(backend, LONG)
    step_until(backend, [item, other], lambda: state(item) is SeqState.FLUSHING)
    step_until(backend, [other], lambda: state(item) is SeqState.DONE)  # flushed outside the batch
    seq = item.state
    # its last audio, not returned
    assert isinstance(seq, Sequence) and seq.outbox and seq.is_last_out
    return [item, other]


@pytest.mark.parametrize(("drive", "first_state"), [
    (to_waiting, SeqState.WAITING),
    (to_prefilling, SeqState.PREFILLING),
    (to_decoding, SeqState.DECODING),
    (to_parked, SeqState.PARKED),
    (to_flushing, SeqState.FLUSHING),
    (to_done_unreturned, SeqState.DONE),
], ids=["waiting", "prefilling", "decoding", "parked", "flushing", "done-unreturned"])
def test_a_cancel_in_each_state_frees_its_slot_and_blocks(
        backend: CosyVoiceBackend, drive: Callable[[CosyVoiceBackend], list[BackendRequest]],
        first_state: SeqState) -> None:
    assert backend.model is not None and backend.lm is not None
    assert backend.model.t2w.cached is not None
    cache, lm, table = backend.model.t2w.cached.cache, backend.lm, backend.table
    free_slots, free_blocks = lm.num_free, cache.num_free_blocks
    items = drive(backend)
    assert state(items[0]) is first_state
    for item in items:  # the engine's cancel of each, in turn
        backend.release(item)
        assert item.state is None
    assert (len(table), table.num_slots, table.num_flows) == (0, 0, 0)
    assert lm.num_free == free_slots
    # a chunk still in flight on the flow thread gives its blocks back when it ends
    wait_until(lambda: (cache.num_streams, cache.num_free_blocks) == (0, free_blocks), timeout=30.0,
               message=lambda: f"{cache.num_streams} streams, "
                               f"{cache.num_free_blocks} of {free_blocks} blocks free")
    flow_worker = backend.flow_worker
    assert flow_worker is not None
    assert flow_worker.collect(wait=True, timeout=30.0) == []  # nothing of them comes back
    assert backend.model.t2w.num_streams == 0
