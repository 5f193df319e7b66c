import pytest
import torch

from rlt_engine.worker import graphs
from rlt_engine.worker.graphs import CaptureTally, bucket_sizes, capture


def test_buckets_double_up_to_the_slot_count():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]


def test_the_tally_counts_captures_and_their_time():
    tally = CaptureTally()
    for _ in range(3):
        with tally.timing():
            pass
    assert tally.graphs == 3
    assert tally.seconds >= 0.0


@pytest.mark.gpu
def test_cuda_capture_replays_what_it_ran_after_one_warm_up():
    x = torch.arange(8.0, device="cuda")
    calls = {"warm": 0, "run": 0}

    def warm() -> None:
        calls["warm"] += 1

    def run() -> torch.Tensor:
        calls["run"] += 1
        return x * 2 + 1

    graph, out = capture(run, torch.cuda.graph_pool_handle(), warm)
    assert calls == {"warm": graphs.WARMUP_RUNS, "run": 1}  # the warm-up, not run, ran eagerly
    x.copy_(torch.arange(8.0, 16.0, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.arange(8.0, 16.0, device="cuda") * 2 + 1)


@pytest.mark.gpu
def test_cuda_capture_that_fails_leaves_no_capture_open():
    def run() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        capture(run, torch.cuda.graph_pool_handle(), warm=lambda: None)
    assert not torch.cuda.is_current_stream_capturing()
    y = torch.ones(4, device="cuda") + 1  # the device still takes work
    assert y.sum().item() == 8.0


@pytest.mark.gpu
def test_cuda_captures_reuse_their_warm_up_memory():
    """Each warm-up frees what it allocated; the next capture's warm-up must get it back, not
    allocate again (a side stream per capture kept every warm-up's blocks to itself)."""
    size = 64 << 20
    pool = torch.cuda.graph_pool_handle()

    def run() -> torch.Tensor:
        return torch.ones(size, dtype=torch.uint8, device="cuda").sum()

    kept = [capture(run, pool) for _ in range(2)]  # the shared stream's and pool's first blocks
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    kept += [capture(run, pool) for _ in range(8)]
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() - before < 2 * size
    assert len(kept) == 10
