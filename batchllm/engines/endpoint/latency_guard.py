"""How many batch requests may be in flight on a server that also serves online traffic, so the
online traffic keeps its latency: a state machine driven by the caller's clock (every method
takes `now_s`, the clock of the snapshots' `at_s`; no threads, no sleeping, no I/O).

Phases (`GuardPhase`; the rules and their numbers in `guard_policy.py`):
- BASELINE (`guard_baseline.py`): the online traffic alone at 0 in flight, then (for targets
  without an SLO) the batch's one request's exact timings beside it. Targets (`GuardTargets`) from
  the SLO, else BASELINE_MARGIN x what it measured.
- WAITING, when the online traffic alone is over its ease bounds or the server preempted or
  queued with no batch at all: 0 in flight, 1 once no online request was on the server for a
  quiet stretch (`trickle_quiet_gaps` of their mean arrival gap: a momentary gap in heavy traffic
  is no room). It ends when a window shows the online traffic under its ease bounds and no sign
  of overload: SLOW_START at 1 with an SLO; without one, a new BASELINE (an overloaded server's
  latency is no baseline).
- HELD, when even one batch request beside online requests broke a target (a cut to 0 with online
  requests there): 0 in flight, with no trickle in quiet stretches (`_hold`), until a lull
  (`lull_s` without online requests: nobody to harm), a lighter load (the online requests coming
  at a lower rate than beside the hold's try, beyond their noise, and room at 0 as growth needs)
  or a backoff (`held_retry_s`, doubled at each hold in a row up to `max_held_retry_s`); then
  SLOW_START at 1.
  After a lull, when online requests come back, the level last judged beside them, 0, and one more
  try a window later. A probe a window, as at 0 otherwise, harmed every window where one batch
  request is too many (one slow core, online answers longer than the window); never trying again
  held a whole run back on one sure excess early in it. The backoff's count in a row ends when the
  batch is judged at 2 beside online requests.
- SLOW_START and STEADY, guarding: at each new snapshot (without metrics: each new timing), the
  window since the last cut took effect and the stretch since the level was set give a `Verdict`
  (`guard_evidence.judge`), and `TRANSITIONS` the next phase and allowance. Growth needs positive
  evidence (enough online observations under the growth bounds, or a lull: a whole window with
  no online request on a server that never had one, `lull_s` once it had, since the gaps between
  light online arrivals are longer than a window), the batch using all it was allowed during the level, room under the
  server's capacity as last seen full, and beside online requests a server not saturated (its step, the batch's
  median token gap, at most `saturated_pace` x the fastest seen; at 0 in flight, the server's median gap surely
  not over it). Online requests back after a lull the batch grew in:
  RETURN to the level last judged beside them. Online requests on the server jumping beyond
  their noise at a scrape (a burst, a load turning heavy): SURGE to 0 at once, a load no level
  was judged beside. At 0: 1 again once a whole window at 0 gave positive evidence of room, as
  any growth.
- DRAINING, after a cut or a return: no decision until the batch's in-flight count is down to
  the new allowance (or a window passed); then STEADY, the new level judged on itself. A cut with
  nothing to take off (at 0, the online traffic's own excess) drains nothing: STEADY at 0 again,
  judged afresh.
A guarding decision that holds the level says why (`_why_not_grow`, `guard_evidence.no_room`): the
reading shows the last reason, each change of the log counts those since the change before.
When server metrics that were there stop, the guard grows no more and still cuts on the
batch's own timings.

Invariant: `allowed` is in [0, max_in_flight] and changes at most once per decision, only by a
phase's rule. The guard only says how many; its caller holds new requests back and aborts the
youngest over a cut or an ease-off (the endpoint engine sends them again once allowed).
"""
from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence

