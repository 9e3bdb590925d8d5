"""The one load-balancing rule (longest processing time first), and that the cost model's
estimate and the runtime split a node's requests with it alike."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from batchllm.core.requests import EngineRequest
from batchllm.core.sampling import SamplingSpec
from batchllm.costmodel.estimator import ExecutionPlan, Workload, estimate
from batchllm.costmodel.profile import ReplicaShape
from batchllm.ordering.balance import balance
from batchllm.runtime.prepare import planned, split
from tests.test_costmodel import tiny_profile


def loads(work, parts) -> list[float]:
    return [float(np.asarray(work)[p].sum()) for p in parts]


def test_heaviest_first_to_the_least_loaded_part_each_part_in_the_given_order():
    # 5 -> part 0, 4 -> part 1, 3 -> part 1 (4 < 5), 2 -> part 0 (5 < 7), 1 -> part 0 (7 = 7: the lower part)
    parts = balance([5, 1, 4, 2, 3], 2)
    assert [p.tolist() for p in parts] == [[0, 1, 3], [2, 4]]
    assert loads([5, 1, 4, 2, 3], parts) == [8.0, 7.0]


def test_known_lpt_deal():
    #  sorted: 9 8 7 6 4 3 2 1 -> part 0: 9, 6, 4, 1 (ties to the lower part); part 1: 8, 7, 3, 2
    assert [p.tolist() for p in balance([9, 1, 8, 2, 7, 3, 6, 4], 2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]


def test_starting_loads_are_counted():
    assert [p.tolist() for p in balance([3, 3], 2, loads=[10, 0])] == [[], [0, 1]]
    assert [p.tolist() for p in balance([3, 3, 3], 3, loads=[0, 1, 2])] == [[0], [1], [2]]


@pytest.mark.parametrize("seed", range(20))
def test_largest_part_within_four_thirds_of_the_best(seed):
    rng = np.random.default_rng(seed)
    work = rng.integers(1, 50, size=9)
    parts = 3
    best = min(max(sum(w for w, p in zip(work, assign) if p == k) for k in range(parts))
               for assign in itertools.product(range(parts), repeat=len(work)))
    got = max(loads(work, balance(work, parts)))
    assert got <= best * 4 / 3 + 1e-9
    assert sorted(np.concatenate(balance(work, parts)).tolist()) == list(range(len(work)))


def test_same_input_same_split_and_bad_parts_refused():
    work = np.random.default_rng(1).lognormal(3, 1, 500)
    assert all((a == b).all() for a, b in zip(balance(work, 4), balance(work.copy(), 4)))
    with pytest.raises(ValueError, match="parts must be >= 1, got 0"):
        balance(work, 0)
    with pytest.raises(ValueError, match="2 starting loads for 3 parts"):
        balance(work, 3, loads=[0, 0])


def test_the_estimate_models_the_runtimes_split(monkeypatch):
    """Requests whose lengths are known (each generates its max_tokens): the replicas the
    estimator simulates get exactly the requests the runtime's split hands them."""
    import batchllm.costmodel.estimator as estimator

    rng = np.random.default_rng(7)
    prompts, outputs = rng.integers(10, 100, 60), rng.integers(1, 150, 60)  # within the profile's 256 positions
    requests = [EngineRequest(i, "x", sampling=SamplingSpec(max_tokens=int(o)), prompt_token_ids=tuple(range(int(p))))
                for i, (p, o) in enumerate(zip(prompts, outputs))]
    runtime = [sorted(p.request.request_id for p in part) for part in split(planned(requests), 3, 16, prefix_order=False).replicas]
    seen: list[list[list[int]]] = []
    monkeypatch.setattr(estimator, "balance", lambda work, parts: seen.append([p.tolist() for p in balance(work, parts)]) or
                        [np.asarray(p) for p in seen[-1]])
    estimate(tiny_profile(), ExecutionPlan(3, ReplicaShape(1)), Workload.of(prompts, max_tokens=outputs, known_output_tokens=outputs))
    assert seen == [runtime]
    assert runtime == [p.tolist() for p in balance([p.work for p in planned(requests)], 3)]
