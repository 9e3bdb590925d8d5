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

Below saturation the line is not the time: a replica holding all its requests at once runs
them in about as many steps as the longest answer, whatever their count, and a KV cache that
holds only part of them runs them in waves. So the simulation at m/4 is kept too, and below
m/2 the round time follows the simulated times (`time_points`) instead of the line: measured on
276 long answers of the embedded model, the line said 87 s for 69 requests on a replica that
the simulation ran in 73 s. The rest of a round (its requests not done yet) takes the time
those requests take (`rest_of_round_s`), not its share of the whole round's.

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

from dataclasses import dataclass, field

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
    time_points: tuple[tuple[float, float], ...] = ()  # (requests, simulated time) on one replica, ascending

    def plan_speed(self, plan: ExecutionPlan, output_curve: tuple[float, ...] = ()) -> PlanSpeed:
        return PlanSpeed(plan, self.per_request_s / plan.dp, self.drain_s, self.request_latency_s, self.start_s,
                         output_curve, self.max_running * plan.dp, tuple((n * plan.dp, t) for n, t in self.time_points))


@dataclass(frozen=True)
class PlanSpeed:
    plan: ExecutionPlan
    per_request_s: float  # of the whole plan: replicas share the requests
    drain_s: float
    request_latency_s: float
    start_s: float
    output_curve: tuple[float, ...] = ()  # finish time / run time at the 0, 1/k, ..., 1 quantiles; () = steady
    max_running: int = 0  # requests the plan's replicas run at once; 0: unknown
    time_points: tuple[tuple[float, float], ...] = ()  # (the plan's requests, simulated time), ascending; (): the line
    _below: tuple[tuple[float, float], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        below: tuple[tuple[float, float], ...] = ()
        if len(self.time_points) >= 3:  # the simulated times below the line's first point, less the drain, from 0 at 0
            top, points = 0.0, [(0.0, 0.0)]
            for n, t in self.time_points[:-1]:
                top = max(top, t - self.drain_s)  # never falling
                points.append((n, top))
            below = tuple(points)
        object.__setattr__(self, "_below", below)

    def _work_s(self, requests: float) -> float:
        """Time the requests take less the drain: the simulated times' curve up to the line's
        first point, the saturation line beyond it (the line runs through the last two points)."""
        below = self._below
        if not below or requests >= below[-1][0]:
            return self.per_request_s * requests
        return _through(below, requests)

    def _requests_for_work_s(self, work_s: float) -> float:
        """The inverse of `_work_s`."""
        below = self._below
        if not below or work_s >= self._work_s(below[-1][0]):
            return work_s / self.per_request_s if self.per_request_s > 0 else 0.0
        return _through(tuple((y, x) for x, y in below), work_s)

    def rest_of_round_s(self, requests: float, done_share: float) -> float:
        """Time left of a round of `requests` when `done_share` of them is done: the time its
        requests left take, in the round's own measure (`round_s` for all of them)."""
        whole_work = self._work_s(requests)
        if whole_work <= 0 or not self._below:
            return (1.0 - done_share) * self.round_s(requests)
        return self.round_s(requests) * self._work_s(requests * (1.0 - done_share)) / whole_work

    def done_share_after(self, requests: float, done_share: float, seconds: float) -> float:
        """The share of a round of `requests` done after `seconds` more of it (`rest_of_round_s`'s inverse)."""
        whole_work, whole = self._work_s(requests), self.round_s(requests)
        if whole <= 0:
            return 1.0
        if whole_work <= 0 or not self._below:
            return done_share + seconds / whole
        left_work = self._work_s(requests * (1.0 - done_share)) - seconds * whole_work / whole
        return min(1.0, max(done_share, 1.0 - self._requests_for_work_s(max(0.0, left_work)) / requests))

    def finished_share(self, progress: float) -> float:
        """Share of the requests finished when `progress` of the work is done."""
        if not self.output_curve:
            return progress
        if progress >= 1.0:
            return 1.0
        return float(np.interp(progress, self.output_curve, np.linspace(0.0, 1.0, len(self.output_curve))))

    def round_s(self, requests: float) -> float:
        return max(self.request_latency_s, self._work_s(requests)) if requests > 0 else 0.0

    def work_s(self, rounds: tuple[float, ...]) -> float:
        """Time to serve the rounds, without start cost and drain."""
        return sum(self.round_s(n) for n in rounds)

    def run_s(self, rounds: tuple[float, ...]) -> float:
        """The whole run from a fresh start: the rounds and the last batch's drain."""
        return self.work_s(rounds) + self.drain_s


def _through(points: tuple[tuple[float, float], ...], x: float) -> float:
    """The broken line through `points` (ascending x) at x, within their range (flat where x repeats)."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 if x1 <= x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def fit_shape_speed(profile: Profile, shape: ReplicaShape, workload: Workload, *, seed: int = 0) -> ShapeSpeed:
    """Simulate a sample of the workload on one replica and fit the saturation line."""
    rng = np.random.default_rng(seed)
    count = len(workload)
    sample = np.sort(rng.choice(count, size=min(count, SAMPLE_REQUESTS), replace=False))
    half = sample[: max(1, sample.size // 2)]
    plan = ExecutionPlan(1, shape)

    def run_s(indices: np.ndarray) -> float:
        return estimate(profile, plan, _subset(workload, indices), seed=seed, include_load=False).run_s

    quarter = sample[: max(1, sample.size // 4)]
    full_s, half_s = run_s(sample), run_s(half)
    points: tuple[tuple[float, float], ...] = ((float(quarter.size), run_s(quarter)),) if quarter.size < half.size else ()
    points += ((float(half.size), half_s), (float(sample.size), full_s)) if sample.size > half.size else ()
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
    return ShapeSpeed(per_request_s, drain_s, latency_s, profile.shape(shape).start_cost_s, int(profile.engine["max_num_seqs"]), points)


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
