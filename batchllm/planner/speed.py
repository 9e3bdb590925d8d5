"""How fast a planning node progresses under an execution plan: the planner's view of the
cost model, fit once per (node, replica shape) and then looked up.

The search evaluates thousands of (node, plan, remaining work) combinations; running the
iteration-level simulation for each would dominate it. Instead each (node, replica
shape) is simulated twice on a sample of the node's requests (m and m/2 requests on one
replica), which gives the line T(n) = drain_s + per_request_s * n for one replica at
saturation, and once with a single request, which gives the latency of one request
(`request_latency_s`). A plan with dp replicas splits the requests, so

    round time(n) = max(request_latency_s, per_request_s * n / dp)
    time to finish = start cost + sum of round times + drain_s

where a plain node is one round of all its requests and an iterating node (chain
summary) is one round per step, round k holding the rows that have a k-th element:
few long documents make the last rounds latency-bound, which is the real cost of chains.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchllm.costmodel.estimator import ExecutionPlan, Workload, estimate
from batchllm.costmodel.profile import Profile, ReplicaShape

SAMPLE_REQUESTS = 1024  # requests simulated per (node, shape): the line is fit on m and m/2


@dataclass(frozen=True)
class ShapeSpeed:
    """One replica of one shape serving one node's requests."""

    per_request_s: float  # added time per request at saturation
    drain_s: float  # the last batch finishing: T(n) - per_request_s * n
    request_latency_s: float  # one request alone
    start_s: float  # engine start + warm-up

    def plan_speed(self, plan: ExecutionPlan) -> "PlanSpeed":
        return PlanSpeed(plan, self.per_request_s / plan.dp, self.drain_s, self.request_latency_s, self.start_s)


@dataclass(frozen=True)
class PlanSpeed:
    plan: ExecutionPlan
    per_request_s: float  # of the whole plan: replicas share the requests
    drain_s: float
    request_latency_s: float
    start_s: float

    def round_s(self, requests: float) -> float:
        return max(self.request_latency_s, self.per_request_s * requests) if requests > 0 else 0.0

    def work_s(self, rounds: tuple[float, ...]) -> float:
        """Time to serve the rounds, without start cost and drain."""
        return sum(self.round_s(n) for n in rounds)


def fit_shape_speed(profile: Profile, shape: ReplicaShape, workload: Workload, *, seed: int = 0) -> ShapeSpeed:
    """Simulate a sample of the workload on one replica and fit the saturation line."""
    rng = np.random.default_rng(seed)
    count = len(workload)
    sample = np.sort(rng.choice(count, size=min(count, SAMPLE_REQUESTS), replace=False))
    half = sample[: max(1, sample.size // 2)]
    plan = ExecutionPlan(1, shape)

    def run_s(indices: np.ndarray) -> float:
        part = Workload(workload.prompt_tokens[indices], workload.max_tokens[indices],
                        cached_tokens=None if workload.cached_tokens is None else workload.cached_tokens[indices])
        return estimate(profile, plan, part, seed=seed, include_load=False).run_s

    full_s, half_s = run_s(sample), run_s(half)
    if sample.size > half.size:
        per_request_s = max((full_s - half_s) / (sample.size - half.size), full_s / sample.size * 0.05)
    else:
        per_request_s = full_s
    drain_s = max(full_s - per_request_s * sample.size, 0.0)
    median = int(np.argsort(workload.prompt_tokens)[count // 2])
    typical_output = np.minimum(workload.max_tokens[[median]], max(1, round(profile.lengths.mean())))
    alone = Workload(workload.prompt_tokens[[median]], workload.max_tokens[[median]], known_output_tokens=typical_output)
    latency_s = estimate(profile, plan, alone, include_load=False).run_s
    return ShapeSpeed(per_request_s, drain_s, latency_s, profile.shape(shape).start_cost_s)
