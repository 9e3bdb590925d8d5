"""What the latency guard reads a window with: the batch's own timings placed when its client saw
them, weighted p99s, the online traffic's latency (the server's histograms less the batch's own),
the batch's gaps beside online requests, and the targets' band."""

from __future__ import annotations

import bisect
import math

import pytest

from batchllm.core.latency_slo import LatencySlo
from batchllm.engines.endpoint.guard_policy import GuardPolicy
from batchllm.engines.endpoint.guard_targets import GuardTargets
from batchllm.engines.endpoint.latency_window import (
    OwnTimings,
    TimedValues,
    WindowLatency,
    online_latency,
    online_longest_gap_bucket,
    p99_of,
    weighted_p99,
)
from batchllm.engines.endpoint.server_history import ServerHistory
from batchllm.engines.endpoint.server_metrics import Histogram, MetricsSnapshot

TTFT_BOUNDS = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, math.inf)
ITL_BOUNDS = (0.01, 0.02, 0.03, 0.04, 0.05, 0.1, 0.2, math.inf)


class CountingServer:
    """Histograms that grow as requests are observed, online and batch ones together, as vLLM's do."""

    def __init__(self) -> None:
        self.ttft = [0.0] * len(TTFT_BOUNDS)
        self.itl = [0.0] * len(ITL_BOUNDS)
        self.running = 4.0

    def serve(self, requests: int, ttft_s: float, itl_s: float, tokens: int = 10) -> None:
        self.ttft[bisect.bisect_left(TTFT_BOUNDS, ttft_s)] += requests
        self.itl[bisect.bisect_left(ITL_BOUNDS, itl_s)] += requests * (tokens - 1)

    def snapshot(self, at_s: float) -> MetricsSnapshot:
        return MetricsSnapshot(at_s=at_s, server_kind="vllm", running=self.running, waiting=0.0, kv_usage=0.3, preemptions=0.0,
                               generation_tokens=None, ttft=Histogram.from_bucket_counts(TTFT_BOUNDS, self.ttft),
                               itl=Histogram.from_bucket_counts(ITL_BOUNDS, self.itl))


def test_own_timings_are_placed_when_the_client_saw_them():
    own = OwnTimings()
    own.add(10.0, 0.5, [1.0, 2.0, 3.0])  # reported at the end: gaps ended at 5, 7, 10; the first token came at 4
    assert own.ttfts_s(3.9, 4.0) == [0.5]
    assert own.gaps_s(4.0, 7.0) == [1.0, 2.0]
    assert own.gaps_s(7.0, 10.0) == [3.0]
    own.add(6.0, 0.2, [])  # another request's first token, reported at once
    assert own.ttfts_s(0.0, 10.0) == [0.5, 0.2]
    own.forget_before(5.0)
    assert own.ttfts_s(0.0, 10.0) == [0.2] and own.gaps_s(0.0, 10.0) == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="-0.1"):
        own.add(11.0, None, [-0.1])


def test_timed_values_keep_the_order_of_their_moments_and_a_stretch_is_open_below_and_closed_above():
    values = TimedValues()
    for at_s, value in [(3.0, 30.0), (1.0, 10.0), (2.0, 20.0), (2.0, 21.0), (5.0, 50.0)]:
        values.add(at_s, value)
    assert values.between(1.0, 3.0) == [20.0, 21.0, 30.0]  # (1, 3]; the two at 2 s in the order they came
    assert values.between(0.0, 0.5) == [] and values.between(4.0, 2.0) == []
    assert values.within([(1.5, 2.0, 1.0), (4.0, 6.0, 2.0)]) == [(20.0, 1.0), (21.0, 1.0), (50.0, 2.0)]
    values.forget_before(2.0)  # those seen at 2 s stay
    assert len(values) == 4 and values.between(-math.inf, math.inf) == [20.0, 21.0, 30.0, 50.0]


