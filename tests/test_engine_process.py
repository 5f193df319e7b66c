"""engine_process.Clients over real pipes: each server gets its own requests' answers and
outputs (the first connected one also the engine's stats), a server that goes away has its
requests aborted, and the core stops with the last server (gracefully if one asked)."""

from __future__ import annotations

import multiprocessing
import threading
import time

from rlt_engine.engine_core import AbortRequest, AddRequest, CoreReady, CoreTurn, Inbox, StopCore
from rlt_engine.engine_process import Clients, client_pipes
from rlt_engine.outputs import RequestMetrics, RequestOutput
from rlt_engine.sampling_params import SamplingParams


def _out(rid: str, finished: bool = False) -> RequestOutput:
    reason = "length" if finished else None
    return RequestOutput(
        rid, [1], [7], [4], "x", None, 1, finished, reason, RequestMetrics(0.0, None, None)
    )


def _pipes(n: int):  # type: ignore[no-untyped-def]
    return client_pipes(multiprocessing.get_context(), n)


def _drain(inbox: Inbox, want: int, timeout: float = 10.0) -> list:  # type: ignore[type-arg]
    got: list = []  # type: ignore[type-arg]
    for _ in range(int(timeout / 0.01)):
        got += inbox.drain()
        if len(got) >= want:
            return got
        time.sleep(0.01)
    return got


def test_each_server_gets_its_own_requests() -> None:
    engine_ends, server_ends = _pipes(2)
    inbox = Inbox()
    clients = Clients([events for _, events in engine_ends], inbox)
    readers = [threading.Thread(target=clients.read, args=(i, commands), daemon=True)
               for i, (commands, _) in enumerate(engine_ends)]  # fmt: skip
    for reader in readers:
        reader.start()
    params = SamplingParams(max_tokens=2)
    server_ends[0][0].send([AddRequest("a", [1], params), AddRequest("b", [2], params)])
    server_ends[1][0].send(AddRequest("c", [3], params))
    got = _drain(inbox, 3)
    assert sorted(c.request_id for c in got) == ["a", "b", "c"]

    clients.emit(CoreReady(info=None))  # type: ignore[arg-type]
    turn = CoreTurn(
        accepted=["a", "c"],
        refused=[("b", "ValueError", "too long")],
        outputs=[_out("a"), _out("c", finished=True)],
        failed=[],
        stats="stats",  # type: ignore[arg-type]
        wall_s=0.5,
    )
    clients.emit(turn)
    ready0, turn0 = server_ends[0][1].recv(), server_ends[0][1].recv()
    ready1, turn1 = server_ends[1][1].recv(), server_ends[1][1].recv()
    assert isinstance(ready0, CoreReady) and isinstance(ready1, CoreReady)
    assert (turn0.accepted, turn0.refused, [o.request_id for o in turn0.outputs]) == (
        ["a"], [("b", "ValueError", "too long")], ["a"])  # fmt: skip
    assert (turn0.stats, turn0.wall_s) == ("stats", 0.5)  # the first server counts the engine
    assert (turn1.accepted, [o.request_id for o in turn1.outputs]) == (["c"], ["c"])
    assert (turn1.stats, turn1.wall_s) == (None, None)
    assert clients.owner == {"a": 0}  # b refused, c finished

    # server 0 goes away (its pipe closes): its running request is aborted; server 1 says
    # StopCore, and as the last one it stops the core gracefully
    server_ends[0][0].close()
    got = _drain(inbox, 1)
    assert [(type(c), c.request_id) for c in got] == [(AbortRequest, "a")]
    server_ends[1][0].send(StopCore())
    got = _drain(inbox, 1)
    assert len(got) == 1 and isinstance(got[0], StopCore) and not got[0].now
    for reader in readers:
        reader.join(5)
        assert not reader.is_alive()


def test_the_core_stops_at_once_when_every_server_is_gone() -> None:
    engine_ends, server_ends = _pipes(2)
    inbox = Inbox()
    clients = Clients([events for _, events in engine_ends], inbox)
    for i, (commands, _) in enumerate(engine_ends):
        threading.Thread(target=clients.read, args=(i, commands), daemon=True).start()
    for commands, _ in server_ends:
        commands.close()
    got = [c for c in _drain(inbox, 1) if isinstance(c, StopCore)]
    assert len(got) == 1 and got[0].now
    # a turn for a server that is gone is dropped, not an error
    clients.emit(CoreTurn(stats=None))


def test_an_api_server_reads_every_event_of_a_real_engine_without_torch() -> None:
    """The events a real engine emits (ready, its first stats, the adds' answers, outputs,
    each step's stats, stopped), unpickled in a fresh process that imports what an API server
    imports: none of them makes it import torch. EngineStats once lived in rlt_engine.engine,
    so the first turn with stats made an API server import torch (~1 s, seconds under load)
    on its event thread, where it delivered nothing meanwhile."""
    import pickle
    import subprocess
    import sys

    from rlt_engine import LLM
    from rlt_engine.engine_core import run_core

    llm = LLM("demo", device="cpu", dtype="float32", max_num_seqs=2)
    inbox = Inbox()
    inbox.put([AddRequest("a", [5, 6, 7], SamplingParams(max_tokens=3)), StopCore()])
    events: list = []  # type: ignore[type-arg]
    run_core(lambda: llm.engine, inbox, events.append)
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "CoreReady" and kinds[-1] == "CoreStopped", kinds
    turns = [e for e in events if isinstance(e, CoreTurn)]
    assert turns[0].stats is not None and not turns[0].outputs  # the stats sent with ready
    assert any(t.outputs for t in turns) and all(t.stats is not None for t in turns)
    reader = (
        "import pickle, sys\n"
        "import rlt_engine.server.api_servers, rlt_engine.server.launch\n"
        "assert 'torch' not in sys.modules, 'an API server imports torch by itself'\n"
        "events = pickle.loads(sys.stdin.buffer.read())\n"
        "assert events[1].stats.blocks_total > 0\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", reader], input=pickle.dumps(events), capture_output=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().strip() == "False"
