"""The latency a shared server showed over a stretch of time: all requests', the online traffic's
alone (the batch's own requests taken out), or the batch's own as its client saw them.

vLLM's and SGLang's latency histograms have no label that tells online requests from batch ones:
both are counted together. The batch knows its own timings (`OwnTimings`), each placed at the
moment the client saw it, so the observations of the batch made between two snapshots can be
taken out of the histograms' difference (`online_latency`). What is left is the online traffic's,
up to the client-server timing differences `Histogram.minus_samples` leans against (each of the
batch's values from its bucket, else the nearest below; a first token the client saw a bucket later
than the server counted it can still take a slower online one out of that bucket).

Invariant: an own timing is counted in a stretch (after_s, until_s] by the moment it was seen,
the same clock as the snapshots' `at_s`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from batchllm.engines.endpoint.server_metrics import Histogram, MetricsSnapshot

P99 = 0.99


def weighted_p99(values_s: Sequence[tuple[float, float]]) -> float | None:
    """The 99th percentile of exact values, each (value, weight): the smallest value at or under
    which 99 % of the weight lies; None when there is no weight."""
    total = sum(weight for _, weight in values_s)
    if not total > 0:
        return None
    running = 0.0
    for value, weight in sorted(values_s):
        running += weight
        if running >= P99 * total * (1 - 1e-12):  # not one rounding short of the 99 % point
            return value
    return max(value for value, weight in values_s if weight > 0)  # rounding: the last value with weight


def weighted_p99_at_least(values_s: Sequence[tuple[float, float]], sigmas: float) -> float | None:
    """The p99 of the distribution exact values, each (value, weight), are a sample of, at the least their
    noise allows: the largest value with at least 1 % of the total weight at or over it, and `sigmas` binomial
    sigmas (sqrt(total x 0.01 x 0.99)) more; the smallest value when no value has. Of 300 values of weight 1, 6.5
    at or over it: their 7th largest, where the nearest-rank p99 is their 4th; of 20, their 2nd largest, where
    the nearest-rank p99 is their largest. The count of a sample's values over a level is binomial: a few
    hundred values of a load that is over a target half as often as a p99 allows hold four or more over it
    in one sample of fifteen. None when there is no weight."""
    total = sum(weight for _, weight in values_s)
    if not total > 0:
        return None
    over = (1 - P99) * total + sigmas * math.sqrt(total * P99 * (1 - P99))
    return _from_the_top(values_s, lambda running: running >= over * (1 - 1e-12))


def weighted_p99_at_most(values_s: Sequence[tuple[float, float]], sigmas: float) -> float | None:
    """The p99 of the distribution exact values, each (value, weight), are a sample of, at the most their
    noise allows (`weighted_p99_at_least`'s other side): the largest value with more than 1 % of the total
    weight at or over it, less `sigmas` binomial sigmas; their largest when that is no weight at all. Of
    1,000 values of weight 1, more than 3.7 at or over it: their 4th largest, where the nearest-rank p99 is their 11th; of
    fewer than about 400, their largest (so few cannot tell a p99 from their maximum). None when there is
    no weight."""
    total = sum(weight for _, weight in values_s)
    if not total > 0:
        return None
    over = (1 - P99) * total - sigmas * math.sqrt(total * P99 * (1 - P99))
    return _from_the_top(values_s, lambda running: running > over * (1 + 1e-12))


def _from_the_top(values_s: Sequence[tuple[float, float]], enough: Callable[[float], bool]) -> float:
    """The largest value whose weight at or over it is `enough`; the smallest value with weight when none is."""
    running = 0.0
    for value, weight in sorted(values_s, reverse=True):
        running += weight
        if enough(running):
            return value
    return min(value for value, weight in values_s if weight > 0)


def exactly(p99_s: float | None) -> tuple[float, float] | None:
    """What is known of a p99 of exact values: the value."""
    return None if p99_s is None else (p99_s, p99_s)


def p99_of(values_s: Sequence[float]) -> float | None:
    """The 99th percentile of exact values (nearest rank): each of weight 1; None when there are none."""
    return weighted_p99([(value, 1.0) for value in values_s])


@dataclass(frozen=True)
class WindowLatency:
    """p99 time to first token and inter-token latency over a stretch, how many observations each
    is of (None: no observation), and what is known of each: the bucket (lower, upper] it lies in
    when it comes from a histogram (the p99 itself is interpolated inside it), (p99, p99) when it is
    of exact values. Of the batch's own token gaps and the gaps its prefills made (some known only by
    bounds, `server_history.ServerHistory`), (at least, at most): the p99 at the least their noise
    allows with each of those at its lower bound (`weighted_p99_at_least`), and at the most it allows
    with each at its upper bound (`weighted_p99_at_most`); `itl_p99_s` is then their nearest-rank p99
    with each at its upper bound."""

    ttft_p99_s: float | None
    itl_p99_s: float | None
    ttft_count: float
    itl_count: float
    ttft_p99_bucket_s: tuple[float, float] | None
    itl_p99_bucket_s: tuple[float, float] | None
    # from a histogram, the first-token p99 with its bucket's observations spread evenly through it
    # (`Histogram.quantile_centred`); None: as `ttft_p99_s` (exact values)
    ttft_p99_centred_s: float | None = None
    # of the batch's own gaps and its prefills', the inter-token p99 at the least their noise allows with each
    # prefill's gap at the middle of its bounds: what a cut judges; None: as `itl_p99_bucket_s` has it
    itl_p99_centred_s: float | None = None
    # the inter-token p99 is the server's histogram's (every request's, or the online ones' with the batch's gaps taken out):
    # `itl_p99_bucket_s` is then the bucket it lies in, not bounds of the batch's own gaps
    itl_from_histogram: bool = False


class TimedValues:
    """Values each seen at a moment, kept in order of the moment: the values of a stretch are found by
    bisection, not by a scan (the guard reads several stretches of a minute of tokens every scrape,
    on the thread that reads the streams: scanned, its step took 9-25 ms a scrape and inflated the
    very token gaps it reads, `benchmarks/results/guard-step-cost-2026-11-29-avx512.txt`)."""

    def __init__(self) -> None:
        self._at_s: list[float] = []
        self._values: list[float] = []

    def __len__(self) -> int:
        return len(self._at_s)

    def add(self, at_s: float, value: float) -> None:
        """In order of `at_s`; after those seen at the same moment (a request's first token can come
        before the gaps of another reported earlier)."""
        i = bisect.bisect_right(self._at_s, at_s)
        self._at_s.insert(i, at_s)
        self._values.insert(i, value)

    def between(self, after_s: float, until_s: float) -> list[float]:
        """The values seen in (after_s, until_s]."""
        return self._values[bisect.bisect_right(self._at_s, after_s):bisect.bisect_right(self._at_s, until_s)]

    def within(self, stretches: Sequence[tuple[float, float, float]]) -> list[tuple[float, float]]:
        """The values seen inside any of the stretches (after_s, until_s, weight], given in order of time
        and not overlapping, each with its stretch's weight: one pass from the first stretch on."""
        found: list[tuple[float, float]] = []
        if not stretches:
            return found
        stretch = iter(stretches)
        current = next(stretch, None)
        for i in range(bisect.bisect_right(self._at_s, stretches[0][0]), len(self._at_s)):
            while current is not None and self._at_s[i] > current[1]:
                current = next(stretch, None)
            if current is None:
                break
            if self._at_s[i] > current[0]:
                found.append((self._values[i], current[2]))
        return found

    def forget_before(self, at_s: float) -> None:
        i = bisect.bisect_left(self._at_s, at_s)
        del self._at_s[:i], self._values[:i]