def test_own_gaps_within_stretches_are_those_seen_inside_any_of_them_with_the_stretchs_weight():
    own = OwnTimings()
    own.add(10.0, None, [1.0] * 10)  # gaps ended at 1, 2, ... 10
    found = own.gaps_within([(0.0, 2.0, 1.0), (4.0, 5.0, 3.0), (8.5, 20.0, 0.5)])
    assert found == [(1.0, 1.0), (1.0, 1.0), (1.0, 3.0), (1.0, 0.5), (1.0, 0.5)]  # at 1, 2, 5, 9 and 10
    assert own.gaps_within([(2.0, 3.0, 1.0)]) == [(1.0, 1.0)] and own.gaps_within([]) == []


def test_the_longest_online_gap_lies_in_the_bucket_of_the_longest_gap_not_the_batchs():
    """Between two scrapes the server counted gaps of 20, 30 and 60 ms, the batch's own 20 and 30 ms
    among them: the longest online gap lies in (50, 100] ms, the bucket 60 ms lies in."""
    def scraped(at_s: float, itl_counts: list[float] | None) -> MetricsSnapshot:
        itl = None if itl_counts is None else Histogram.from_bucket_counts(ITL_BOUNDS, itl_counts)
        return MetricsSnapshot(at_s=at_s, server_kind="vllm", running=2.0, waiting=0.0, kv_usage=0.3, preemptions=0.0,
                               generation_tokens=None, ttft=None, itl=itl)

    start, end = scraped(0.0, [0.0] * len(ITL_BOUNDS)), scraped(2.0, [0, 1, 1, 0, 0, 1, 0, 0])
    own = OwnTimings()
    own.add(1.5, None, [0.02, 0.03])
    assert online_longest_gap_bucket(start, end, own) == (0.05, 0.1)
    own.add(1.9, None, [0.06])  # the 60 ms gap was the batch's too: no online gap left
    assert online_longest_gap_bucket(start, end, own) is None
    assert online_longest_gap_bucket(scraped(0.0, None), end, own) is None


def test_the_longest_online_gap_of_a_step_the_batch_did_not_see_leaves_out_the_gaps_of_the_steps_it_saw():
    """An online prompt's prefill made a step of 60 ms, a gap to the batch's stream and to one online stream;
    the batch's own prefill made one of 40 ms, a gap to the online stream only. Taken out once, the batch's
    60 ms leaves the online one: in (50, 100] ms. Taken out twice (its gap and the online one of the
    same step), the 40 ms is the longest left: in (30, 40] ms."""
    def scraped(at_s: float, itl_counts: list[float]) -> MetricsSnapshot:
        return MetricsSnapshot(at_s=at_s, server_kind="vllm", running=2.0, waiting=0.0, kv_usage=0.3, preemptions=0.0,
                               generation_tokens=None, ttft=None, itl=Histogram.from_bucket_counts(ITL_BOUNDS, itl_counts))

    start, end = scraped(0.0, [0.0] * len(ITL_BOUNDS)), scraped(2.0, [0, 0, 0, 1, 0, 2, 0, 0])
    own = OwnTimings()
    own.add(1.5, None, [0.06])
    assert online_longest_gap_bucket(start, end, own) == (0.05, 0.1)
    assert online_longest_gap_bucket(start, end, own, copies=2) == (0.03, 0.04)
    with pytest.raises(ValueError, match="copies must be >= 1, got 0"):
        online_longest_gap_bucket(start, end, own, copies=0)


def test_a_weighted_p99_is_where_99_percent_of_the_weight_lies():
    assert weighted_p99([(0.02, 1.0)] * 99 + [(0.05, 1.0)]) == 0.02  # as p99_of: the 99th of 100
    assert weighted_p99([(0.02, 1.0)] * 99 + [(0.05, 2.0)]) == 0.05
    assert weighted_p99([(0.05, 0.0), (0.02, 1.0)]) == 0.02
    assert weighted_p99([]) is None and weighted_p99([(0.02, 0.0)]) is None


