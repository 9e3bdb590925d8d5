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

Requests do not finish at a steady rate when a replica holds them all at once (its
count is within a few batches): they start together and end in the order of their
output lengths, most of them near the end. A consumer fed by such a producer
(pipelining) waits for them, so each plan of a plain node also carries its output
curve: when its requests finish, as quantiles of their finish times over the run,
simulated on the plan's requests per replica (steady, the diagonal, beyond a few
batches).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchllm.costmodel.estimator import ExecutionPlan, Workload, estimate
from batchllm.costmodel.profile import Profile, ReplicaShape

SAMPLE_REQUESTS = 1024  # requests simulated per (node, shape): the line is fit on m and m/2
STEADY_BATCHES = 4  # a replica holding more than this many full batches finishes requests steadily
CURVE_POINTS = 20  # output curve: finish times at the 0, 1/20, ..., 1 quantiles


@dataclass(frozen=True)
class ShapeSpeed:
    """One replica of one shape serving one node's requests."""

    per_request_s: float  # added time per request at saturation
    drain_s: float  # the last batch finishing: T(n) - per_request_s * n
    request_latency_s: float  # one request alone
    start_s: float  # engine start + warm-up
    max_running: int = 0  # requests one replica runs at once (its max_num_seqs); 0: unknown

    def plan_speed(self, plan: ExecutionPlan, output_curve: tuple[float, ...] = ()) -> PlanSpeed:
        return PlanSpeed(plan, self.per_request_s / plan.dp, self.drain_s, self.request_latency_s, self.start_s,
                         output_curve, self.max_running * plan.dp)


@dataclass(frozen=True)
class PlanSpeed:
    plan: ExecutionPlan
    per_request_s: float  # of the whole plan: replicas share the requests
    drain_s: float
    request_latency_s: float
    start_s: float
    output_curve: tuple[float, ...] = ()  # finish time / run time at the 0, 1/k, ..., 1 quantiles; () = steady
    max_running: int = 0  # requests the plan's replicas run at once; 0: unknown

    def finished_share(self, progress: float) -> float:
        """Share of the requests finished when `progress` of the work is done."""
        if not self.output_curve:
            return progress
        if progress >= 1.0:
            return 1.0
        return float(np.interp(progress, self.output_curve, np.linspace(0.0, 1.0, len(self.output_curve))))

    def round_s(self, requests: float) -> float:
        return max(self.request_latency_s, self.per_request_s * requests) if requests > 0 else 0.0

    def work_s(self, rounds: tuple[float, ...]) -> float:
        """Time to serve the rounds, without start cost and drain."""
        return sum(self.round_s(n) for n in rounds)

    def run_s(self, rounds: tuple[float, ...]) -> float:
        """The whole run from a fresh start: the rounds and the last batch's drain."""
        return self.work_s(rounds) + self.drain_s


def fit_shape_speed(profile: Profile, shape: ReplicaShape, workload: Workload, *, seed: int = 0) -> ShapeSpeed:
    """Simulate a sample of the workload on one replica and fit the saturation line."""
    rng = np.random.default_rng(seed)
    count = len(workload)
    sample = np.sort(rng.choice(count, size=min(count, SAMPLE_REQUESTS), replace=False))
    half = sample[: max(1, sample.size // 2)]
    plan = ExecutionPlan(1, shape)

    def run_s(indices: np.ndarray) -> float:
        return estimate(profile, plan, _subset(workload, indices), seed=seed, include_load=False).run_s

    full_s, half_s = run_s(sample), run_s(half)
    if sample.size > half.size:
        per_request_s = max((full_s - half_s) / (sample.size - half.size), full_s / sample.size * 0.05)
    else:
        per_request_s = full_s
    drain_s = max(full_s - per_request_s * sample.size, 0.0)
    median = int(np.argsort(workload.prompt_tokens)[count // 2])
    if workload.output_lengths is None:
        typical_output = np.minimum(workload.max_tokens[[median]], max(1, round(profile.lengths.mean())))
    else:  # the median request's own expected length
        typical = workload.output_lengths.take([median]).expected(workload.max_tokens[[median]])
        typical_output = np.minimum(workload.max_tokens[[median]], np.maximum(1, np.rint(typical)).astype(np.int64))
    alone = Workload(workload.prompt_tokens[[median]], workload.max_tokens[[median]], known_output_tokens=typical_output)
    latency_s = estimate(profile, plan, alone, include_load=False).run_s
    return ShapeSpeed(per_request_s, drain_s, latency_s, profile.shape(shape).start_cost_s, int(profile.engine["max_num_seqs"]))


def output_curve(profile: Profile, shape: ReplicaShape, workload: Workload, per_replica: int, *, seed: int = 0) -> tuple[float, ...]:
    """When `per_replica` requests (drawn from the workload) on one replica finish: the
    0, 1/CURVE_POINTS, ..., 1 quantiles of their finish times, as shares of the run
    (many equal to 1 when most hit max_tokens together); () when they finish steadily."""
    if per_replica <= 1 or per_replica > STEADY_BATCHES * int(profile.engine["max_num_seqs"]) or len(workload) == 0:
        return ()
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(workload), size=per_replica, replace=per_replica > len(workload))
    finish_s = np.sort(estimate(profile, ExecutionPlan(1, shape), _subset(workload, picked), seed=seed, include_load=False).finish_s)
    if finish_s[-1] <= 0:
        return ()
    quantiles = np.quantile(finish_s / finish_s[-1], np.linspace(0.0, 1.0, CURVE_POINTS + 1))
    return tuple(float(q) for q in quantiles)


def _subset(workload: Workload, indices: np.ndarray) -> Workload:
    return Workload(workload.prompt_tokens[indices], workload.max_tokens[indices],
                    cached_tokens=None if workload.cached_tokens is None else workload.cached_tokens[indices],
                    output_lengths=None if workload.output_lengths is None else workload.output_lengths.take(indices))
