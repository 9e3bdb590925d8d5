"""The runtime's backlog: ready requests wait per replica until their engine has room."""

from __future__ import annotations

import pytest

from batchllm.core.requests import EngineRequest
from batchllm.runtime.backlog import Backlog
from batchllm.runtime.prepare import Planned


def requests(*ids: str) -> list[Planned]:
    return [Planned(EngineRequest(request_id=i, prompt=i), 0.0, 1.0) for i in ids]


def halves(batch: list[Planned], parts: int) -> list[list[Planned]]:
    """A splitter that deals requests out in turn."""
    return [batch[k::parts] for k in range(parts)]


IDLE2 = [0, 0]  # two replicas whose engines run nothing


def ids(batch: list[EngineRequest]) -> list[str]:
    return [r.request_id for r in batch]


def test_the_heaviest_list_goes_to_the_replica_with_the_least_work_and_take_keeps_order():
    backlog = Backlog()
    backlog.regroup(2, halves)
    backlog.add([requests("a"), requests("b", "c", "d")], loads=[0.0, 2.0])
    assert backlog.replicas == 2 and len(backlog) == 4
    assert ids(backlog.take(0, 2, IDLE2)) == ["b", "c"]  # three requests to replica 0, whose engine had no work
    assert ids(backlog.take(1, 10, IDLE2)) == ["a"]
    assert ids(backlog.take(0, 10, IDLE2)) == ["d"] and len(backlog) == 0


def test_waiting_requests_are_split_again_when_the_replica_count_changes():
    backlog = Backlog()
    backlog.regroup(1, halves)
    backlog.add([requests("a", "b", "c", "d")], loads=[0.0])
    backlog.take(0, 1, [0])  # "a" went to the engine and stays there
    backlog.regroup(2, halves)
    assert ids(backlog.take(0, 10, IDLE2)) == ["b", "d"] and ids(backlog.take(1, 10, IDLE2)) == ["c"]
    backlog.regroup(2, lambda batch, parts: pytest.fail("same count: nothing to split"))


def test_add_needs_one_list_and_one_load_per_replica():
    backlog = Backlog()
    backlog.regroup(2, halves)
    with pytest.raises(ValueError, match="1 lists and 1 loads for 2 replicas"):
        backlog.add([requests("a")], loads=[0.0])


def test_what_still_waits_counts_towards_a_replicas_load_and_what_was_taken_does_not():
    backlog = Backlog()
    backlog.regroup(2, halves)
    backlog.add([requests("a", "b", "c"), []], loads=[0.0, 0.0])  # replica 0 now has 3 waiting
    backlog.add([requests("d", "e"), []], loads=[0.0, 1.0])  # 0 + 3 waiting vs 1 + 0: to replica 1
    assert ids(backlog.take(1, 10, IDLE2)) == ["d", "e"]
    backlog.take(0, 3, IDLE2)  # replica 0's three left for its engine
    backlog.add([requests("f"), []], loads=[0.5, 2.0])  # 0.5 + 0 waiting vs 2 + 0: to replica 0
    assert ids(backlog.take(0, 10, IDLE2)) == ["f"] and len(backlog) == 0


def test_a_replica_that_runs_dry_takes_the_back_half_of_the_fullest_queue():
    backlog = Backlog()
    backlog.regroup(3, halves)
    backlog.add([requests("a", "b", "c", "d", "e", "f"), requests("g", "h"), requests("i")], loads=[0.0, 0.0, 0.0])
    assert ids(backlog.take(2, 1, [0, 0, 0])) == ["i"]
    assert ids(backlog.take(2, 2, [0, 0, 1])) == ["d", "e"]  # dry: d, e, f came over from the fullest queue, in their order
    assert ids(backlog.take(0, 10, [0, 0, 3])) == ["a", "b", "c"]
    assert ids(backlog.take(0, 10, [3, 0, 3])) == ["h"]  # the fullest now is g, h: its back half
    assert ids(backlog.take(2, 10, [4, 0, 3])) == ["f"] and ids(backlog.take(1, 10, [4, 0, 3])) == ["g"] and len(backlog) == 0
    assert backlog.take(1, 10, [4, 1, 3]) == []  # nothing left anywhere: nothing to take


def test_what_waits_behind_a_full_engine_stays_there():
    """Twin engines of 128 whose answers all run to max_tokens: one ends its batch a step before
    the other, which still has 20 waiting behind its 128. They go into that engine as its
    batch ends, a step later; taken away, they made the taker's next batch the larger one."""
    backlog = Backlog()
    backlog.regroup(2, halves)
    backlog.add([requests(*[f"w{i}" for i in range(20)]), []], loads=[0.0, 0.0])
    assert backlog.take(1, 128, [128, 0]) == [] and len(backlog) == 20
    assert len(backlog.take(0, 128, [0, 0])) == 20


def test_a_slow_replica_hands_over_what_waits_beyond_what_its_engine_runs():
    """A server the latency guard holds to 4 at once, with 12 waiting: the other takes half,
    then no more than leaves 4 waiting there."""
    backlog = Backlog()
    backlog.regroup(2, halves)
    backlog.add([requests(*[f"s{i}" for i in range(12)]), []], loads=[0.0, 0.0])
    assert ids(backlog.take(1, 10, [4, 0])) == [f"s{i}" for i in range(6, 12)]
    assert ids(backlog.take(1, 10, [4, 6])) == ["s4", "s5"]  # 6 wait behind 4: 2 come over
    assert backlog.take(1, 10, [4, 2]) == [] and len(backlog) == 4


def test_a_server_whose_guard_holds_its_calls_back_hands_over_its_queue():
    """The executor passes what each engine may run: a server the latency guard cut to 0 runs
    none of the 8 calls it holds, so what waits for it is there to take."""
    backlog = Backlog()
    backlog.regroup(2, halves)
    backlog.add([requests(*[f"h{i}" for i in range(8)]), []], loads=[0.0, 0.0])
    assert ids(backlog.take(1, 10, [0, 0])) == [f"h{i}" for i in range(4, 8)]


def test_take_needs_a_running_count_per_replica():
    backlog = Backlog()
    backlog.regroup(2, halves)
    with pytest.raises(ValueError, match="1 running counts for 2 replicas"):
        backlog.take(0, 1, [0])