class OwnTimings:
    """The batch's own requests' timings: times to first token and gaps between streamed tokens,
    each at the moment the client saw it."""

    def __init__(self) -> None:
        self._ttfts = TimedValues()
        self._gaps = TimedValues()
        self.reports = 0  # calls to `add` so far: tells a caller that new timings came

    def add(self, now_s: float, ttft_s: float | None, token_gaps_s: Sequence[float]) -> None:
        """Timings seen up to `now_s`: the last gap ended at `now_s`, each earlier one where the next
        began, and the first token came before all the gaps."""
        for value in (ttft_s, *token_gaps_s):
            if value is not None and not value >= 0:
                raise ValueError(f"a time to first token or a token gap is >= 0 seconds, got {value!r}")
        at_s = now_s
        ended: list[tuple[float, float]] = []
        for gap_s in reversed(token_gaps_s):
            ended.append((at_s, gap_s))
            at_s -= gap_s
        if ttft_s is not None:
            self._ttfts.add(at_s, ttft_s)
        for item in reversed(ended):
            self._gaps.add(*item)
        self.reports += 1

    def ttfts_s(self, after_s: float, until_s: float) -> list[float]:
        return self._ttfts.between(after_s, until_s)

    def gaps_s(self, after_s: float, until_s: float) -> list[float]:
        return self._gaps.between(after_s, until_s)

    def gaps_within(self, stretches: Sequence[tuple[float, float, float]]) -> list[tuple[float, float]]:
        """The token gaps seen inside any of the stretches (after_s, until_s, weight] (in order of time, not
        overlapping), each with its stretch's weight."""
        return self._gaps.within(stretches)

    def forget_before(self, at_s: float) -> None:
        self._ttfts.forget_before(at_s)
        self._gaps.forget_before(at_s)