def test_online_latency_takes_out_only_the_own_timings_between_the_two_snapshots():
    server = CountingServer()
    start = server.snapshot(0.0)
    server.serve(1, 0.1, 0.015, tokens=2)  # online
    server.serve(1, 2.0, 0.015, tokens=2)  # the batch's, first token at 1.0
    own = OwnTimings()
    own.add(1.0, 2.0, [])
    own.add(-1.0, 2.0, [])  # an earlier request of the batch, before the window: not taken out
    latency = online_latency(start, server.snapshot(2.0), own)
    assert latency.ttft_count == 1 and latency.ttft_p99_s == pytest.approx(0.0995)
    assert p99_of([]) is None and p99_of([float(v) for v in range(1, 201)]) == 198.0


def beside(online_at_end: float, batch_at_end: int, gap_s: float = 0.045) -> WindowLatency:
    """9 s of 4 batch requests beside 4 online ones, their gaps 20 ms (450 of them), then a second
    with `online_at_end` others and `batch_at_end` batch requests where the batch saw 3 gaps of `gap_s`."""
    history, own, server = ServerHistory(GuardPolicy()), OwnTimings(), CountingServer()
    for t in range(0, 11):
        batch = batch_at_end if t == 10 else 4
        server.running = batch + (online_at_end if t == 10 else 4)
        server.serve(5, 0.1, 0.015)
        own.add(float(t), None, [gap_s] * 3 if t == 10 else [0.02] * 50)
        history.add(server.snapshot(float(t)), batch)
    found = history.evidence(10.0, -math.inf, own, 0.0)
    assert found is not None and found.online_seen
    return found.latency


def test_the_online_inter_token_p99_is_the_batchs_own_gaps_each_weighing_the_online_requests_per_batch_request():
    assert p99_of([0.02] * 450 + [0.045] * 3) == 0.02  # unweighted, the slow steps are under 1 %
    # the same number of online and batch requests throughout: as unweighted
    assert beside(online_at_end=4, batch_at_end=4).itl_p99_s == pytest.approx(0.02)
    # a burst of 40 online requests: each saw those slow steps (3 x 5.5 of 466.5)
    assert beside(online_at_end=40, batch_at_end=4).itl_p99_s == pytest.approx(0.045)
    # the batch down to 1: its one request saw those steps once for the 4 online ones (3 x 4 / 2.5 of 454.8)
    assert beside(online_at_end=4, batch_at_end=1).itl_p99_s == pytest.approx(0.045)


def test_without_enough_own_gaps_the_inter_token_p99_is_the_servers_histogram_bucket():
    history, own, server = ServerHistory(GuardPolicy()), OwnTimings(), CountingServer()
    for t in range(0, 3):
        server.serve(5, 0.1, 0.015)
        own.add(float(t), None, [0.045] * 5)  # 10 gaps in the window: under own_gaps_min, 20
        history.add(server.snapshot(float(t)), 2)
    found = history.evidence(2.0, -math.inf, own, 0.0)
    assert found is not None
    assert found.latency.itl_p99_bucket_s == (0.01, 0.02)  # every gap in (0.01, 0.02], the batch's included
    assert found.latency.itl_p99_s == pytest.approx(0.0199, abs=1e-4)


def test_the_band_of_an_slo_and_of_a_baseline():
    band = GuardTargets.from_slo(LatencySlo(ttft_p99_s=1.0, itl_p99_s=None), 0.75, 0.9)
    assert (band.ttft_grow_under_s, band.ttft_ease_over_s, band.ttft_target_s) == (0.75, 0.9, 1.0)
    assert (band.itl_grow_under_s, band.itl_ease_over_s, band.itl_target_s) == (None, None, None)
    baseline = GuardTargets.from_baseline(0.2, 0.04)  # targets 1.25x: half-way up the margin, then three quarters
    assert (baseline.ttft_grow_under_s, baseline.ttft_ease_over_s, baseline.ttft_target_s) == pytest.approx((0.225, 0.2375, 0.25))
    assert (baseline.itl_grow_under_s, baseline.itl_ease_over_s, baseline.itl_target_s) == pytest.approx((0.045, 0.0475, 0.05))
    with pytest.raises(ValueError, match="0.3, 0.2, 1.0"):
        GuardTargets(1.0, None, 0.3, None, 0.2, None)


