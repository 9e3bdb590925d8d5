"""What a stretch of a shared server's life shows the latency guard, and the verdict it gives.

`ServerHistory` keeps the snapshots of the last `max_window_s` with the batch's count in flight
at each, and reads a window of them as `WindowEvidence`: the online traffic's p99s (the server's
histograms less the batch's own timings; inter-token from the batch's own gaps beside online
requests), whether online requests were there at all, and the server's own signs of overload.
`judge` turns evidence into a `Verdict`.

Invariant: growth needs positive evidence, and a cut evidence of an excess (a first-token p99 over
its target interpolated in its bucket: there is nothing surer of it; an inter-token one for sure,
or a silence). What holds the batch back for long (`sure`) needs the first-token p99's whole
bucket over the target. A window grows the batch only when it holds enough
online observations under the growth bounds, or shows the server with no request but the
batch's in every snapshot; and never while online requests queue on the server (a latency
under a lax target is no room on a server at its capacity) or their number on it rises through
the last window beyond its noise (a load still building). The window also gives the server's
step as the batch's streams saw it (`pace_s`), which the guard holds against the fastest seen. Silence is not room: online
requests on the server with too few observations of them hold the level, and the batch's own
streams going without a token while online requests are there count as one more gap at least
that long (right-censored) in the inter-token p99 their gaps make (with too few gaps for one, or
over the first-token target, it cuts by itself).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from batchllm.engines.endpoint.guard_policy import GuardPolicy, Verdict
from batchllm.engines.endpoint.guard_targets import OWN_REQUESTS, SERVER_METRICS, GuardTargets
from batchllm.engines.endpoint.latency_window import (
    OwnTimings,
    WindowLatency,
    online_latency,
    online_longest_gap_bucket,
    own_latency,
    server_latency,
    server_median_gap_at_least,
    weighted_p99,
    weighted_p99_at_least,
)
from batchllm.engines.endpoint.server_metrics import MetricsSnapshot

# Observations a p99 is a p99 of: of fewer, the nearest rank is their largest. A sure inter-token excess needs
# them: held back on the largest of 60 gaps (one online prompt's prefill, 217 ms against a 143 ms target) 2 s
# after a cut to 1 in a heavy phase, the batch sat at 0 through the light phase after it (coserve (a), AVX-512
# host, 2026-11-29), where the probe a window after a plain cut to 0 would have run 1.
P99_OF_AT_LEAST = 100


@dataclass(frozen=True)
class WindowEvidence:
    basis: str  # SERVER_METRICS: the online traffic's latency; OWN_REQUESTS: the batch's own (no metrics)
    span_s: float  # how long a stretch it is over
    latency: WindowLatency
    online_seen: bool  # online requests were on the server (always assumed on the batch's own timings)
    preempted: bool
    kv_usage: float | None
    waiting: float | None
    queue_held: bool  # requests waited in the newest snapshot and the one before
    online_queued: bool  # requests waited, online ones on the server, in `queued_scrapes` of the window's snapshots
    running: float | None
    silent_s: float  # the longest any of the batch's decoding streams has now gone without a token
    silence_in_p99: bool = False  # that silence is one of the gaps the inter-token p99 is of (right-censored), not a verdict of its own
    idle_s: float = 0.0  # how long, up to now, the server held nothing but the batch's requests (whatever `since_s`)
    online_rising: bool = False  # online requests on the server rose through the window beyond their noise: a load still building
    online_surging: bool = False  # the newest scrape's online requests over the window's earlier ones beyond their noise
    online_ever: bool = False  # online requests have been on the server since the guard began
    pace_s: float | None = None  # the median of the batch's own token gaps in the window: the server's step as it ran
    # the lower bound of the bucket the server's median token gap (all requests: one step of a decoding batch, whoever's)
    # lies in: a bound, not a value, it can show a server saturated, never one with room
    server_pace_at_least_s: float | None = None

    def idle(self, policy: GuardPolicy) -> bool:
        """A lull: the server held nothing but the batch's requests for a whole window, or, once online
        requests have been on it, for `lull_s` (the gaps between light online arrivals are longer than
        a window, and the next arrival meets whatever the batch grew to). An online request that comes
        finds the batch at a level the lull showed harmless to nobody, not to it: RETURN then."""
        return self.basis == SERVER_METRICS and self.idle_s >= (policy.lull_s if self.online_ever else policy.window_s)

    @property
    def saturated(self) -> bool:
        """The server itself says it is full: it preempted, or requests waited in two scrapes in a row."""
        return self.preempted or self.queue_held


def excess(evidence: WindowEvidence, targets: GuardTargets, policy: GuardPolicy, *, ease: bool = False,
           sure: bool = False) -> str | None:
    """What in the evidence is over its target (`ease`: over its ease bound), in words; None: nothing.
    A first-token p99 (`_ttft_over_s`) and an inter-token one (`_itl_over_s`) each as a cut or a hold
    (`sure`) judges it, a silence of the batch's streams beside online requests as a gap at least that
    long (in the p99 where it is one of its gaps; over the first-token bound, by itself); the server's
    preemptions, queue and KV use count too."""
    latency, t = evidence.latency, targets
    ttft_bound, itl_bound = (t.ttft_ease_over_s, t.itl_ease_over_s) if ease else (t.ttft_target_s, t.itl_target_s)
    silent_s = evidence.silent_s if evidence.online_seen else None
    bound = "ease bound" if ease else "target"
    if (ttft_s := _ttft_over_s(latency, ttft_bound, sure)) is not None:
        assert ttft_bound is not None
        return f"online p99 TTFT {ttft_s:.2f} s over its {bound} {ttft_bound:.2f} s"
    if (itl_s := _itl_over_s(latency, itl_bound, sure)) is not None:
        assert itl_bound is not None
        return f"online p99 inter-token {itl_s * 1000:.0f} ms over its {bound} {itl_bound * 1000:.0f} ms"
    if silent_s is not None and itl_bound is not None and silent_s > itl_bound and not evidence.silence_in_p99:
        return f"a batch stream silent for {silent_s:.1f} s beside online requests, over the inter-token {bound} {itl_bound * 1000:.0f} ms"
    if silent_s is not None and ttft_bound is not None and silent_s > ttft_bound:
        return f"a batch stream silent for {silent_s:.1f} s beside online requests, over the first-token {bound} {ttft_bound:.2f} s"
    if evidence.preempted:
        return "the server preempted requests"
    if evidence.queue_held:
        return "requests waited on the server in two scrapes in a row"
    if not ease and evidence.kv_usage is not None and evidence.kv_usage > policy.kv_usage_cut:
        return f"KV cache {evidence.kv_usage:.0%} full"
    return None


def _ttft_over_s(latency: WindowLatency, bound_s: float | None, sure: bool) -> float | None:
    """The first-token p99 a cut or a hold judges, when it is over `bound_s`; None: it is not (or unknown).
    A cut: interpolated in its bucket with the bucket's observations spread evenly through it
    (`_centred`). A hold (`sure`): as Prometheus has it, its whole bucket over the bound."""
    if sure:
        return latency.ttft_p99_s if _surely_above(latency.ttft_p99_s, latency.ttft_p99_bucket_s, bound_s) else None
    centred_s = _centred(latency)
    return centred_s if _above(centred_s, bound_s) else None


def _itl_over_s(latency: WindowLatency, bound_s: float | None, sure: bool) -> float | None:
    """The inter-token p99 a cut or a hold judges, when it is over `bound_s`; None: it is not (or unknown).
    Of the batch's own gaps, a cut judges their p99 at the least their noise allows with each prefill's gap
    at the middle of its bounds (`itl_p99_centred_s`). From the server's histogram, or for a hold (`sure`,
    and then of `P99_OF_AT_LEAST` gaps or more), the p99 over for sure (`_surely_above`)."""
    if not sure and latency.itl_p99_centred_s is not None:
        return latency.itl_p99_centred_s if _above(latency.itl_p99_centred_s, bound_s) else None
    over = _surely_above(latency.itl_p99_s, latency.itl_p99_bucket_s, bound_s) and (not sure or latency.itl_count >= P99_OF_AT_LEAST)
    return latency.itl_p99_s if over else None


def judge(evidence: WindowEvidence, targets: GuardTargets, policy: GuardPolicy) -> Verdict:
    """CUT over a target (or on the server's signs of overload), SURGE when the online requests on the
    server just jumped, EASE over the ease bound, GROW on positive evidence of room once the stretch
    is `judge_after_s` long, else HOLD."""
    if excess(evidence, targets, policy) is not None:
        return Verdict.CUT
    if evidence.online_surging:
        return Verdict.SURGE
    if evidence.span_s < policy.judge_after_s:
        return Verdict.HOLD
    if excess(evidence, targets, policy, ease=True) is not None:
        return Verdict.EASE
    return Verdict.HOLD if no_room(evidence, targets, policy) else Verdict.GROW


def no_room(evidence: WindowEvidence, targets: GuardTargets, policy: GuardPolicy) -> str | None:
    """Why the evidence shows no room to grow, in words (the same words each time: a guard's log counts
    them); None: it shows room (a lull, or enough online observations under the growth bounds, nothing
    waiting, the load steady, KV not nearly full). Not judged on a cut or an ease-off: see `excess`."""
    kv, latency, t = evidence.kv_usage, evidence.latency, targets
    if (evidence.waiting or 0) > 0:
        return "requests waiting on the server"
    if evidence.online_queued:
        return "online requests queued in the window"
    if evidence.online_rising:
        return "online requests on the server rising"
    if kv is not None and kv > policy.kv_usage_grow:
        return "KV cache nearly full"
    if evidence.idle(policy):
        return None
    if not ((t.ttft_target_s is None or latency.ttft_count >= policy.min_observations)
            and (t.itl_target_s is None or latency.itl_count >= policy.min_observations)):
        return "too few online observations"
    if not t.lets_grow(latency):
        return "online p99 over its growth bound"
    if evidence.online_seen and _above(evidence.silent_s, t.itl_grow_under_s):
        return "a batch stream silent over the inter-token growth bound"
    return None


def growth_room(evidence: WindowEvidence, targets: GuardTargets, allowed: int) -> int | None:
    """The most batch requests the evidence leaves room for beside online requests: as many as keep each
    online p99 under its ease bound were it to grow in proportion to the requests on the server (a step's
    time grows less than that: it has a part no request adds to). None: no bound (no online request seen,
    no count of the server's requests, or no p99 with a bound). Doubled on p99s under the growth bounds,
    the batch went from 8 to 16 beside a scripted light load (first-token p99 0.08 s, target 0.11 s), whose
    first tokens then took 0.24 s: of 8 seeds of a light-heavy-light load, 4 broke a window, up to 1.63x
    alone's first-token p99; capped here, 1 of the 8, at 1.32x, where the heavy load met a batch grown in
    the light (`benchmarks/guard_scripted.py`)."""
    if not evidence.online_seen or evidence.running is None:
        return None
    latency, on_server = evidence.latency, max(float(allowed), evidence.running + (evidence.waiting or 0.0))
    factors = [bound / p99 for p99, bound in ((latency.ttft_p99_s, targets.ttft_ease_over_s),
                                              (latency.itl_p99_s, targets.itl_ease_over_s))
               if p99 is not None and p99 > 0 and bound is not None]
    if not factors:
        return None
    return math.floor(on_server * min(factors) - (on_server - allowed))


def load_eased(before: WindowEvidence, after: WindowEvidence, sigmas: float) -> bool:
    """The online traffic came at a lower rate in `after` than in `before`, beyond its noise: of the
    online first tokens of both stretches (Poisson counts: one per request, whatever its length), the
    share in `after` under its share of their time by more than `sigmas` binomial sigmas."""
    came_before, came_after = before.latency.ttft_count, after.latency.ttft_count
    both = came_before + came_after
    if both <= 0 or before.span_s <= 0 or after.span_s <= 0:
        return False
    share = after.span_s / (before.span_s + after.span_s)
    return came_after < both * share - sigmas * math.sqrt(both * share * (1 - share))


class ServerHistory:
    """The snapshots of the last `max_window_s` (and one before), each with the batch's count in flight then."""

    def __init__(self, policy: GuardPolicy) -> None:
        self.policy = policy
        self._kept: deque[tuple[MetricsSnapshot, int]] = deque()
        self.seen = 0  # snapshots so far
        self.first_with_latency: MetricsSnapshot | None = None
        self.online_ever = False  # a snapshot showed requests that were not the batch's

    def add(self, snapshot: MetricsSnapshot, batch_in_flight: int) -> None:
        if self._kept and snapshot.at_s < self._kept[-1][0].at_s:
            raise ValueError(f"snapshot at_s {snapshot.at_s!r} is before the previous one's, {self._kept[-1][0].at_s!r}")
        self._kept.append((snapshot, batch_in_flight))
        self.seen += 1
        self.online_ever = self.online_ever or _others(snapshot, batch_in_flight) > 0
        if self.first_with_latency is None and snapshot.ttft is not None:
            self.first_with_latency = snapshot
        while len(self._kept) > 1 and self._kept[1][0].at_s <= snapshot.at_s - self.policy.max_window_s:
            self._kept.popleft()

    @property
    def oldest_at_s(self) -> float | None:
        return self._kept[0][0].at_s if self._kept else None

    def fresh(self, now_s: float) -> MetricsSnapshot | None:
        """The newest snapshot, if it is at most a window old."""
        if self._kept and now_s - self._kept[-1][0].at_s <= self.policy.window_s:
            return self._kept[-1][0]
        return None

    def batch_beside_online(self, since_s: float) -> set[int]:
        """The batch's counts in flight at the snapshots from `since_s` on that showed online requests."""
        return {batch for snapshot, batch in self._kept if snapshot.at_s >= since_s and _others(snapshot, batch) > 0}

    def others_now(self, now_s: float, own: OwnTimings) -> float | None:
        """Requests on the server, in the fresh snapshot, that are not the batch's; at least 1 when
        online first tokens came since the snapshot before it (the gauges less the batch's own count
        hide an online request while one of the batch's is on the wire or just done)."""
        fresh = self.fresh(now_s)
        if fresh is None:
            return None
        others = _others(fresh, self._kept[-1][1])
        if others == 0 and len(self._kept) > 1 and self._online_first_tokens(self._kept[-2][0], fresh, own) >= 1:
            return 1.0
        return others

    def quiet_for_trickle(self, now_s: float, own: OwnTimings) -> bool:
        """No online request on the server now, nor for `trickle_quiet_gaps` of the online traffic's
        mean arrival gap over the history (its first tokens less the batch's); with none in the
        history, no online request now is enough. False without a fresh snapshot."""
        if self.others_now(now_s, own) != 0:
            return False
        oldest, newest = self._kept[0][0], self._kept[-1][0]
        arrivals = self._online_first_tokens(oldest, newest, own)
        if arrivals < 1:
            return True
        return self._idle_s(own) >= self.policy.trickle_quiet_gaps * (newest.at_s - oldest.at_s) / arrivals

    def evidence(self, now_s: float, since_s: float, own: OwnTimings, silent_s: float) -> WindowEvidence | None:
        """What the last `window_s` showed, from `since_s` at the earliest; widened back (up to
        `max_window_s`, not before `since_s`) while online requests were there and fewer than
        `min_observations` of their first tokens came. None without a fresh snapshot and one before it."""
        newest = self.fresh(now_s)
        if newest is None or newest.ttft is None:
            return None
        earlier = [s for s, _ in self._kept if since_s <= s.at_s < newest.at_s]
        if not earlier:
            return None
        horizon = [s for s in earlier if s.at_s <= newest.at_s - self.policy.window_s]
        standard = horizon[-1] if horizon else earlier[0]
        start, wider = standard, [s for s in earlier if s.at_s < standard.at_s]
        while wider and self._online_first_tokens(start, newest, own) < self.policy.min_observations:
            start = wider.pop()
        latency, online_seen, silence_in_p99 = self._online(start, newest, own, silent_s)
        if not online_seen and start is not standard:  # widened for nothing: no online request
            start = standard
            latency, online_seen, silence_in_p99 = self._online(start, newest, own, silent_s)
        before_newest = self._kept[-2][0] if len(self._kept) > 1 else None
        previous = before_newest if before_newest is not None and before_newest.at_s >= start.at_s else None  # in the window
        preempted = newest.preemptions is not None and start.preemptions is not None and newest.preemptions > start.preemptions
        queued = sum(1 for s, batch in self._within(start.at_s, newest.at_s) if s.waiting > 0 and _others(s, batch) > 0)
        # the load's rise over the last window whatever level the batch ran at: it is the server's, not the level's. Read
        # only since the level was set, a level 2 s old showed too few snapshots to see one, and the batch grew by one every
        # 2 s through a saturating load's ramp (1 to 8 in 15 s in a scripted run; 4.1 in flight on average in coserve (b)'s)
        trend = self._within(newest.at_s - self.policy.window_s, newest.at_s)
        return WindowEvidence(SERVER_METRICS, newest.at_s - start.at_s, latency, online_seen, preempted, newest.kv_usage, newest.waiting,
                              queue_held=newest.waiting > 0 and previous is not None and previous.waiting > 0,
                              online_queued=queued >= self.policy.queued_scrapes, running=newest.running,
                              silent_s=silent_s, silence_in_p99=silence_in_p99, idle_s=self._idle_s(own),
                              online_ever=self.online_ever or online_seen,
                              online_rising=self._rising(trend), online_surging=self._surging(trend),
                              pace_s=self._pace(start, newest, own), server_pace_at_least_s=server_median_gap_at_least(start, newest, self.policy.own_gaps_min))

    def _beside_online(self, from_s: float, until_s: float) -> list[tuple[MetricsSnapshot, MetricsSnapshot, float]]:
        """The stretches between consecutive snapshots from `from_s` to `until_s` where either showed online
        requests, each with the online requests per batch request there (the means of its two ends; at
        least 1 batch request): the weight of one of the batch's gaps there among the online ones."""
        kept = self._within(from_s, until_s)
        return [(before, after, (_others(before, batch_before) + _others(after, batch_after)) / 2
                 / max(1.0, (batch_before + batch_after) / 2))
                for (before, batch_before), (after, batch_after) in zip(kept, kept[1:])
                if _others(before, batch_before) > 0 or _others(after, batch_after) > 0]

    def _prefill_waits(self, beside: list[tuple[MetricsSnapshot, MetricsSnapshot, float]],
                       own: OwnTimings) -> list[tuple[float, float, float]]:
        """The gaps the batch's own prompts' prefills made the online streams wait in the stretches
        `beside` online requests (`_beside_online`), each as (at least, at most, its stretch's weight as
        the batch's gaps'). A stream never waits through its own prompt's prefill and every other decoding
        stream does: on its gaps alone, one try at 1 read 42-43 ms against a 45.6 ms target where the
        online clients saw 49 ms (coserve (c), AVX-512 host, 2026-11-29). One gap per first token of the
        batch's in a stretch between snapshots that showed online requests, known only by bounds: the
        prefill's step is a gap of every online stream decoding then, one the batch's streams did not wait
        through, so in the histogram bucket of the longest gap there of a step they did not see, once the
        gaps of the steps they saw are taken out (`online_longest_gap_bucket`: left in, an online prompt's
        prefill step, which the batch's streams waited through too and count among their own gaps, would
        set the bound in any stretch that holds one, nearly every stretch of a light load of one online
        request a second), and at most the time to first token (which also holds the client's and the
        HTTP server's time: with times to first token counted whole, the guard held the batch back on an
        online p99 it read at 143 ms in coserve (a)'s light phase, where the online clients saw 56 ms;
        AVX-512 host, 2026-11-29). Growth judges them at their upper bounds, a cut at the middle of
        theirs (as a first-token p99 with its bucket spread, `_centred`), a hold for long (`sure`) at their
        lower ones: taken as exact at the bucket's top, a prefill gap bounded by (75, 100] ms was the p99 of 22 gaps
        and cut the batch twice on "100 ms over its target 99 ms" where the server's own p99 of every
        gap was 49-72 ms (coserve (a), AVX-512 host, 2026-11-29). Without a histogram, the time to first
        token, exactly; with no online gap in the stretch, none."""
        waits: list[tuple[float, float, float]] = []
        for before, after, weight in beside:
            ttfts = own.ttfts_s(before.at_s, after.at_s)
            if not ttfts:
                continue
            if before.itl is None or after.itl is None:
                waits.extend((ttft_s, ttft_s, weight) for ttft_s in ttfts)
                continue
            # copies: the batch's gap and the online ones of its step (`online_longest_gap_bucket`)
            bucket = online_longest_gap_bucket(before, after, own, max(1, math.floor(1 + weight)))
            if bucket is not None:
                waits.extend((min(ttft_s, bucket[0]), min(ttft_s, bucket[1]), weight) for ttft_s in ttfts)
        return waits

    def _pace(self, start: MetricsSnapshot, end: MetricsSnapshot, own: OwnTimings) -> float | None:
        """The median of the batch's own token gaps between the two: the server's step time as its
        streams saw it (each step gives every decoding request a token); None with fewer than
        `own_gaps_min` gaps."""
        gaps = sorted(own.gaps_s(start.at_s, end.at_s))
        return gaps[len(gaps) // 2] if len(gaps) >= self.policy.own_gaps_min else None

    def _rising(self, within: list[tuple[MetricsSnapshot, int]]) -> bool:
        """The online requests on the server in the window's second half (by time) over those in its
        first by more than `rising_sigmas` Poisson sigmas of the first's mean (at least 1), and 1."""
        if len(within) < 4:
            return False
        middle_s = (within[0][0].at_s + within[-1][0].at_s) / 2
        first = [_others(s, batch) for s, batch in within if s.at_s < middle_s]
        second = [_others(s, batch) for s, batch in within if s.at_s >= middle_s]
        if not first or not second:
            return False
        before, after = sum(first) / len(first), sum(second) / len(second)
        return after - before > self.policy.rising_sigmas * math.sqrt(max(1.0, before)) + 1.0

    def _surging(self, within: list[tuple[MetricsSnapshot, int]]) -> bool:
        """The online requests on the server in the newest snapshot over the mean of the window's earlier
        ones by more than `surge_sigmas` Poisson sigmas of that mean (at least 1), and 1."""
        if len(within) < 3:
            return False
        earlier = [_others(s, batch) for s, batch in within[:-1]]
        before, now = sum(earlier) / len(earlier), _others(*within[-1])
        return now - before > self.policy.surge_sigmas * math.sqrt(max(1.0, before)) + 1.0

    def _within(self, from_s: float, until_s: float) -> list[tuple[MetricsSnapshot, int]]:
        """The kept snapshots taken from `from_s` to `until_s`, both included, each with the batch's count in flight then."""
        return [(s, batch) for s, batch in self._kept if from_s <= s.at_s <= until_s]

    def _idle_s(self, own: OwnTimings) -> float:
        """How long back from the newest snapshot every snapshot showed no request but the batch's,
        and no first token came that was not the batch's."""
        kept = list(self._kept)
        newest, _ = kept[-1]
        if _others(*kept[-1]) > 0:
            return 0.0
        since = newest
        for (before, batch), (after, _) in zip(reversed(kept[:-1]), reversed(kept[1:])):
            came = self._online_first_tokens(before, after, own)
            if _others(before, batch) > 0 or came > 0:
                break
            since = before
        return newest.at_s - since.at_s

    @staticmethod
    def _online_first_tokens(start: MetricsSnapshot, end: MetricsSnapshot, own: OwnTimings) -> float:
        """First tokens the server counted between the two, less the batch's own."""
        if start.ttft is None or end.ttft is None or start.ttft.upper_bounds_s != end.ttft.upper_bounds_s:
            return 0.0  # a histogram missing, or a server restarted with other buckets
        return end.ttft.count_since(start.ttft) - len(own.ttfts_s(start.at_s, end.at_s))  # since a restart, if there was one

    def _online(self, start: MetricsSnapshot, end: MetricsSnapshot, own: OwnTimings, silent_s: float) -> tuple[WindowLatency, bool, bool]:
        """The online p99s of the window and whether online requests were there. TTFT: the server's
        minus the batch's own (one each per request). Inter-token: the batch's own gaps in the
        stretches between snapshots that showed online requests, and the gaps its prefills made
        (`_prefill_waits`), when there are `own_gaps_min` of them: they decode in the same steps as
        the online ones, so they wait the same gaps, where vLLM's histogram has one bucket from 100 to
        150 ms, often around a target. Each gap weighs
        the online requests per batch request in its stretch: a step is one gap to each request in
        it, and a burst of online work gives the online traffic many gaps where the batch's few
        requests see each step once. Else the server's over all requests. Either way the gap the
        silentest of the batch's streams is in now counts as one more, at least as long as its silence
        (right-censored; among its own gaps with the newest stretch's weight): a stall is a gap to each
        request it holds, one among the hundreds of a window, not a p99 by itself. Also whether online
        requests were there, and whether the silence is in the p99 (not without an inter-token histogram)."""
        online = online_latency(start, end, own)
        online_seen = online.ttft_count > 0 or any(_others(s, batch) > 0 for s, batch in self._within(start.at_s, end.at_s))
        if not online_seen:
            return replace(online, itl_p99_s=None, itl_count=0, itl_p99_bucket_s=None, itl_from_histogram=False), False, False
        pairs = self._beside_online(start.at_s, end.at_s)
        beside = [(before.at_s, after.at_s, weight) for before, after, weight in pairs]
        gaps, waits = own.gaps_within(beside), self._prefill_waits(pairs, own)
        if len(gaps) + len(waits) >= self.policy.own_gaps_min:
            silence = [(silent_s, beside[-1][2])] if silent_s > 0 else []  # gaps came from stretches: there is a newest
            exact, sigmas = gaps + silence, self.policy.excess_sigmas
            at_most_s = weighted_p99(exact + [(most_s, weight) for _, most_s, weight in waits])
            at_least_s = weighted_p99_at_least(exact + [(least_s, weight) for least_s, _, weight in waits], sigmas)
            centred_s = weighted_p99_at_least(exact + [((least_s + most_s) / 2, weight) for least_s, most_s, weight in waits], sigmas)
            assert at_most_s is not None and at_least_s is not None
            return replace(online, itl_p99_s=at_most_s, itl_count=len(gaps) + len(waits),
                           itl_p99_bucket_s=(at_least_s, at_most_s), itl_p99_centred_s=centred_s, itl_from_histogram=False), True, True
        everyone = server_latency(start, end, [silent_s] if silent_s > 0 else [])
        if everyone.itl_p99_s is None:  # no histogram to count the silence in
            return online, True, False
        return (replace(online, itl_p99_s=everyone.itl_p99_s, itl_count=everyone.itl_count, itl_p99_bucket_s=everyone.itl_p99_bucket_s,
                        itl_from_histogram=True), True, True)


def own_evidence(own: OwnTimings, now_s: float, since_s: float, window_s: float, silent_s: float) -> WindowEvidence:
    """The batch's own latency over the last window (no server metrics): online traffic is assumed there."""
    from_s = max(now_s - window_s, since_s)
    return WindowEvidence(OWN_REQUESTS, now_s - from_s, own_latency(own, from_s, now_s), online_seen=True, preempted=False,
                          kv_usage=None, waiting=None, queue_held=False, online_queued=False, running=None, silent_s=silent_s)


def _others(snapshot: MetricsSnapshot, batch_in_flight: int) -> float:
    """The requests the server held that were not the batch's when it was scraped (waiting ones
    included: they decode soon)."""
    return max(0.0, snapshot.running + snapshot.waiting - batch_in_flight)


def _centred(latency: WindowLatency) -> float | None:
    """The first-token p99 an excess is judged on: from a histogram, with its bucket's observations spread
    evenly through it (`Histogram.quantile_centred`), not at its top. vLLM's bucket from 0.1 to 0.25 s holds
    targets (alone's p99 x 1.25: 0.24 s in coserve (e)), and the p99 of a window's few online first tokens,
    interpolated as Prometheus does, sits near the top of the bucket its largest lies in: one first token
    over 0.1 s, as the online traffic alone has, reads as about 0.24 s. Two of (e)'s cuts from 1 to 0 in
    13 s came with such a reading against the 0.24 s target (the inter-token p99 under its own), where the
    online clients' windows were at 0.81-1.04x alone's first-token p99 (coserve (e), AVX-512 host,
    2026-11-29). Growth still needs the p99 as `quantile` has it under its bound."""
    return latency.ttft_p99_s if latency.ttft_p99_centred_s is None else latency.ttft_p99_centred_s


def _above(value_s: float | None, bound_s: float | None) -> bool:
    return value_s is not None and bound_s is not None and value_s > bound_s


def _surely_above(p99_s: float | None, bucket_s: tuple[float, float] | None, bound_s: float | None) -> bool:
    """The p99 is over the bound for sure: its exact value is, or the whole histogram bucket it lies in
    (lower, upper] is. vLLM's buckets are wide where targets lie (first tokens 1.0-2.5 s and
    0.1-0.25 s, token gaps 25-50 ms and 100-150 ms), and an interpolated p99 of a few observations
    sits near its bucket's top: with 3 first tokens and the slowest in (1.0, 2.5], 2.455 s whatever
    that token's time. Held back on it, the guard read "online p99 TTFT 2.45 s over its target
    2.14 s" beside one batch request in coserve (a) runs where the online clients' worst 30 s window
    p99 was 1.42 s and 1.68 s, and kept the batch at 0-1 for the rest of the run. The batch's own gaps and
    its prefills' (some known only by bounds) are over for sure when their p99 at the least their noise
    allows, with each at its lower bound, is."""
    if bucket_s is None or bucket_s[0] == bucket_s[1]:
        return _above(p99_s, bound_s)
    return bound_s is not None and bucket_s[0] >= bound_s
