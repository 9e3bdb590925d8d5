"""How many batch requests may be in flight on a server that also serves online traffic, so the
online traffic keeps its latency: a state machine driven by the caller's clock (every method
takes `now_s`, the clock of the snapshots' `at_s`; no threads, no sleeping, no I/O).

Targets, p99 time to first token (TTFT) and inter-token latency (ITL), as `GuardTargets`:
- from the SLO when there is one (a None field has no bound): guarding from the start, at 1;
- else a baseline. With server metrics: 0 in flight for `baseline_s` after the first snapshot,
  then BASELINE_MARGIN x the online p99s of that period. If it saw no online request: 1 in flight
  until the server counted `baseline_min_requests` first tokens, then BASELINE_MARGIN x the p99s
  of those (the server's latency at concurrency 1). Without metrics: the same from the batch's own
  requests at concurrency 1. ITL has no bound when the baseline saw fewer token gaps than that.

Control, on the server's metrics while a snapshot with latency histograms is at most `window_s` old
(basis "server metrics"), else on the batch's own timings ("own requests"). The p99s are over the
last `window_s`: for TTFT the histogram's growth minus the batch's own observations, for ITL the
batch's own token gaps while online requests were there (see `_online`); with no online request in
the window there is no latency to keep (the batch may have an idle server to itself). One decision
per new snapshot (own requests: per new timing, at most once a second), aiming at a band below
each target:
- cut: allowed x `cut_factor`, rounded down, to 0 at the least, when a p99 since the last cut took
  effect is over its target, the server preempted a request, KV use is over `kv_usage_cut`, or
  requests waited in two snapshots in a row (the server is full: an online request would wait for
  a batch one to finish, and a batch request waiting there cannot go to another server; its
  running count then is kept as the server's capacity);
- otherwise on what the present level showed, the stretch since `allowed` last changed, once it is
  `grow_every_s` long (a window still full of the old level shows little of a new one: judged on
  it, the guard grows on past the right level, or eases off twice for one excess):
  - ease off: one less (not under 1) when a p99 is over its ease bound (`ease_above`, 0.9, x an SLO
    target; three quarters of the way from a baseline to its target): the level sits too close to
    the target for the next burst of online work;
  - grow: x2 until the first cut or ease-off (a slow start, as TCP's), then +1 (+10 % from 20 up), up to
    `max_in_flight`, when each p99 is under its growth bound (`grow_below`, 0.75, x an SLO target;
    half-way from a baseline to its target; a p99 known only as a histogram bucket that holds the
    growth bound and lies under the ease bound counts as under it), nothing waits, KV use is at most `kv_usage_grow`, the
    batch had all it was allowed in flight since the last decision, and one more would leave 10 %
    of the server's capacity (at least 1) free;
- else hold. After a cut no decision until the batch's in-flight count is down to the new allowance
  (at the caller's next look, or `window_s` passed), then `hold_s` more. At 0: back to 1 once `window_s` passed since the cut
  took effect and the window shows no reason to cut.

Invariant: `allowed` is in [0, max_in_flight] and changes at most once per decision. The guard
only says how many; its caller holds new requests back and aborts the youngest over a cut or an
ease-off (the endpoint engine sends them again once allowed), so either takes effect at once.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from batchllm.core.latency_slo import LatencySlo
from batchllm.engines.endpoint.guard_targets import GUARDING, MEASURING_BASELINE, OWN_REQUESTS, SERVER_METRICS, GuardReading, GuardTargets
from batchllm.engines.endpoint.latency_window import OwnTimings, WindowLatency, exactly, online_latency, own_latency, server_latency, weighted_p99
from batchllm.engines.endpoint.server_metrics import MetricsSnapshot

OWN_DECISION_EVERY_S = 1.0  # on its own requests' timings, the guard decides at most once a second
OWN_GAPS_MIN = 100  # the batch's own token gaps beside online requests that make their inter-token p99


@dataclass(frozen=True)
class _Evidence:
    basis: str
    span_s: float  # how long a stretch the p99s are over
    latency: WindowLatency  # the controlled p99s: online (server metrics) or own
    preempted: bool
    kv_usage: float | None
    waiting: float | None
    queue_held: bool  # requests waited in the newest snapshot and the one before
    running: float | None


class LatencyGuard:
    """One per server. The caller scrapes every 1-2 s and passes each snapshot (the first before its
    first `allowed`), reports its requests' timings as they stream in, and before starting a request
    asks `allowed(now_s, in_flight)`: it starts one while fewer than that are in flight."""

    def __init__(self, slo: LatencySlo | None, max_in_flight: int, *, window_s: float = 10.0, baseline_s: float = 8.0,
                 hold_s: float = 2.0, cut_factor: float = 0.5, grow_below: float = 0.75, ease_above: float = 0.9,
                 kv_usage_cut: float = 0.95, kv_usage_grow: float = 0.9, baseline_min_requests: int = 5,
                 slow_start: bool = True, grow_every_s: float = 2.0):
        """`slow_start`: double until the first cut or ease-off, then grow by one (else by one from the start)."""
        self._doubling = slow_start  # the slow start: until the first cut or ease-off
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight!r}")
        for name, value in (("window_s", window_s), ("baseline_s", baseline_s), ("kv_usage_grow", kv_usage_grow)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if not 0 < cut_factor < 1:
            raise ValueError(f"cut_factor must be in (0, 1), got {cut_factor!r}")
        if not 0 < grow_below <= ease_above <= 1:
            raise ValueError(f"need 0 < grow_below <= ease_above <= 1, got grow_below {grow_below!r}, ease_above {ease_above!r}")
        if not 0 <= grow_every_s <= window_s:
            raise ValueError(f"grow_every_s must be in [0, window_s {window_s!r}] (a level is judged inside the window), got {grow_every_s!r}")
        if not (hold_s >= 0 and kv_usage_grow <= kv_usage_cut and baseline_min_requests >= 1):
            raise ValueError(f"need hold_s >= 0, kv_usage_grow <= kv_usage_cut, baseline_min_requests >= 1; got hold_s {hold_s!r}, "
                             f"kv_usage_grow {kv_usage_grow!r}, kv_usage_cut {kv_usage_cut!r}, baseline_min_requests {baseline_min_requests!r}")
        self.max_in_flight = max_in_flight
        self.window_s, self.baseline_s, self.hold_s, self.grow_every_s = window_s, baseline_s, hold_s, grow_every_s
        self.cut_factor, self.grow_below, self.ease_above = cut_factor, grow_below, ease_above
        self.kv_usage_cut, self.kv_usage_grow, self.baseline_min_requests = kv_usage_cut, kv_usage_grow, baseline_min_requests
        self._targets: GuardTargets | None = None if slo is None else GuardTargets.from_slo(slo, grow_below, ease_above)
        self._allowed = 1
        self._snapshots: deque[MetricsSnapshot] = deque()
        self._in_flight_at: deque[int] = deque()  # the batch's requests in flight when each kept snapshot came
        self._snapshots_seen = 0
        self._first: MetricsSnapshot | None = None  # the first snapshot with latency histograms: the baseline starts there
        self._calibrating_from: MetricsSnapshot | None = None  # the baseline saw no online request: concurrency 1 from here
        self._own = OwnTimings()
        self._in_flight = self._peak_in_flight = 0
        self._decided = (0, 0, -math.inf)  # (snapshots seen, own reports, at_s) at the last decision
        self._draining_since_s: float | None = None  # a cut waits for the in-flight count to come down
        self._settled_at_s: float | None = None  # when the last cut took effect
        self._changed_at_s = -math.inf  # when `allowed` last changed (a cut: when it took effect)
        self._capacity_running: float | None = None  # running requests when the server was last seen full

    # -- what the caller tells and asks

    def observe_server(self, snapshot: MetricsSnapshot) -> None:
        """A scrape of the server's metrics (every 1-2 s)."""
        if self._snapshots and snapshot.at_s < self._snapshots[-1].at_s:
            raise ValueError(f"snapshot at_s {snapshot.at_s!r} is before the previous one's, {self._snapshots[-1].at_s!r}")
        self._snapshots.append(snapshot)
        self._in_flight_at.append(self._in_flight)
        self._snapshots_seen += 1
        if self._first is None and snapshot.ttft is not None:
            self._first = snapshot
        self._step(snapshot.at_s)

    def observe_own(self, now_s: float, ttft_s: float | None, token_gaps_s: Sequence[float]) -> None:
        """Timings of one of the batch's requests seen up to `now_s`: its time to first token (None
        when reported before) and the gaps between the tokens streamed since its last report."""
        self._own.add(now_s, ttft_s, token_gaps_s)
        self._step(now_s)

    def allowed(self, now_s: float, in_flight: int) -> int:
        """How many batch requests may be in flight now, in [0, max_in_flight]; `in_flight`: how many are."""
        if in_flight < 0:
            raise ValueError(f"in_flight must be >= 0, got {in_flight!r}")
        self._in_flight, self._peak_in_flight = in_flight, max(self._peak_in_flight, in_flight)
        self._step(now_s)
        return self._allowed

    def reading(self, now_s: float) -> GuardReading:
        self._step(now_s)
        basis = self._basis(now_s)
        newest = self._fresh_snapshot(now_s)
        start = None if newest is None else self._window_start(newest, -math.inf)
        if basis == SERVER_METRICS:
            latency = None if newest is None or start is None else self._online(start, newest)
        else:
            latency = own_latency(self._own, now_s - self.window_s, now_s)
        targets = self._targets
        ttft_target = None if targets is None else targets.ttft_target_s
        itl_target = None if targets is None else targets.itl_target_s
        return GuardReading(allowed=self._allowed, online_ttft_p99_s=None if latency is None else latency.ttft_p99_s,
                            online_itl_p99_s=None if latency is None else latency.itl_p99_s, ttft_target_s=ttft_target,
                            itl_target_s=itl_target, basis=basis,
                            phase=MEASURING_BASELINE if self._targets is None else GUARDING)

    # -- the state machine

    def _step(self, now_s: float) -> None:
        if self._targets is None:
            self._measure_baseline(now_s)
        else:
            if self._draining_since_s is not None and (self._in_flight <= self._allowed
                                                       or now_s - self._draining_since_s >= self.window_s):
                self._settle(now_s)
            if self._draining_since_s is None and (self._settled_at_s is None or now_s >= self._settled_at_s + self.hold_s):
                self._decide(now_s)
        self._forget(now_s)

    def _measure_baseline(self, now_s: float) -> None:
        if self._basis(now_s) == OWN_REQUESTS:
            self._allowed = 1
            measured = own_latency(self._own, -math.inf, now_s)
        else:
            newest, first = self._snapshots[-1], self._first
            assert first is not None  # the basis is the server's once a snapshot had histograms
            if self._calibrating_from is None:
                if newest.at_s - first.at_s < self.baseline_s:
                    self._allowed = 0
                    return
                online = online_latency(first, newest, self._own)
                if online.ttft_count > 0:
                    self._start_guarding(online, now_s)
                    return
                self._calibrating_from = newest
            self._allowed = 1
            measured = server_latency(self._calibrating_from, newest)
        if measured.ttft_count >= self.baseline_min_requests:
            self._start_guarding(measured, now_s)

    def _start_guarding(self, baseline: WindowLatency, now_s: float) -> None:
        itl = baseline.itl_p99_s if baseline.itl_count >= self.baseline_min_requests else None
        self._targets = GuardTargets.from_baseline(baseline.ttft_p99_s, itl)
        self._allowed, self._changed_at_s = 1, now_s
        self._mark_decided(now_s)

    def _decide(self, now_s: float) -> None:
        since_cut_s = -math.inf if self._settled_at_s is None else self._settled_at_s
        if self._allowed == 0:  # a probe: 1 again once a window passed since the cut took effect, without a reason to cut
            evidence = self._evidence(now_s, since_cut_s)
            if now_s >= since_cut_s + self.window_s and evidence is not None and not self._over(evidence):
                self._allowed, self._changed_at_s = 1, now_s
                self._mark_decided(now_s)
            return
        seen, reports, at_s = self._decided
        if self._basis(now_s) == SERVER_METRICS:
            new = self._snapshots_seen > seen
        else:
            new = (self._own.reports > reports or self._snapshots_seen > seen) and now_s >= at_s + OWN_DECISION_EVERY_S
        evidence = self._evidence(now_s, since_cut_s) if new else None
        if evidence is None:
            return
        used_all = self._peak_in_flight >= self._allowed
        self._mark_decided(now_s)
        if self._over(evidence):
            if evidence.queue_held:
                self._capacity_running = evidence.running
            self._allowed = math.floor(self._allowed * self.cut_factor)
            self._draining_since_s = now_s
            if self._in_flight <= self._allowed:
                self._settle(now_s)
            return
        level = self._evidence(now_s, self._changed_at_s)  # what the present level showed
        if level is None or level.span_s < self.grow_every_s:
            return
        if self._near(level) and self._allowed > 1:
            self._allowed, self._changed_at_s, self._doubling = self._allowed - 1, now_s, False
        elif self._under(level) and used_all and self._has_room(level) and self._allowed < self.max_in_flight:
            step = self._allowed if self._doubling else max(1, self._allowed // 10)
            self._allowed, self._changed_at_s = min(self.max_in_flight, self._allowed + step), now_s

    def _settle(self, now_s: float) -> None:
        """A cut took effect: the batch is down to what it is allowed."""
        self._draining_since_s, self._settled_at_s, self._changed_at_s, self._doubling = None, now_s, now_s, False

    def _mark_decided(self, now_s: float) -> None:
        self._decided = (self._snapshots_seen, self._own.reports, now_s)
        self._peak_in_flight = self._in_flight

    def _over(self, evidence: _Evidence) -> bool:
        latency, bounds = evidence.latency, self._targets
        assert bounds is not None  # guarding
        return (_above(latency.ttft_p99_s, bounds.ttft_target_s) or _above(latency.itl_p99_s, bounds.itl_target_s) or evidence.preempted
                or evidence.queue_held or (evidence.kv_usage is not None and evidence.kv_usage > self.kv_usage_cut))

    def _near(self, evidence: _Evidence) -> bool:
        latency, bounds = evidence.latency, self._targets
        assert bounds is not None  # guarding
        return _above(latency.ttft_p99_s, bounds.ttft_ease_over_s) or _above(latency.itl_p99_s, bounds.itl_ease_over_s)

    def _under(self, evidence: _Evidence) -> bool:
        latency, bounds = evidence.latency, self._targets
        assert bounds is not None  # guarding
        if not bounds.lets_grow(latency):
            return False
        if evidence.basis == OWN_REQUESTS and latency.ttft_count == 0:
            return False  # on its own requests, the guard grows on what it saw of them only
        return (evidence.waiting is None or evidence.waiting == 0) and (evidence.kv_usage is None
                                                                         or evidence.kv_usage <= self.kv_usage_grow)

    def _has_room(self, evidence: _Evidence) -> bool:
        if self._capacity_running is None or evidence.running is None:
            return True
        headroom = max(1, math.ceil(0.1 * self._capacity_running))
        return evidence.running + 1 <= self._capacity_running - headroom

    # -- evidence over the window

    def _basis(self, now_s: float) -> str:
        newest = self._fresh_snapshot(now_s)
        return SERVER_METRICS if newest is not None and newest.ttft is not None else OWN_REQUESTS

    def _fresh_snapshot(self, now_s: float) -> MetricsSnapshot | None:
        if self._snapshots and now_s - self._snapshots[-1].at_s <= self.window_s:
            return self._snapshots[-1]
        return None

    def _window_start(self, newest: MetricsSnapshot, since_s: float) -> MetricsSnapshot | None:
        """The snapshot the window starts at: the last one at least `window_s` before the newest (else the
        oldest kept), and not before `since_s`; None when no snapshot before the newest qualifies."""
        earlier = [s for s in self._snapshots if s.at_s < newest.at_s]
        before_horizon = [s for s in earlier if s.at_s <= newest.at_s - self.window_s]
        start = before_horizon[-1] if before_horizon else (earlier[0] if earlier else None)
        if start is not None and start.at_s < since_s:
            start = next((s for s in earlier if s.at_s >= since_s), None)
        return start

    def _online(self, start: MetricsSnapshot, end: MetricsSnapshot) -> WindowLatency:
        """The online p99s of the window. TTFT: the server's minus the batch's own (one each per
        request, and the client sees its own later than the server: they subtract one for one).
        Inter-token: the batch's own gaps between snapshots that showed online requests, when there
        are OWN_GAPS_MIN of them: they decode in the same steps as the online ones, so they wait the
        same gaps, and the client measures them to its own delays (a chunk of k tokens counts as k
        equal gaps), where vLLM's histogram has one bucket from 100 to 150 ms, often around a
        target; the stretches the batch ran alone are left out. Each gap weighs the online requests
        per batch request in its stretch (the mean of the two snapshots'): a step is one gap to each
        request in it, and a burst of online work, with its slow steps, gives the online traffic
        many gaps where the batch's few requests see each step once. Else the server's over all
        requests while online requests are there; none without them (the batch may have an idle
        server to itself)."""
        online = online_latency(start, end, self._own)
        shown = [(s.at_s, _others(s, batch), batch) for s, batch in zip(self._snapshots, self._in_flight_at) if start.at_s <= s.at_s <= end.at_s]
        if not (online.ttft_count > 0 or (shown and shown[-1][1] > 0)):
            return replace(online, itl_p99_s=None, itl_count=0, itl_p99_bucket_s=None)
        beside = [(before_s, after_s, (others_before + others_after) / 2 / max(1.0, (batch_before + batch_after) / 2))
                  for (before_s, others_before, batch_before), (after_s, others_after, batch_after) in zip(shown, shown[1:])
                  if others_before > 0 or others_after > 0]
        gaps = self._own.gaps_within(beside)
        if len(gaps) >= OWN_GAPS_MIN:
            p99_s = weighted_p99(gaps)
            return replace(online, itl_p99_s=p99_s, itl_count=len(gaps), itl_p99_bucket_s=exactly(p99_s))
        everyone = server_latency(start, end)
        return replace(online, itl_p99_s=everyone.itl_p99_s, itl_count=everyone.itl_count, itl_p99_bucket_s=everyone.itl_p99_bucket_s)

    def _evidence(self, now_s: float, since_s: float) -> _Evidence | None:
        """What the last `window_s`, from `since_s` at the earliest, showed."""
        newest = self._fresh_snapshot(now_s)
        start = None if newest is None else self._window_start(newest, since_s)
        basis = self._basis(now_s)
        if basis == SERVER_METRICS:
            if newest is None or start is None:
                return None
            latency, span_s = self._online(start, newest), newest.at_s - start.at_s
        else:
            from_s = max(now_s - self.window_s, since_s)
            latency, span_s = own_latency(self._own, from_s, now_s), now_s - from_s
        if newest is None:
            return _Evidence(basis, span_s, latency, preempted=False, kv_usage=None, waiting=None, queue_held=False, running=None)
        previous = [s for s in self._snapshots if start is not None and start.at_s <= s.at_s < newest.at_s]
        preempted = (start is not None and newest.preemptions is not None and start.preemptions is not None
                     and newest.preemptions > start.preemptions)
        return _Evidence(basis, span_s, latency, preempted=preempted, kv_usage=newest.kv_usage, waiting=newest.waiting,
                         queue_held=newest.waiting > 0 and bool(previous) and previous[-1].waiting > 0, running=newest.running)

    def _forget(self, now_s: float) -> None:
        if not self._snapshots:
            keep_from_s = now_s - 2 * self.window_s
        else:
            newest = self._snapshots[-1]
            while len(self._snapshots) > 1 and self._snapshots[1].at_s <= newest.at_s - self.window_s:
                self._snapshots.popleft()
                self._in_flight_at.popleft()
            keep_from_s = min(now_s - 2 * self.window_s, self._snapshots[0].at_s)
        if self._targets is not None:  # the baseline counts the batch's own timings from the start
            self._own.forget_before(keep_from_s)


def _others(snapshot: MetricsSnapshot, batch_in_flight: int) -> float:
    """The requests the server held that were not the batch's when it was scraped (waiting ones
    included: they decode soon; when requests wait in two scrapes the guard cuts anyway)."""
    return max(0.0, snapshot.running + snapshot.waiting - batch_in_flight)


def _above(p99_s: float | None, target_s: float | None) -> bool:
    return p99_s is not None and target_s is not None and p99_s > target_s