def ttft_only(p99_s: float | None) -> WindowLatency:
    """A TTFT p99, and an inter-token one of 10 ms (under any growth bound here)."""
    return WindowLatency(ttft_p99_s=p99_s, itl_p99_s=0.01, ttft_count=10, itl_count=100, ttft_p99_bucket_s=None, itl_p99_bucket_s=None)


@pytest.mark.parametrize("p99_s, grows", [
    (0.15, True),  # under the growth bound, 0.1875
    (0.1875, False),  # on it
    (0.2, False),  # over it, whatever bucket it lies in
    (None, False),  # nothing observed: no evidence of room
])
def test_growth_needs_a_p99_known_and_under_its_growth_bound(p99_s, grows):
    band = GuardTargets.from_slo(LatencySlo(ttft_p99_s=0.25, itl_p99_s=None), 0.75, 0.9)
    assert band.lets_grow(ttft_only(p99_s)) is grows
    no_ttft_bound = GuardTargets.from_slo(LatencySlo(ttft_p99_s=None, itl_p99_s=0.04), 0.75, 0.9)
    assert no_ttft_bound.lets_grow(ttft_only(p99_s)) is True


@pytest.mark.parametrize("target_s, bucket_s, p99_s, centred_s, grows", [
    (0.294, (0.1, 0.25), 0.24, 0.175, True),  # one slow first token interpolated near the wide bucket's top, wholly under the target
    (0.24, (0.1, 0.25), 0.24, 0.175, False),  # the bucket's top over the target: not kept for sure
    (0.294, (0.1, 0.25), 0.245, 0.23, False),  # centred, still over the growth bound (0.2205)
    (0.099, (0.06, 0.08), 0.078, 0.07, False),  # a narrow bucket: the interpolated p99 judges (growth bound 0.0743)
])
def test_a_first_token_p99_in_a_wide_bucket_under_the_target_grows_on_its_centred_value(target_s, bucket_s, p99_s, centred_s, grows):
    band = GuardTargets.from_slo(LatencySlo(ttft_p99_s=target_s, itl_p99_s=None), 0.75, 0.9)
    latency = WindowLatency(ttft_p99_s=p99_s, itl_p99_s=0.01, ttft_count=8, itl_count=100, ttft_p99_bucket_s=bucket_s,
                            itl_p99_bucket_s=None, ttft_p99_centred_s=centred_s)
    assert band.lets_grow(latency) is grows


@pytest.mark.parametrize("bucket_s, p99_s, grows", [
    ((0.025, 0.05), 0.041, True),  # the whole bucket under the growth bound (0.0641)
    ((0.05, 0.075), 0.058, False),  # interpolated under it, in a bucket that holds it: no evidence the p99 is under
    ((0.05, 0.075), 0.07, False),  # over it
    ((0.041, 0.063), 0.063, True),  # the batch's own gaps, known by bounds: the upper one under it
    ((0.041, 0.066), 0.066, False),  # the upper one over it
    (None, 0.058, True),  # exact values
])
def test_an_inter_token_p99_grows_the_batch_only_when_all_that_is_known_of_it_is_under_the_growth_bound(bucket_s, p99_s, grows):
    """A p99 interpolated under the growth bound in a histogram bucket that holds the bound is no evidence it is
    under it; of the batch's own gaps, the upper bound (at the most their noise allows) judges."""
    band = GuardTargets.from_slo(LatencySlo(ttft_p99_s=None, itl_p99_s=0.0855), 0.75, 0.9)
    latency = WindowLatency(ttft_p99_s=None, itl_p99_s=p99_s, ttft_count=0, itl_count=900, ttft_p99_bucket_s=None,
                            itl_p99_bucket_s=bucket_s)
    assert band.lets_grow(latency) is grows
