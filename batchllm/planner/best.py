"""What batchllm runs: the best of several searches on the same costs.

Greedy with rollouts always; the Max and Min heuristics (one of them can end earlier,
e.g. when one engine handed from node to node of the same model saves every restart);
and, for DAGs of at most EXACT_MAX_NODES planning nodes, the branch and bound search
from that incumbent with a small budget (measured: SamuLLM's 5-model routing scenario
goes from 353 s to 340 s in about 0.1 s more, the best found with 20x the budget being
333 s). The search time covers all of them.
"""

from __future__ import annotations

import time

from batchllm.planner.baselines import max_heuristic, min_heuristic
from batchllm.planner.exact import exact_schedule
from batchllm.planner.rollout import rollout_schedule
from batchllm.planner.schedule import Schedule
from batchllm.planner.timeline import Timeline

EXACT_MAX_NODES = 5
EXACT_BUDGET_STAGES = 1000


def best_schedule(timeline: Timeline) -> Schedule:
    started = time.perf_counter()
    candidates = [rollout_schedule(timeline), max_heuristic(timeline), min_heuristic(timeline)]
    if len(timeline.states) <= EXACT_MAX_NODES:
        incumbent = min(candidates, key=lambda s: s.total_s)
        candidates.append(exact_schedule(timeline, max_stages_tried=EXACT_BUDGET_STAGES, incumbent=incumbent))
    best = min(candidates, key=lambda s: s.total_s)
    return Schedule(best.method, best.stages, best.total_s, time.perf_counter() - started, best.optimal)
