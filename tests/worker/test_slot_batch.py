"""The slot batch's row writes: inits and clears wait on the host until `flush`, then land as if
each had been written in order; on CUDA they never wait for the stream."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlt_engine.core.exit_rule import LoopControls
from rlt_engine.core.plan import SlotInit
from rlt_engine.sampling_params import SamplingParams
from rlt_engine.worker.batched_sampler import SEEN_OUTPUT
from rlt_engine.worker.slot_batch import MAX_STOP_IDS, SlotBatch

DEPTH = 4
VOCAB = 10


def batch(device: str = "cpu", num_slots: int = 4) -> SlotBatch:
    return SlotBatch(num_slots, 2, 8, 16, torch.float32, torch.device(device), vocab_size=VOCAB)


def slot_init(slot: int, stop: tuple[int, ...] = (7, 9), **params: object) -> SlotInit:
    return SlotInit(
        slot=slot,
        params=SamplingParams(max_tokens=5, **params),
        seed=(1 << 64) - 3,  # wraps into the signed range
        controls=LoopControls(min_loops=2, max_loops=3, exit_threshold=0.5),
        stop_token_ids=stop,
        prompt_len=4,
        block_tables=((1, 2), (3, 4)),
    )


def row(s: SlotBatch, slot: int) -> dict[str, object]:
    return {name: getattr(s, name)[slot].tolist() for name in SlotBatch.FIELDS if name != "hidden"}


def test_init_lands_at_flush() -> None:
    s = batch()
    s.init(slot_init(1, temperature=0.7, top_k=5, top_p=0.9), DEPTH)
    assert s.max_tokens[1].item() == 0, "nothing is written before the flush"
    s.flush()
    r = row(s, 1)
    assert (r["min_loops"], r["max_loops"], r["max_tokens"], r["top_k"]) == (2, 3, 5, 5)
    assert r["threshold"] == 0.5 and r["top_p"] == pytest.approx(0.9)
    assert r["temperature"] == pytest.approx(0.7) and r["seed"] == -3
    assert r["stop_ids"] == [7, 9] + [-1] * (MAX_STOP_IDS - 2)
    assert (r["active"], r["parked"], r["loop"], r["generated"], r["remaining"]) == (
        False,
        False,
        0,
        0,
        1.0,
    )
    assert s.block_tables[1, :, :2].tolist() == [[1, 2], [3, 4]]
    assert row(s, 0)["max_tokens"] == 0, "other slots untouched"


def test_fixed_depth_threshold_is_unreachable() -> None:
    s = batch()
    op = slot_init(0)
    s.init(SlotInit(**{**op.__dict__, "controls": LoopControls(1, DEPTH, 1.0)}), DEPTH)
    s.flush()
    assert s.threshold[0].item() == 2.0 and not s.host[0].early_exit


def test_the_last_write_to_a_row_wins() -> None:
    """A slot freed and given to a new request in one plan: the new request's row, and a
    shorter stop list leaves none of the old ids behind."""
    s = batch()
    s.init(slot_init(2, stop=(1, 2, 3, 4), temperature=0.8), DEPTH)
    s.flush()
    s.active[2] = True
    s.generated[2] = 3
    s.clear(2)
    s.init(slot_init(2, stop=(5,)), DEPTH)  # greedy
    s.flush()
    r = row(s, 2)
    assert r["stop_ids"] == [5] + [-1] * (MAX_STOP_IDS - 1)
    assert (r["active"], r["generated"], r["temperature"]) == (False, 0, 0.0)


def test_restore_is_not_overwritten_by_a_pending_clear() -> None:
    """Swap out, clear, and a restore into the same slot in one plan: the restored row stays."""
    s = batch()
    s.init(slot_init(0), DEPTH)
    s.flush()
    s.active[0], s.generated[0], s.loop[0] = True, 4, 2
    saved = s.snapshot(0)
    s.clear(0)
    s.restore(0, saved, ((5,), (6,)))
    s.flush()
    r = row(s, 0)
    assert (r["active"], r["generated"], r["loop"], r["stop_ids"][:2]) == (True, 4, 2, [7, 9])


def test_table_appends_land_at_flush_after_the_tables_before() -> None:
    """Appends wait on the host with the row writes and land after the blocks already there; a
    slot freed and given to a new request in the same plan holds the new request's tables."""
    s = batch()
    s.init(slot_init(0), DEPTH)
    s.init(slot_init(1), DEPTH)
    s.flush()
    s.append(0, ((8, 10), (9, 11)))
    s.append(1, ((12,), (13,)))
    assert s.block_tables[0, :, 2].tolist() == [0, 0], "nothing is written before the flush"
    s.append(0, ((14,), (15,)))
    s.clear(1)
    s.init(SlotInit(**{**slot_init(1).__dict__, "block_tables": ((20,), (21,))}), DEPTH)
    s.append(1, ((22,), (23,)))
    s.flush()
    assert s.block_tables[0, :, :5].tolist() == [[1, 2, 8, 10, 14], [3, 4, 9, 11, 15]]
    assert s.block_tables[1, :, :2].tolist() == [[20, 22], [21, 23]]
    assert (s.host[0].blocks, s.host[1].blocks) == (5, 2)
    assert s.max_context(block_size=16) == 80
    with pytest.raises(ValueError, match="3 block tables for 2 KV planes"):
        s.append(0, ((1,), (2,), (3,)))
    with pytest.raises(RuntimeError, match="longer than 8 blocks"):
        s.append(0, ((1, 2, 3, 4), (5, 6, 7, 8)))


