"""The latency guard's memory of a shared server: the snapshots of its metrics over the last
`max_window_s`, each with the batch's count in flight when it was scraped, read as the
`WindowEvidence` of a window (`ServerHistory.evidence`): the online traffic's p99s, whether online
requests were there, the server's own signs of overload, how its online load moves, and its step.

Invariant: the online traffic is the server's requests and timings less the batch's own (its
count in flight at each scrape, its exact first tokens and token gaps). First tokens are the
server's histogram less the batch's; inter-token gaps are the batch's own exact gaps beside
online requests (they decode in the same steps), with the gaps its prefills made the online
streams wait, when there are enough of them, else the server's histogram of all requests. The
batch's streams going without a token while online requests are there count as one more gap at
least that long (right-censored).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

from batchllm.engines.endpoint.guard_evidence import WindowEvidence
from batchllm.engines.endpoint.guard_policy import GuardPolicy
from batchllm.engines.endpoint.guard_targets import SERVER_METRICS
from batchllm.engines.endpoint.latency_window import (
    OwnTimings,
    WindowLatency,
    online_latency,
    online_longest_gap_bucket,
    server_latency,
    server_median_gap_at_least,
    weighted_p99,
    weighted_p99_at_least,
    weighted_p99_at_most,
)
from batchllm.engines.endpoint.server_metrics import MetricsSnapshot


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
            highest = exact + [(most_s, weight) for _, most_s, weight in waits]
            p99_s, at_most_s = weighted_p99(highest), weighted_p99_at_most(highest, sigmas)
            at_least_s = weighted_p99_at_least(exact + [(least_s, weight) for least_s, _, weight in waits], sigmas)
            centred_s = weighted_p99_at_least(exact + [((least_s + most_s) / 2, weight) for least_s, most_s, weight in waits], sigmas)
            assert p99_s is not None and at_most_s is not None and at_least_s is not None
            return replace(online, itl_p99_s=p99_s, itl_count=len(gaps) + len(waits),
                           itl_p99_bucket_s=(at_least_s, at_most_s), itl_p99_centred_s=centred_s, itl_from_histogram=False), True, True
        everyone = server_latency(start, end, [silent_s] if silent_s > 0 else [])
        if everyone.itl_p99_s is None:  # no histogram to count the silence in
            return online, True, False
        return (replace(online, itl_p99_s=everyone.itl_p99_s, itl_count=everyone.itl_count, itl_p99_bucket_s=everyone.itl_p99_bucket_s,
                        itl_from_histogram=True), True, True)


def _others(snapshot: MetricsSnapshot, batch_in_flight: int) -> float:
    """The requests the server held that were not the batch's when it was scraped (waiting ones
    included: they decode soon)."""
    return max(0.0, snapshot.running + snapshot.waiting - batch_in_flight)
