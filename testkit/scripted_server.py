"""A scripted server for the latency guard's tests: continuous batching on a fake clock, online
and batch requests in the same steps, histograms and gauges as vLLM's /metrics shows them, and
a batch client driven as the endpoint engine drives one (scrapes every second, its streams'
timings every half second, the youngest aborted over a cut). A test fake, never a product path.

A step takes `step_s(n)` for n running requests (`prefill_s` more with a prompt's prefill in it)
and gives each one token (the first token of a new request comes with the step that admits it, or
`online_prefill_steps` later); online requests go first (priority scheduling), at most
`max_num_seqs` run, the rest wait.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from batchllm.core.latency_slo import LatencySlo
from batchllm.engines.endpoint.guard_policy import GuardPhase
from batchllm.engines.endpoint.latency_guard import LatencyGuard
from batchllm.engines.endpoint.latency_window import p99_of
from batchllm.engines.endpoint.server_metrics import Histogram, MetricsSnapshot

# vLLM's own bucket bounds (vllm/v1/metrics/loggers.py) for time to first token and inter-token latency.
TTFT_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
               160.0, 640.0, 2560.0, math.inf)
ITL_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, math.inf)
SCRAPE_S, OWN_TIMINGS_S = 1.0, 0.5  # as the endpoint engine
# a fast server's step for n running requests: 20 ms and 2 ms a request (memory-bound decoding)
FAST = lambda n: 0.02 + 0.002 * n  # noqa: E731


@dataclass
class Request:
    online: bool
    sent_s: float
    tokens: int  # to generate
    prefill_steps: int = 1  # steps before its first token (a long prompt in chunks)
    first_s: float | None = None
    last_s: float | None = None
    gaps_s: list[tuple[float, float]] = field(default_factory=list)  # (ended at, gap)
    reported_gaps: int = 0
    ttft_reported: bool = False

    @property
    def done(self) -> bool:
        return len(self.gaps_s) + (self.first_s is not None) >= self.tokens


@dataclass(frozen=True)
class Scenario:
    step_s: Callable[[int], float]
    online_arrivals_s: tuple[float, ...]
    online_tokens: int
    online_prefill_steps: int = 1
    batch_tokens: int = 64
    max_num_seqs: int = 256
    prefill_s: float = 0.0  # what a step holding a prompt's prefill (a request not at its first token yet) takes more
    client_s: float = 0.0  # what the batch's client sees more in each time to first token (HTTP, tokenizing): no step's
    metrics_until_s: float = math.inf  # the server stops answering /metrics then


@dataclass
class Trace:
    online: list[Request]
    batch_while_online: list[int]  # the batch's requests on the server at each step where online requests were there
    allowed: list[tuple[float, int]]  # (at, the guard's allowance) after each step
    batch_tokens: int
    online_steps_at: list[float] = field(default_factory=list)  # when each step where online requests were there began
    phases: list[tuple[float, GuardPhase]] = field(default_factory=list)  # (at, the guard's phase) after each step

    def online_p99s(self, from_s: float, until_s: float) -> tuple[float | None, float | None]:
        """The online requests' own p99 TTFT (those sent in the stretch) and inter-token latency (gaps that ended in it)."""
        ttfts = [r.first_s - r.sent_s for r in self.online if r.first_s is not None and from_s <= r.sent_s < until_s]
        gaps = [gap for r in self.online for at, gap in r.gaps_s if from_s <= at < until_s]
        return p99_of(ttfts), p99_of(gaps)


class ScriptedServer:
    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.ttft = [0.0] * len(TTFT_BOUNDS)
        self.itl = [0.0] * len(ITL_BOUNDS)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        for queue in (self.running, self.waiting):
            if request in queue:
                queue.remove(request)

    def step(self, now_s: float) -> float:
        """One iteration from `now_s`: when it ends."""
        self.waiting.sort(key=lambda r: (not r.online, r.sent_s))
        while self.waiting and len(self.running) < self.scenario.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        if not self.running:
            return now_s + 0.05
        prefilling = any(request.first_s is None for request in self.running)
        end_s = now_s + self.scenario.step_s(len(self.running)) + (self.scenario.prefill_s if prefilling else 0.0)
        for request in self.running:
            if request.prefill_steps > 1:
                request.prefill_steps -= 1
            elif request.first_s is None:
                request.first_s = end_s
                self.ttft[bisect.bisect_left(TTFT_BOUNDS, end_s - request.sent_s)] += 1
            else:
                assert request.last_s is not None
                request.gaps_s.append((end_s, end_s - request.last_s))
                self.itl[bisect.bisect_left(ITL_BOUNDS, end_s - request.last_s)] += 1
            request.last_s = end_s
        self.running = [r for r in self.running if not r.done]
        return end_s

    def snapshot(self, at_s: float) -> MetricsSnapshot:
        return MetricsSnapshot(at_s=at_s, server_kind="vllm", running=float(len(self.running)), waiting=float(len(self.waiting)),
                               kv_usage=0.3, preemptions=0.0, generation_tokens=None,
                               ttft=Histogram.from_bucket_counts(TTFT_BOUNDS, self.ttft),
                               itl=Histogram.from_bucket_counts(ITL_BOUNDS, self.itl))