from batchllm.core.latency_slo import LatencySlo
from batchllm.engines.endpoint.guard_backoff import HoldBackoff
from batchllm.engines.endpoint.guard_baseline import Baseline, BaselineMeter
from batchllm.engines.endpoint.guard_evidence import (
    WindowEvidence,
    excess,
    growth_room,
    judge,
    no_room,
    own_evidence,
)
from batchllm.engines.endpoint.guard_policy import GUARDING_PHASES, TRANSITIONS, GuardPhase, GuardPolicy, Levels, Verdict
from batchllm.engines.endpoint.guard_targets import OWN_REQUESTS, SERVER_METRICS, GuardChange, GuardReading, GuardTargets
from batchllm.engines.endpoint.latency_window import OwnTimings, WindowLatency, own_latency
from batchllm.engines.endpoint.server_history import ServerHistory
from batchllm.engines.endpoint.server_metrics import MetricsSnapshot

CHANGES_KEPT = 1000  # changes a caller that never takes them leaves in memory
WAITING_PHASES = (GuardPhase.WAITING, GuardPhase.HELD)  # phases whose reading says why the batch waits; the guarding ones say why they
# do not grow
HELD_BY_SHOWN = 3  # the reasons a change's log line gives for the holds since the change before it, most frequent first


class LatencyGuard:
    """One per server. The caller scrapes every 1-2 s and passes each snapshot (the first before its
    first `allowed`), reports its requests' timings as they stream in and how long its quietest
    decoding stream has gone without a token, and before starting a request asks
    `allowed(now_s, in_flight)`: it starts one while fewer than that are in flight."""

    def __init__(self, slo: LatencySlo | None, max_in_flight: int, policy: GuardPolicy = GuardPolicy()):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight!r}")
        self.slo, self.max_in_flight, self.policy = slo, max_in_flight, policy
        self.phase = GuardPhase.BASELINE
        self._targets: GuardTargets | None = None if slo is None else GuardTargets.from_slo(slo, policy.grow_below, policy.ease_above)
        self._why_waiting: str | None = None
        self._allowed = 0
        self._history = ServerHistory(policy)
        self._own = OwnTimings()
        self._silent_s = 0.0  # the longest the batch's decoding streams have gone without a token, as last told
        self._in_flight = self._peak_in_flight = 0  # the peak: since the level was set
        self._observed = (0, 0)  # (snapshots, own reports) at the last decision: one decision per new observation
        self._level_since_s = -math.inf  # when `allowed` last changed (a cut: when it took effect)
        self._cut_settled_s = -math.inf  # when the last cut took effect
        self._draining_since_s = -math.inf
        self._capacity_running: float | None = None  # running requests when the server was last seen full
        self._beside_online = 1  # the last allowance judged beside online requests (growth in a lull is not)
        self._backoff = HoldBackoff(policy)
        self._fastest_pace_s = math.inf  # the server's quickest step the batch's streams saw in a window
        self._verdict: Verdict | None = None  # the verdict of this step's decision, if it made one
        self._because: str | None = None  # what in the evidence gave that verdict, for a cut, an ease-off, a surge or a return
        self._not_growing: str | None = None  # guarding: why the last decision did not grow (None: it did, or it cut)
        self._held_by: Counter[str] = Counter()  # why each decision since the last change held the level
        self._changes: deque[GuardChange] = deque(maxlen=CHANGES_KEPT)  # not yet taken by `changes`
        self._baseline = BaselineMeter(policy, self._history, self._own, has_targets=self._targets is not None, began_s=-math.inf)

    # -- what the caller tells and asks

    def observe_server(self, snapshot: MetricsSnapshot) -> None:
        """A scrape of the server's metrics (every 1-2 s)."""
        self._history.add(snapshot, self._in_flight)
        self._step(snapshot.at_s)

    def observe_own(self, now_s: float, ttft_s: float | None, token_gaps_s: Sequence[float]) -> None:
        """Timings of one of the batch's requests seen up to `now_s`: its time to first token (None
        when reported before) and the gaps between the tokens streamed since its last report."""
        self._own.add(now_s, ttft_s, token_gaps_s)
        self._step(now_s)

    def observe_silence(self, now_s: float, silent_s: float) -> None:
        """How long the batch's decoding stream that has gone longest without a token has (0: none)."""
        if not silent_s >= 0:
            raise ValueError(f"silent_s must be >= 0, got {silent_s!r}")
        self._silent_s = silent_s
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
        return self._reading(now_s)

    def changes(self) -> list[GuardChange]:
        """The changes of phase or allowance since the last call (the newest CHANGES_KEPT), oldest first."""
        taken = list(self._changes)
        self._changes.clear()
        return taken

    def _reading(self, now_s: float) -> GuardReading:
        evidence = self._evidence(now_s, -math.inf)
        if evidence is not None:
            latency: WindowLatency | None = evidence.latency
            basis = evidence.basis
        elif self._history.fresh(now_s) is not None:
            latency, basis = None, SERVER_METRICS
        else:
            latency, basis = own_latency(self._own, now_s - self.policy.window_s, now_s), OWN_REQUESTS
        targets = self._targets
        return GuardReading(allowed=self._allowed, online_ttft_p99_s=None if latency is None else latency.ttft_p99_s,
                            online_itl_p99_s=None if latency is None else latency.itl_p99_s,
                            ttft_target_s=None if targets is None else targets.ttft_target_s,
                            itl_target_s=None if targets is None else targets.itl_target_s, basis=basis,
                            phase=self.phase.value, why=self._why_waiting if self.phase in WAITING_PHASES else self._not_growing)

    # -- the state machine

    def _step(self, now_s: float) -> None:
        before, self._verdict, self._because = (self.phase, self._allowed), None, None
        self._take_step(now_s)
        if (self.phase, self._allowed) != before:
            self._changes.append(GuardChange(now_s, before[1], self._reading(now_s), None if self._verdict is None else self._verdict.value,
                                             self._in_flight, self._history.others_now(now_s, self._own),
                                             held_by=tuple(self._held_by.most_common(HELD_BY_SHOWN)), because=self._because))
            self._held_by.clear()

    def _take_step(self, now_s: float) -> None:
        if self.phase is GuardPhase.BASELINE:
            self._measure_baseline(now_s)
        elif self.phase is GuardPhase.WAITING:
            self._wait(now_s)
        elif self.phase is GuardPhase.HELD:
            self._hold(now_s)
        elif self.phase is GuardPhase.DRAINING:
            if self._in_flight <= self._allowed or now_s - self._draining_since_s >= self.policy.window_s:
                self.phase, self._cut_settled_s = GuardPhase.STEADY, now_s
                self._set_level(self._allowed, now_s)
        elif self._new_observation(now_s):
            self._decide(now_s)
        self._own.forget_before(min(now_s, self._history.oldest_at_s or now_s) - self.policy.max_window_s)

    def _measure_baseline(self, now_s: float) -> None:
        """BASELINE (`guard_baseline.BaselineMeter`): its allowance, and once it measured, guarding."""
        self._allowed, baseline = self._baseline.step(now_s)
        if baseline is not None:
            self._start_guarding(baseline, now_s)

    def _start_guarding(self, baseline: Baseline, now_s: float) -> None:
        """Targets (the SLO's, else BASELINE_MARGIN x the baseline's p99s), then SLOW_START at 1, or
        WAITING when the online traffic alone was over them."""
        if self._targets is None:
            self._targets = GuardTargets.from_baseline(baseline.ttft_p99_s, baseline.itl_p99_s)
        self._new_observation(now_s)
        why = None if baseline.alone is None else self._over_alone(baseline.alone)
        if why is not None:
            self.phase, self._why_waiting = GuardPhase.WAITING, why
            self._set_level(0, now_s)
            return
        self.phase, self._why_waiting = GuardPhase.SLOW_START, None
        self._set_level(1, now_s)

    def _over_alone(self, alone: WindowEvidence) -> str | None:
        """Why the online traffic is over its ease bound (or the server overloaded) with no batch; None: it is not."""
        assert self._targets is not None
        why = excess(alone, self._targets, self.policy, ease=True) or excess(alone, self._targets, self.policy)
        return None if why is None else f"{why} with no batch"

    def _trickle(self, now_s: float) -> WindowEvidence | None:
        """WAITING's allowance, 1 only once no online request was on the server for a quiet stretch
        (`ServerHistory.quiet_for_trickle`; none known: 0); then `_level_window`."""
        self._allowed = 1 if self._history.quiet_for_trickle(now_s, self._own) else 0
        return self._level_window(now_s)

    def _level_window(self, now_s: float) -> WindowEvidence | None:
        """At a new observation once the level ran a whole window, what it showed; else None."""
        if not self._new_observation(now_s) or now_s - self._level_since_s < self.policy.window_s:
            return None
        return self._history.evidence(now_s, self._level_since_s, self._own, self._silent_s)

    def _wait(self, now_s: float) -> None:
        """WAITING: 1 only in a quiet stretch without online requests; out once a window of the online
        traffic alone (or beside that trickle) shows it under its ease bounds."""
        alone = self._trickle(now_s)
        if alone is None or alone.span_s < self.policy.window_s:
            return
        enough = not alone.online_seen or alone.latency.ttft_count >= self.policy.min_observations
        why = self._over_alone(alone)
        if enough and why is None and self.slo is None:  # the overload is over: targets from a baseline of what is there now
            self.phase, self._why_waiting, self._targets = GuardPhase.BASELINE, None, None
            self._baseline = BaselineMeter(self.policy, self._history, self._own, has_targets=False, began_s=now_s)
            self._set_level(0, now_s)
        elif enough and why is None:
            self.phase, self._why_waiting = GuardPhase.SLOW_START, None
            self._set_level(1, now_s)
        elif why is not None:
            self._why_waiting = why

    def _hold(self, now_s: float) -> None:
        """HELD: 0 in flight, out after a lull (the backoff's count starts again) or, to try 1 beside
        them once more, after the backoff, or sooner once the online load eased (`guard_backoff.HoldBackoff`). No trickle
        in quiet stretches of their traffic, as WAITING has: one request was shown too many beside
        them, and a quiet stretch says little of the next arrival (Poisson arrivals have no memory)
        while a trickled request stays on the server a scrape after they come. Held with that
        trickle, the batch sat beside (a)'s heavy online load at 0.2 requests on average and left its
        window at 1.29x alone's inter-token p99 (coserve matrix, AVX-512 host, 2026-11-29)."""
        self._allowed = 0
        level = self._level_window(now_s)
        lull = level is not None and level.idle(self.policy)
        if lull or self._backoff.eased(level, self._targets) or self._backoff.retry_due(now_s):
            self.phase, self._why_waiting = GuardPhase.SLOW_START, None
            if lull:
                self._backoff.clear()
            self._beside_online = 0 if lull else 1  # back to 0 when they come after a lull; a try is beside them
            self._cut_settled_s = now_s  # judged on itself, not on the hold's windows
            self._set_level(1, now_s)

    def _decide(self, now_s: float) -> None:
        assert self.phase in GUARDING_PHASES and self._targets is not None
        since_cut = self._evidence(now_s, self._cut_settled_s)
        if since_cut is None:
            return
        level = self._evidence(now_s, self._level_since_s)
        if level is not None and level.pace_s is not None:
            self._fastest_pace_s = min(self._fastest_pace_s, level.pace_s)
        online_now = (self._history.others_now(now_s, self._own) or 0) > 0
        verdict, held_by = judge(since_cut, self._targets, self.policy), None
        if verdict is not Verdict.CUT and online_now and self._allowed > self._beside_online:
            verdict = Verdict.RETURN  # a level grown in a lull: back to the one judged beside them, surge or not
        elif verdict is Verdict.SURGE and self._allowed == 0:
            verdict, held_by = Verdict.HOLD, "online requests surging"  # nothing to take off
        elif verdict not in (Verdict.CUT, Verdict.SURGE):
            verdict = Verdict.HOLD if level is None else judge(level, self._targets, self.policy)
            if verdict is Verdict.GROW and (held_by := self._why_not_grow(level, now_s)):
                verdict = Verdict.HOLD
            elif verdict is Verdict.HOLD:
                held_by = "no window of the level yet" if level is None else no_room(level, self._targets, self.policy) or "the level too new"
        if verdict is Verdict.CUT and self._allowed == 0:
            held_by = excess(since_cut, self._targets, self.policy)  # the online traffic's own, or the server's
        phase, change = TRANSITIONS[(self.phase, verdict)]
        self._verdict, self._not_growing = verdict, held_by
        self._because = _because(verdict, since_cut, level, self._targets, self.policy)
        if self._not_growing is not None:
            self._held_by[self._not_growing] += 1
        room = growth_room(level, self._targets, self._allowed) if verdict is Verdict.GROW and level is not None else None
        allowed = min(self.max_in_flight, change(Levels(self._allowed, self._beside_online, room), self.policy))
        if verdict is Verdict.CUT and online_now:
            allowed = min(allowed, self._beside_online)  # a level grown in a lull is no level to halve beside them
        if verdict is Verdict.CUT and self._allowed == 1 and allowed == 0 and (why := self._one_was_too_many(level)):
            if since_cut.queue_held:
                self._capacity_running = since_cut.running
            self.phase, self._why_waiting, self._beside_online = GuardPhase.HELD, f"{why} beside one batch request", 0
            self._backoff.hold(now_s, self._evidence(now_s, -math.inf))  # the load over the last window, whatever the level's age
            self._cut_settled_s = now_s
            self._set_level(0, now_s)
            return
        self.phase = phase
        grown_in_a_lull = verdict is Verdict.GROW and level is not None and level.idle(self.policy)
        # judged beside online requests: their first tokens came at this level, or a cut with them on the server (no
        # higher level was); not a cut in a lull, on the batch's own excess, nor growth in one
        # a level above the last judged beside them (grown in a lull) is judged beside them on enough of their first tokens
        enough = self.policy.min_observations if allowed > self._beside_online else 1
        beside = level is not None and level.online_seen and level.latency.ttft_count >= enough and not grown_in_a_lull
        if beside or verdict in (Verdict.RETURN, Verdict.SURGE) or (verdict is Verdict.CUT and online_now):
            self._beside_online = allowed
            if beside and self._allowed >= 2:  # 2 judged harmless beside them: no backoff left to double
                self._backoff.clear()
        if phase is GuardPhase.DRAINING and since_cut.queue_held:
            self._capacity_running = since_cut.running
        if phase is GuardPhase.DRAINING and allowed == self._allowed == self._in_flight == 0:
            # nothing to drain: judged afresh from here, as after a drain (no log line a scrape while it lasts)
            self.phase, self._cut_settled_s = GuardPhase.STEADY, now_s
            self._set_level(0, now_s)
        elif phase is GuardPhase.DRAINING:
            self._allowed, self._draining_since_s = allowed, now_s
        elif allowed != self._allowed:
            self._set_level(allowed, now_s)

    def _one_was_too_many(self, level: WindowEvidence | None) -> str | None:
        """What the level at 1 showed over a target itself for sure (a first-token p99's whole bucket
        over it: held back on one interpolated near a wide bucket's top, the batch sat at 0-1 for whole
        runs), when the batch had exactly 1 on the server at every scrape since it was set that showed
        online requests (on the server's metrics: not a higher level's harm, nor the online traffic's
        own with no batch); None otherwise. A try after a hold needs no sure excess: its backoff
        doubles, where a cut to 0 would probe again a window later."""
        if level is None or level.basis != SERVER_METRICS or not level.online_seen or self._targets is None:
            return None
        if self._history.batch_beside_online(self._level_since_s) != {1}:
            return None
        return excess(level, self._targets, self.policy, sure=self._backoff.in_a_row == 0)

    def _why_not_grow(self, level: WindowEvidence | None, now_s: float) -> str | None:
        """Why the batch may not grow on evidence of room (in words, the same each time; None: it may).
        Growth also needs: metrics still there if they ever were, beside online requests a level that ran a
        whole window (judged on the 2-4 s of 5 first tokens of a heavy load, the batch grew six times between 1
        and 3 and was cut back six times in the minute of coserve (a)'s heavy phase, and left a window it
        ran 1.8 in on average at 1.31x alone's inter-token p99; AVX-512 host, 2026-11-29) and a server not
        saturated (its step under `saturated_pace` x the fastest seen), the batch using all it was
        allowed during the level, one more leaving 10 % of the server's
        capacity (as last seen full, at least 1) free, and from 0 a whole window at 0 (`_may_probe`)."""
        if level is None:
            return "no window of the level yet"
        if self._blind(level):
            return "the server's metrics gone"
        if level.online_seen and now_s - self._level_since_s < self.policy.window_s:
            return "the level not a window old beside online requests"
        if level.online_seen and self._saturated(level):
            return "the server's step over saturated_pace x the fastest seen"  # beside online requests, the step is evidence too
        if self._peak_in_flight < self._allowed:
            return "the batch using less than allowed"
        if self._capacity_running is not None and level.running is not None and (
                level.running + 1 > self._capacity_running - max(1, math.ceil(0.1 * self._capacity_running))):
            return "near the server's capacity as last seen full"
        if self._allowed == 0 and not self._may_probe(now_s):
            return "a window at 0 not over yet"
        return None

    def _saturated(self, level: WindowEvidence) -> bool:
        """The server's step over `saturated_pace` x the fastest the batch's streams saw: read from their
        own gaps, unknown (so saturated) without them while the batch is on the server; at 0 in flight,
        from the server's own histogram, its median gap's bucket wholly over. At 0 the batch has no gaps,
        and a probe grew it to 1 on a window's first tokens under target beside 68 online requests in
        a saturating ramp (online median step 12x idle), breaking the steady window at 1.26x first-token
        (coserve (b), AVX-512 host, 2026-11-29)."""
        bound_s = self.policy.saturated_pace * self._fastest_pace_s
        if level.pace_s is not None:
            return level.pace_s > bound_s
        if self._allowed > 0:
            return level.basis == SERVER_METRICS
        return level.server_pace_at_least_s is not None and level.server_pace_at_least_s > bound_s

    def _may_probe(self, now_s: float) -> bool:
        """From 0, growth (on positive evidence, as any) waits out a whole window at 0 too. On
        evidence short of it (no reason to cut or ease off: the online traffic's heavy phase alone
        between 0.75 and 0.9 of the targets), the probes a window apart broke (e)'s heavy window
        at 0.1 batch requests in flight on average: 1.31x inter-token (coserve matrix, AVX-512
        host, 2026-11-28); on an untuned server each probe's prompt is a whole prefill step."""
        return now_s - self._level_since_s >= self.policy.window_s

    def _blind(self, level: WindowEvidence) -> bool:
        """The server's metrics were there and are gone: the guard sees only its own requests now."""
        return level.basis == OWN_REQUESTS and self._history.seen > 0

    def _set_level(self, allowed: int, now_s: float) -> None:
        self._allowed, self._level_since_s, self._peak_in_flight = allowed, now_s, self._in_flight

    def _new_observation(self, now_s: float) -> bool:
        """A new snapshot; without fresh server metrics, new timings of the batch's own requests."""
        observed = (self._history.seen, self._own.reports if self._history.fresh(now_s) is None else 0)
        if observed == self._observed:
            return False
        self._observed = observed
        return True

    def _evidence(self, now_s: float, since_s: float) -> WindowEvidence | None:
        if self._history.fresh(now_s) is not None:
            return self._history.evidence(now_s, since_s, self._own, self._silent_s)
        return own_evidence(self._own, now_s, since_s, self.policy.window_s, self._silent_s)


def _because(verdict: Verdict, since_cut: WindowEvidence, level: WindowEvidence | None, targets: GuardTargets,
             policy: GuardPolicy) -> str | None:
    """What in the evidence gave a cut, an ease-off (the level's), a surge or a return, in words; None for the others."""
    if verdict is Verdict.CUT:
        return excess(since_cut, targets, policy) or (None if level is None else excess(level, targets, policy))
    if verdict is Verdict.EASE and level is not None:
        return excess(level, targets, policy, ease=True)
    if verdict is Verdict.SURGE:
        return "online requests on the server jumped beyond their noise"
    if verdict is Verdict.RETURN:
        return "online requests back after a lull the batch grew in"
    return None

