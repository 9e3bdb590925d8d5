"""The latency guard's BASELINE phase: what the online traffic shows with no batch request on the
server, and, for targets without an SLO, the batch's one request's exact timings beside it.

Steps, each ended by what it measured (`BaselineMeter.step`):
1. Until the first scrape comes back (`judge_after_s` at most): 0 in flight, nothing is known.
2. 0 in flight for `baseline_s`, longer (up to `max_window_s`) while online requests were there
   with fewer than `min_observations` of their first tokens: the online traffic alone. With an SLO
   (its targets need no baseline), or a server that preempted or queued with nothing of the
   batch's on it, the baseline ends here.
3. 1 in flight until its exact timings came: beside online requests, its token gaps over a window
   (the online gaps' baseline: vLLM's inter-token buckets are wider than the margin); with nobody
   else there, `min_observations` of its own first tokens too.
Without server metrics, the batch's own requests at concurrency 1 until `min_observations` first
tokens.

Invariant: the meter only measures; the guard sets targets and leaves BASELINE on its `Baseline`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchllm.engines.endpoint.guard_evidence import WindowEvidence
from batchllm.engines.endpoint.guard_policy import GuardPolicy
from batchllm.engines.endpoint.latency_window import OwnTimings, WindowLatency, own_latency
from batchllm.engines.endpoint.server_history import ServerHistory
from batchllm.engines.endpoint.server_metrics import MetricsSnapshot


@dataclass(frozen=True)
class Baseline:
    """What a finished baseline measured: the online traffic alone (None without server metrics) and
    the p99s targets come from without an SLO (None: not measured, or nothing to measure)."""

    alone: WindowEvidence | None
    ttft_p99_s: float | None
    itl_p99_s: float | None


class BaselineMeter:
    """One baseline, begun at `began_s` (-inf: with the guard). `step` says how many batch requests
    may be in flight and, once the baseline is done, what it measured."""

    def __init__(self, policy: GuardPolicy, history: ServerHistory, own: OwnTimings, *, has_targets: bool, began_s: float):
        self.policy, self._history, self._own = policy, history, own
        self._has_targets, self._began_s = has_targets, began_s
        self._first_call_s = math.inf  # when the guard first stepped it
        self._alone: WindowEvidence | None = None  # what the stretch at 0 showed
        self._calibrating_from: MetricsSnapshot | None = None  # then 1 in flight from here, for the batch's exact timings

    def step(self, now_s: float) -> tuple[int, Baseline | None]:
        """The allowance now, and the baseline once it is done (None: not yet)."""
        first, newest = self._history.first_with_latency, self._history.fresh(now_s)
        self._first_call_s = min(self._first_call_s, now_s)
        if self._history.seen == 0 and now_s - self._first_call_s < self.policy.judge_after_s:
            return 0, None  # the first scrape has not come back yet: nothing is known
        if first is None or newest is None or newest.ttft is None:  # no server metrics: the batch's own requests at concurrency 1
            measured = own_latency(self._own, -math.inf, now_s)
            if measured.ttft_count >= self.policy.min_observations:
                return 1, Baseline(None, measured.ttft_p99_s, measured.itl_p99_s if measured.itl_count else None)
            return 1, None
        if self._alone is None:
            return self._measure_alone(now_s, first, newest)
        assert self._calibrating_from is not None
        if self._alone.online_seen:  # the online gaps, as the batch's one request saw them beside online ones for a window
            beside = self._history.evidence(now_s, self._calibrating_from.at_s, self._own, 0.0)
            if beside is not None and beside.span_s >= self.policy.window_s and beside.latency.itl_count >= self.policy.own_gaps_min:
                return 1, Baseline(self._alone, self._alone.latency.ttft_p99_s, _at_least(beside.latency))
            return 1, None
        own = own_latency(self._own, self._calibrating_from.at_s, now_s)
        if own.ttft_count >= self.policy.min_observations:
            return 1, Baseline(self._alone, own.ttft_p99_s, own.itl_p99_s if own.itl_count else None)
        return 1, None

    def _measure_alone(self, now_s: float, first: MetricsSnapshot, newest: MetricsSnapshot) -> tuple[int, Baseline | None]:
        """Step 2: 0 in flight until the stretch since the baseline began holds the online traffic alone."""
        alone = self._history.evidence(now_s, max(first.at_s, self._began_s), self._own, 0.0)
        if alone is None or alone.span_s < self.policy.baseline_s:
            return 0, None
        if alone.online_seen and alone.latency.ttft_count < self.policy.min_observations and alone.span_s < self.policy.max_window_s:
            return 0, None  # online requests outlast the window: wait for more of their first tokens
        self._alone, self._calibrating_from = alone, newest
        if self._has_targets or alone.saturated:
            return 0, Baseline(alone, None, None)
        return 0, None


def _at_least(latency: WindowLatency) -> float | None:
    """The inter-token p99 a baseline takes: from a histogram, its bucket's lower bound (the batch's
    exact gaps then judge it against a target that is not too loose); of the batch's own gaps, their
    nearest-rank p99 (`itl_p99_s`), not the least their noise allows, which is for judging an excess."""
    if latency.itl_from_histogram and latency.itl_p99_bucket_s is not None:
        return latency.itl_p99_bucket_s[0] or latency.itl_p99_s
    return latency.itl_p99_s