def run(scenario: Scenario, guard: LatencyGuard | None, duration_s: float) -> Trace:
    """The scenario for `duration_s`, with a batch under `guard` (None: the online traffic alone)."""
    server = ScriptedServer(scenario)
    arrivals = list(scenario.online_arrivals_s)
    online: list[Request] = []
    batch: list[Request] = []  # on the server, oldest first
    trace = Trace(online, [], [], 0)
    now_s, next_scrape_s, next_report_s = 0.0, 0.0, OWN_TIMINGS_S
    while now_s < duration_s:
        while arrivals and arrivals[0] <= now_s:
            request = Request(True, arrivals.pop(0), scenario.online_tokens, scenario.online_prefill_steps)
            online.append(request)
            server.add(request)
        if guard is not None:
            while len(batch) < guard.allowed(now_s, len(batch)):
                batch.append(Request(False, now_s, scenario.batch_tokens))
                server.add(batch[-1])
        if any(r.online for r in server.running + server.waiting):
            trace.batch_while_online.append(len(batch))
            trace.online_steps_at.append(now_s)
        now_s = server.step(now_s)
        if guard is None:
            continue
        for request in [r for r in batch if not r.ttft_reported and r.first_s is not None]:
            _report(guard, request, now_s, scenario.client_s)  # a first token is told at once, as the endpoint engine does
        for request in [r for r in batch if r.done]:
            _report(guard, request, now_s, scenario.client_s)
            batch.remove(request)
            trace.batch_tokens += request.tokens
        if now_s >= next_report_s:
            for request in batch:
                _report(guard, request, now_s, scenario.client_s)
            next_report_s = now_s + OWN_TIMINGS_S
        if now_s >= next_scrape_s:
            if now_s < scenario.metrics_until_s:
                guard.observe_server(server.snapshot(now_s))
            decoding = [now_s - r.last_s for r in batch if r.first_s is not None and r.last_s is not None]
            guard.observe_silence(now_s, max(decoding, default=0.0))
            for request in batch[guard.allowed(now_s, len(batch)):][::-1]:  # the youngest over the allowance
                server.abort(request)
                batch.remove(request)
            next_scrape_s = now_s + SCRAPE_S
        trace.allowed.append((now_s, guard.allowed(now_s, len(batch))))
        trace.phases.append((now_s, guard.phase))
    return trace


def _report(guard: LatencyGuard, request: Request, now_s: float, client_s: float) -> None:
    """What the batch's stream saw since its last report: its first token (`client_s` later than the
    server made it), and the gaps since."""
    if request.first_s is None:
        return
    ttft_s = None if request.ttft_reported else request.first_s - request.sent_s + client_s
    gaps = [gap for _, gap in request.gaps_s[request.reported_gaps:]]
    if ttft_s is None and not gaps:
        return
    guard.observe_own(now_s, ttft_s, gaps)
    request.ttft_reported, request.reported_gaps = True, len(request.gaps_s)


def poisson(rate_per_s: float, until_s: float, seed: int, from_s: float = 0.0) -> tuple[float, ...]:
    """Arrival times of a Poisson stream (a seeded generator: the same times for every run)."""
    import random

    rng, at, times = random.Random(seed), from_s, []
    while (at := at + rng.expovariate(rate_per_s)) < until_s:
        times.append(at)
    return tuple(times)


def phased_arrivals(rates_per_s: tuple[float, ...], phase_s: float, seed: int) -> tuple[float, ...]:
    """Poisson arrivals at each rate for `phase_s` in turn (the k-th phase seeded seed + 100 k)."""
    arrivals: tuple[float, ...] = ()
    for k, rate in enumerate(rates_per_s):
        arrivals += poisson(rate, (k + 1) * phase_s, seed=seed + 100 * k, from_s=k * phase_s)
    return tuple(sorted(arrivals))


def slo_of(alone: Trace, from_s: float, until_s: float) -> LatencySlo:
    """1.25 x what the online clients saw alone, as the coserve benchmark sets it."""
    ttft, itl = alone.online_p99s(from_s, until_s)
    assert ttft is not None and itl is not None
    return LatencySlo(ttft_p99_s=1.25 * ttft, itl_p99_s=1.25 * itl)


def worst_ratio(alone: Trace, beside: Trace, from_s: float, until_s: float, window_s: float = 30.0) -> float:
    """The worst window's online p99 (TTFT or inter-token) over alone's p99 of the whole stretch (the
    reference the coserve benchmark holds each window to)."""
    reference = alone.online_p99s(from_s, until_s)
    worst, at = 0.0, from_s
    while at + window_s <= until_s:
        for mine, theirs in zip(beside.online_p99s(at, at + window_s), reference):
            if mine is not None and theirs:
                worst = max(worst, mine / theirs)
        at += window_s
    return worst