def _delta(new: Histogram | None, old: Histogram | None) -> Histogram | None:
    if new is None or old is None or new.upper_bounds_s != old.upper_bounds_s:
        return None  # a histogram missing at either end, or the server restarted with other buckets
    return new.minus(old)


def _latency(ttft: Histogram | None, itl: Histogram | None) -> WindowLatency:
    return WindowLatency(ttft_p99_s=None if ttft is None else ttft.quantile(P99), itl_p99_s=None if itl is None else itl.quantile(P99),
                         ttft_count=0.0 if ttft is None else ttft.count, itl_count=0.0 if itl is None else itl.count,
                         ttft_p99_bucket_s=None if ttft is None else ttft.quantile_bucket(P99),
                         itl_p99_bucket_s=None if itl is None else itl.quantile_bucket(P99),
                         ttft_p99_centred_s=None if ttft is None else ttft.quantile_centred(P99), itl_from_histogram=itl is not None)


def server_latency(start: MetricsSnapshot, end: MetricsSnapshot, more_gaps_s: Sequence[float] = ()) -> WindowLatency:
    """Every request's latency between two snapshots, the batch's included, with `more_gaps_s` among
    the inter-token ones (the gaps streams are in now, each at least as long as its silence so far)."""
    itl = _delta(end.itl, start.itl)
    return _latency(_delta(end.ttft, start.ttft), None if itl is None else itl.plus_samples(more_gaps_s))


def server_median_gap_at_least(start: MetricsSnapshot, end: MetricsSnapshot, min_gaps: int) -> float | None:
    """The lower bound of the bucket the median of every request's token gaps between two snapshots
    lies in: a step at least that long; None with fewer than `min_gaps` gaps or no histogram."""
    itl = _delta(end.itl, start.itl)
    bucket = itl.quantile_bucket(0.5) if itl is not None and itl.count >= min_gaps else None
    return None if bucket is None else bucket[0]


def online_longest_gap_bucket(start: MetricsSnapshot, end: MetricsSnapshot, own: OwnTimings,
                              copies: int = 1) -> tuple[float, float] | None:
    """The bucket (lower, upper] the longest token gap between two snapshots lies in, of those left
    once each of the batch's own gaps there is taken out `copies` times (its own, and `copies` - 1 gaps
    of other streams in the same step: a step the batch's streams also waited through), from its bucket
    or the nearest below, never above (`Histogram.minus_samples`): no gap of a step the batch's streams
    did not see was longer than its upper bound; None without a histogram or with no gap left."""
    itl = _delta(end.itl, start.itl)
    if itl is None:
        return None
    return itl.minus_samples(own.gaps_s(start.at_s, end.at_s), copies).quantile_bucket(1.0)


def online_latency(start: MetricsSnapshot, end: MetricsSnapshot, own: OwnTimings) -> WindowLatency:
    """The online traffic's latency between two snapshots: the server's minus the batch's own."""
    ttft, itl = _delta(end.ttft, start.ttft), _delta(end.itl, start.itl)
    if ttft is not None:
        ttft = ttft.minus_samples(own.ttfts_s(start.at_s, end.at_s))
    if itl is not None:
        itl = itl.minus_samples(own.gaps_s(start.at_s, end.at_s))
    return _latency(ttft, itl)


def own_latency(own: OwnTimings, after_s: float, until_s: float) -> WindowLatency:
    """The batch's own latency in (after_s, until_s], as its client saw it."""
    ttfts, gaps = own.ttfts_s(after_s, until_s), own.gaps_s(after_s, until_s)
    ttft_p99_s, itl_p99_s = p99_of(ttfts), p99_of(gaps)
    return WindowLatency(ttft_p99_s=ttft_p99_s, itl_p99_s=itl_p99_s, ttft_count=len(ttfts), itl_count=len(gaps),
                         ttft_p99_bucket_s=exactly(ttft_p99_s), itl_p99_bucket_s=exactly(itl_p99_s))