def test_snapshot_sees_pending_writes() -> None:
    s = batch()
    s.init(slot_init(3), DEPTH)
    state, host = s.snapshot(3)
    assert state["max_tokens"].item() == 5 and host.params.max_tokens == 5


def test_clear_of_a_slot_never_used_is_a_write_too() -> None:
    s = batch()
    s.stop_ids[1] = 4
    s.clear(1)
    s.flush()
    assert row(s, 1)["stop_ids"] == [-1] * MAX_STOP_IDS


@pytest.mark.gpu
def test_slot_writes_never_wait_for_the_stream() -> None:
    """A scalar write to a CUDA tensor is a pageable copy that synchronises the stream; the row
    writes and an eager prefill's start of decoding must not be (they run while a window is in
    flight)."""
    s = batch("cuda", num_slots=8)
    # the test's own tensors first: `torch.tensor(..., device="cuda")` is a pageable copy
    slots = torch.tensor([1, 3], device="cuda")
    tokens = torch.tensor([7, 11], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for slot in range(8):
            s.init(slot_init(slot, temperature=0.5), DEPTH)
        s.flush()
        for slot in range(0, 8, 2):
            s.clear(slot)
        s.init(slot_init(0, stop=()), DEPTH)
        s.append(0, ((8,), (9,)))
        s.flush()
        s.start_decode(slots, tokens, slots + 4, refill=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert s.max_tokens.tolist() == [5] * 8
    assert s.stop_ids[0].tolist() == [-1] * MAX_STOP_IDS
    assert s.block_tables[0, :, :3].tolist() == [[1, 2, 8], [3, 4, 9]]
    # slot 1's first token is a stop id: it ends there; slot 3 decodes from position 7, parked
    assert s.active[[1, 3]].tolist() == [False, True] and s.parked[[1, 3]].tolist() == [True] * 2
    assert s.position[[1, 3]].tolist() == [5, 7] and s.generated[[1, 3]].tolist() == [1, 1]


@pytest.mark.gpu
def test_snapshot_and_restore_never_wait_for_the_stream() -> None:
    """A preemption while windows are in flight: the slot's state goes to host memory and back
    into another slot without a synchronising copy, and arrives whole."""
    s = batch("cuda", num_slots=4)
    s.init(slot_init(1, temperature=0.5), DEPTH)
    s.flush()
    s.generated[1], s.position[1] = 3, 9
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        saved = s.snapshot(1)
        s.clear(1)
        s.restore(2, saved, ((5,), (6,)))
        s.flush()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert row(s, 2)["generated"] == 3 and row(s, 2)["position"] == 9
    assert row(s, 2)["max_tokens"] == 5 and row(s, 1)["max_tokens"] == 5  # a clear keeps it
    assert s.block_tables[2, :, 0].tolist() == [5, 6] and not s.active[1].item()


def test_penalized_rows_keep_what_they_have_seen_through_reuse_and_preemption() -> None:
    s = batch()
    assert s.seen is None and not s.any_logit_edits(), "made by the first penalized request only"
    s.init(slot_init(0), DEPTH)
    assert s.seen is None
    penalized = dataclasses.replace(
        slot_init(1, repetition_penalty=1.2), prompt_token_ids=(3, 5, 3)
    )
    s.init(penalized, DEPTH)
    s.flush()
    assert s.any_logit_edits() and not s.any_logit_edits([0])
    assert s.seen[1].tolist() == [0, 0, 0, 1, 0, 1, 0, 0, 0, 0]  # the prompt bit
    assert s.repetition[1].item() == pytest.approx(1.2)
    # slot 1's outputs 5 (committed) and 7 (not); slot 0's 2 (not penalized: harmless)
    s.count_output(slice(0, 2), torch.tensor([2, 5]), torch.tensor([True, True]))
    s.count_output(slice(1, 2), torch.tensor([7]), torch.tensor([False]))
    assert s.seen[1, 5].item() == 1 + SEEN_OUTPUT and s.seen[1, 7].item() == 0
    # repeated rows (a padded wave repeats its first) write once
    s.count_output(torch.tensor([1, 1, 1]), torch.tensor([8, 8, 8]), torch.tensor([True] * 3))
    assert s.seen[1, 8].item() == SEEN_OUTPUT
    saved = s.snapshot(1)
    s.clear(1)
    s.init(dataclasses.replace(slot_init(1, frequency_penalty=1.0), prompt_token_ids=()), DEPTH)
    s.flush()
    assert s.seen[1].tolist() == [0] * VOCAB, "a new request starts with nothing seen"
    s.clear(1)
    s.restore(2, saved, ((6,), (7,)))
    s.flush()
    assert s.seen[2].tolist() == [0, 0, 0, 1, 0, 1 + SEEN_OUTPUT, 0, 0, SEEN_OUTPUT, 0]
    assert s.repetition[2].item() == pytest.approx(1.2)
