"""The latency guard on scripted timelines: a fake server whose cumulative histograms grow as
online and batch requests are observed, snapshots every second, and a batch that fills what it
is allowed."""

from __future__ import annotations

import bisect
import math

import pytest

from batchllm.core.latency_slo import LatencySlo
from batchllm.engines.endpoint.guard_targets import GuardTargets
from batchllm.engines.endpoint.latency_guard import GuardReading, LatencyGuard
from batchllm.engines.endpoint.latency_window import OwnTimings, WindowLatency, online_latency, p99_of, weighted_p99
from batchllm.engines.endpoint.server_metrics import Histogram, MetricsSnapshot

TTFT_BOUNDS = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, math.inf)
ITL_BOUNDS = (0.01, 0.02, 0.03, 0.04, 0.05, 0.1, 0.2, math.inf)
SLO = LatencySlo(ttft_p99_s=0.25, itl_p99_s=0.04)


class FakeServer:
    """Counts observations like vLLM does: online and batch requests in the same histograms."""

    def __init__(self) -> None:
        self.ttft = [0.0] * len(TTFT_BOUNDS)
        self.itl = [0.0] * len(ITL_BOUNDS)
        self.preemptions = 0.0
        self.running, self.waiting, self.kv_usage = 4.0, 0.0, 0.3

    def serve(self, requests: int, ttft_s: float, itl_s: float, tokens: int = 10) -> None:
        self.ttft[bisect.bisect_left(TTFT_BOUNDS, ttft_s)] += requests
        self.itl[bisect.bisect_left(ITL_BOUNDS, itl_s)] += requests * (tokens - 1)

    def snapshot(self, at_s: float) -> MetricsSnapshot:
        return MetricsSnapshot(at_s=at_s, server_kind="vllm", running=self.running, waiting=self.waiting, kv_usage=self.kv_usage,
                               preemptions=self.preemptions, generation_tokens=None,
                               ttft=Histogram.from_bucket_counts(TTFT_BOUNDS, self.ttft),
                               itl=Histogram.from_bucket_counts(ITL_BOUNDS, self.itl))


class Batch:
    """The batch: fills what the guard allows, its requests served by the fake server too."""

    def __init__(self, guard: LatencyGuard, server: FakeServer | None) -> None:
        self.guard, self.server, self.in_flight = guard, server, 0

    def fill(self, now_s: float) -> int:
        allowed = self.guard.allowed(now_s, self.in_flight)
        self.in_flight = max(self.in_flight, allowed)
        return self.guard.allowed(now_s, self.in_flight)

    def finish(self, now_s: float, requests: int, ttft_s: float, gap_s: float, tokens: int = 10, *, report: bool = True) -> None:
        for _ in range(requests):
            if self.server is not None:
                self.server.serve(1, ttft_s, gap_s, tokens)
            if report:
                self.guard.observe_own(now_s, ttft_s, [gap_s] * (tokens - 1))
        self.in_flight -= requests


def tick(guard: LatencyGuard, server: FakeServer, batch: Batch, t: float, *, online_ttft_s: float = 0.1,
         online_itl_s: float = 0.015, online: int = 5, own_ttft_s: float | None = None, own_gap_s: float = 0.015) -> int:
    """One second: online requests served, the batch's finished ones replaced, a snapshot."""
    if online:
        server.serve(online, online_ttft_s, online_itl_s)
    if own_ttft_s is not None and batch.in_flight:
        finished = batch.in_flight
        batch.finish(t, finished, own_ttft_s, own_gap_s)
    guard.observe_server(server.snapshot(t))
    return batch.fill(t)


def guarded(slo: LatencySlo | None = SLO, max_in_flight: int = 64, **options) -> tuple[LatencyGuard, FakeServer, Batch]:
    """A guard that grows by one from the start, at every snapshot (the slow start and the pace of
    growth have tests of their own)."""
    guard = LatencyGuard(slo, max_in_flight, **{"slow_start": False, "grow_every_s": 0.0, **options})
    server = FakeServer()
    return guard, server, Batch(guard, server)


def test_without_an_slo_it_measures_a_baseline_with_nothing_in_flight_then_guards():
    guard, server, batch = guarded(slo=None)
    allowed = [tick(guard, server, batch, float(t)) for t in range(0, 8)]
    assert allowed == [0] * 8
    reading = guard.reading(7.5)
    assert (reading.phase, reading.basis, reading.ttft_target_s) == ("measuring baseline", "server metrics", None)
    assert tick(guard, server, batch, 8.0) == 1  # 8 s after the first snapshot
    reading = guard.reading(8.0)
    assert reading.phase == "guarding"
    # every online TTFT in (0.05, 0.1], every gap in (0.01, 0.02]: p99 0.05 + 0.05 x 0.99, 0.01 + 0.01 x 0.99
    assert reading.ttft_target_s == pytest.approx(1.25 * 0.0995)
    assert reading.itl_target_s == pytest.approx(1.25 * 0.0199)
    # the same online latency with the batch beside it: at the baseline, 0.8 x target, under its growth bound
    # (0.9 x target, half-way up the margin), so the batch grows one a snapshot
    assert [tick(guard, server, batch, float(t)) for t in range(9, 13)] == [2, 3, 4, 5]


def test_an_slo_is_used_from_the_first_snapshot_without_a_baseline():
    guard, server, batch = guarded()
    assert tick(guard, server, batch, 0.0) == 1
    reading = guard.reading(0.0)
    assert (reading.phase, reading.ttft_target_s, reading.itl_target_s) == ("guarding", 0.25, 0.04)
    assert tick(guard, server, batch, 1.0) == 2


def test_growth_is_one_a_snapshot_then_ten_percent_and_stops_at_max_in_flight():
    guard, server, batch = guarded(max_in_flight=25)
    allowed = [tick(guard, server, batch, float(t)) for t in range(0, 24)]
    assert allowed[:20] == list(range(1, 21))
    assert allowed[20:] == [22, 24, 25, 25]


def test_inside_the_band_it_holds():
    guard, server, batch = guarded()
    assert [tick(guard, server, batch, float(t)) for t in range(0, 4)] == [1, 2, 3, 4]
    # the batch's own gaps beside 5 online requests (exact values, 4 x 29 a second): 0.032 s, over
    # 0.75 x the 0.04 s target and under 0.9 x it
    held = []
    for t in range(4, 9):
        server.running = batch.in_flight + 5
        server.serve(5, 0.1, 0.015)
        batch.finish(float(t), batch.in_flight, 0.1, 0.032, tokens=30)
        guard.observe_server(server.snapshot(float(t)))
        held.append(batch.fill(float(t)))
    assert held == [4, 4, 4, 4, 4]
    reading = guard.reading(8.0)
    assert reading.online_itl_p99_s == pytest.approx(0.032)


def test_a_p99_known_only_to_lie_in_a_bucket_under_the_ease_bound_grows():
    guard, server, batch = guarded()
    assert [tick(guard, server, batch, float(t)) for t in range(0, 3)] == [1, 2, 3]
    # online TTFTs in (0.1, 0.2]: interpolated, a p99 of about 0.2 s, over 0.75 x the 0.25 s target;
    # but the bucket holds that growth bound and lies under the ease bound (0.9 x 0.25 s)
    assert [tick(guard, server, batch, float(t), online_ttft_s=0.19) for t in range(3, 8)] == [4, 5, 6, 7, 8]
    assert guard.reading(7.0).online_ttft_p99_s > 0.75 * 0.25
    # in (0.2, 0.3], a bucket over the ease bound: the interpolated p99 (0.3 s) is over the target: a cut
    assert tick(guard, server, batch, 8.0, online_ttft_s=0.21) == 4


def test_under_three_quarters_of_a_target_it_grows():
    guard, server, batch = guarded()
    # online gaps in (0.02, 0.03]: a p99 of about 0.03 s, under 0.75 x the 0.04 s target
    assert [tick(guard, server, batch, float(t), online_itl_s=0.025) for t in range(0, 4)] == [1, 2, 3, 4]
    assert 0.02 < guard.reading(3.0).online_itl_p99_s < 0.75 * 0.04


def test_at_max_in_flight_a_level_is_still_judged_on_all_it_showed():
    guard, server, batch = guarded(max_in_flight=3, grow_every_s=2.0)
    assert [tick(guard, server, batch, float(t)) for t in range(0, 9)] == [1, 1, 2, 2, 3, 3, 3, 3, 3]
    # at the cap since 4: one excess at 9 eases off, whatever the growth the cap refused at 6 and 8
    assert tick(guard, server, batch, 9.0, online_itl_s=0.035) == 2


def test_after_easing_off_it_grows_by_one_not_by_doubling():
    guard, server, batch = guarded(slow_start=True, grow_every_s=2.0)
    assert [tick(guard, server, batch, float(t)) for t in range(0, 7)] == [1, 1, 2, 2, 4, 4, 8]
    assert [tick(guard, server, batch, float(t), online_itl_s=0.035) for t in range(7, 9)] == [8, 7]
    # the excess leaves the level's stretch: the next growth is one, not a double to 14
    assert [tick(guard, server, batch, float(t)) for t in range(9, 13)] == [7, 8, 8, 9]


def test_over_the_band_and_under_the_target_it_eases_off_by_one_down_to_one():
    guard, server, batch = guarded()
    assert [tick(guard, server, batch, float(t)) for t in range(0, 3)] == [1, 2, 3]
    # online gaps in (0.03, 0.04]: a p99 of about 0.04 s, over 0.9 x the 0.04 s target and not over it
    assert [tick(guard, server, batch, float(t), online_itl_s=0.035) for t in range(3, 7)] == [2, 1, 1, 1]
    assert 0.9 * 0.04 < guard.reading(6.0).online_itl_p99_s <= 0.04
    # it grows again once the last excess (at 6) is out of the 10 s window
    assert [tick(guard, server, batch, float(t)) for t in range(7, 18)] == [1] * 9 + [2, 3]


def test_one_excess_eases_off_once_as_the_new_level_is_judged_on_itself():
    guard, server, batch = guarded(grow_every_s=2.0)
    assert [tick(guard, server, batch, float(t)) for t in range(0, 7)] == [1, 1, 2, 2, 3, 3, 4]
    assert tick(guard, server, batch, 7.0) == 4
    assert tick(guard, server, batch, 8.0, online_itl_s=0.035) == 3
    # the window of the last 10 s still holds the excess; the level of 3 does not show it
    assert [tick(guard, server, batch, float(t)) for t in range(9, 14)] == [3, 4, 4, 5, 5]


def test_a_slow_start_doubles_until_the_first_cut_then_grows_by_one():
    guard, server, batch = guarded(slow_start=True)
    assert [tick(guard, server, batch, float(t)) for t in range(0, 5)] == [1, 2, 4, 8, 16]
    assert tick(guard, server, batch, 5.0, online_ttft_s=0.4) == 8  # over the 0.25 s target: halved
    batch.finish(6.0, batch.in_flight - 8, 0.1, 0.015)
    later = [tick(guard, server, batch, float(t)) for t in range(7, 21)]
    assert later == [8, 8, *range(9, 21)]  # after the cut (and its hold): one at a time


def test_growth_waits_grow_every_s_so_the_window_shows_the_new_level_first():
    guard, server, batch = guarded(grow_every_s=2.0)
    # a level is judged on 2 s of its own: the first growth too
    assert [tick(guard, server, batch, float(t)) for t in range(0, 7)] == [1, 1, 2, 2, 3, 3, 4]
    # the level grown to at 6 is too much: seen at 7, cut at once (cuts do not wait)
    assert tick(guard, server, batch, 7.0, online_ttft_s=0.4) == 2


def test_by_default_growth_is_paced_and_starts_slow():
    guard = LatencyGuard(SLO, 64)
    server = FakeServer()
    batch = Batch(guard, server)
    assert [tick(guard, server, batch, float(t)) for t in range(0, 9)] == [1, 1, 2, 2, 4, 4, 8, 8, 16]


def test_no_growth_while_the_batch_does_not_use_what_it_is_allowed():
    guard, server, batch = guarded()
    for t in range(0, 4):
        tick(guard, server, batch, float(t))
    assert guard.allowed(3.0, batch.in_flight) == 4
    batch.in_flight = 2  # the input ran short at 3.5: 2 of 4 in flight from now on
    assert guard.allowed(3.5, batch.in_flight) == 4
    allowed = []
    for t in range(4, 8):
        server.serve(5, 0.1, 0.015)
        guard.observe_server(server.snapshot(float(t)))
        allowed.append(guard.allowed(float(t), batch.in_flight))
    assert allowed == [5, 5, 5, 5]  # 4 were in flight between 3 and 3.5: once more, then no more growth


def test_online_p99_over_target_cuts_by_half_then_waits_for_the_cut_to_take_effect():
    guard, server, batch = guarded()
    for t in range(0, 8):
        tick(guard, server, batch, float(t))
    assert batch.in_flight == 8
    assert tick(guard, server, batch, 8.0, online_ttft_s=0.4) == 4  # 5 of 45 online TTFTs in (0.3, 0.5]: p99 ~0.48 > 0.25
    assert guard.reading(8.0).online_ttft_p99_s > 0.25
    # the 8 in flight do not finish at once: no decision until they came down to 4, however slow it still is
    for t in range(9, 12):
        server.serve(5, 0.4, 0.015)
        guard.observe_server(server.snapshot(float(t)))
        assert guard.allowed(float(t), batch.in_flight) == 4
    batch.finish(11.5, 4, 0.1, 0.015)
    assert guard.allowed(11.5, batch.in_flight) == 4  # in effect now; the window starts here, hold_s 2 s
    tick(guard, server, batch, 12.0)  # online fine again, but within the hold
    assert guard.allowed(12.0, batch.in_flight) == 4
    assert tick(guard, server, batch, 13.0) == 4  # 13 >= 11.5 + 2, but the window's first snapshot is 12: one snapshot only
    assert tick(guard, server, batch, 14.0) == 5  # 12..14: online under target since the cut took effect


def test_when_the_batchs_requests_do_not_come_down_it_decides_again_after_a_window():
    guard, server, batch = guarded()
    for t in range(0, 8):
        tick(guard, server, batch, float(t))
    assert tick(guard, server, batch, 8.0, online_ttft_s=0.4) == 4
    allowed = {}
    for t in range(9, 22):  # long requests: the 8 stay in flight; online stays slow
        server.serve(5, 0.4, 0.015)
        guard.observe_server(server.snapshot(float(t)))
        allowed[t] = guard.allowed(float(t), batch.in_flight)
    assert allowed[17] == 4  # still waiting for the cut to take effect
    assert allowed[18] == 4  # taken as in effect at 18 (8 + window_s); then hold_s, then a window from 18 on
    assert allowed[20] == 2


def test_the_batchs_own_long_ttfts_are_taken_out_so_it_does_not_starve_itself():
    # the batch's prompts are long (own TTFT 2 s), the online ones short: vLLM's histograms mix them
    counted, blind = guarded(), guarded()
    allowed: dict[str, list[int]] = {"counted": [], "blind": []}
    for t in range(0, 12):
        for name, (guard, server, batch) in (("counted", counted), ("blind", blind)):
            server.serve(5, 0.1, 0.015)
            if batch.in_flight:
                batch.finish(float(t), batch.in_flight, 2.0, 0.015, report=name == "counted")
            guard.observe_server(server.snapshot(float(t)))
            allowed[name].append(batch.fill(float(t)))
    assert allowed["counted"] == list(range(1, 13))  # grew every second
    assert counted[0].reading(11.0).online_ttft_p99_s == pytest.approx(0.0995)
    # the same server seen without the batch's own timings: its 2 s TTFTs look like online ones over target
    assert allowed["blind"] == [1] + [0] * 10 + [1]  # cut to 0 at its first request, a probe after 10 s


def own_gaps_beside(server: FakeServer, others: float, gap_s: float, seconds: range) -> LatencyGuard:
    """A guard whose batch runs 2 requests that report 20 gaps of `gap_s` each second (under a second
    of them); the server runs `others` requests besides and counts 5 online requests a second, their
    gaps 15 ms."""
    guard = LatencyGuard(SLO, 64, slow_start=False, grow_every_s=0.0)
    for t in seconds:
        guard.allowed(float(t), 2)
        server.running = 2 + others
        server.serve(5, 0.1, 0.015)
        guard.observe_own(float(t), None, [gap_s] * 20)
        guard.observe_server(server.snapshot(float(t)))
    return guard


def test_the_inter_token_p99_is_the_batchs_own_gaps_while_online_requests_run():
    # the histogram's buckets put the online gaps at <= 20 ms; the batch, decoding in the same steps, saw 45 ms
    guard = own_gaps_beside(FakeServer(), others=3, gap_s=0.045, seconds=range(0, 6))
    assert guard.reading(5.0).online_itl_p99_s == pytest.approx(0.045)
    # each scrape is judged by the batch's requests then: 5 in flight now would hide the 3 others seen at 2
    guard.allowed(5.5, 5)
    assert guard.reading(5.5).online_itl_p99_s == pytest.approx(0.045)
    # the server ran only the batch's requests at every scrape: its gaps say nothing of the online ones
    reading = own_gaps_beside(FakeServer(), others=0, gap_s=0.045, seconds=range(0, 6)).reading(5.0)
    assert reading.online_itl_p99_s == pytest.approx(0.0199, abs=1e-4)  # the histogram's, over all requests
    # too few own gaps for a p99 (OWN_GAPS_MIN, 100; 20 between two scrapes): the histogram's
    reading = own_gaps_beside(FakeServer(), others=3, gap_s=0.045, seconds=range(0, 2)).reading(1.0)
    assert reading.online_itl_p99_s == pytest.approx(0.0199, abs=1e-4)


def test_a_preemption_cuts():
    guard, server, batch = guarded()
    for t in range(0, 6):
        tick(guard, server, batch, float(t))
    assert batch.in_flight == 6
    server.preemptions += 1
    assert tick(guard, server, batch, 6.0) == 3


def test_kv_cache_nearly_full_cuts_and_between_the_thresholds_holds():
    guard, server, batch = guarded()
    for t in range(0, 6):
        tick(guard, server, batch, float(t))
    server.kv_usage = 0.92  # over kv_usage_grow, not over kv_usage_cut
    assert tick(guard, server, batch, 6.0) == 6
    server.kv_usage = 0.97
    assert tick(guard, server, batch, 7.0) == 3


def test_a_queue_in_two_snapshots_cuts_and_growth_then_keeps_headroom_below_that_capacity():
    guard, server, batch = guarded()
    server.running = 10
    for t in range(0, 6):
        tick(guard, server, batch, float(t))
    server.waiting = 2  # one snapshot with a queue: hold
    assert tick(guard, server, batch, 6.0) == 6
    server.running = 20
    assert tick(guard, server, batch, 7.0) == 3  # a queue in two snapshots in a row: full at 20 running
    server.waiting, server.running = 0, 14
    batch.finish(7.0, 3, 0.1, 0.015)
    allowed = [tick(guard, server, batch, float(t)) for t in range(8, 15)]
    assert allowed[:3] == [3, 3, 4]  # the hold after the cut, then growth
    assert allowed == [3, 3, 4, 5, 6, 7, 8]
    server.running = 18  # capacity 20 minus 10 % headroom (2): one more would run 19 > 18
    assert tick(guard, server, batch, 15.0) == 8
    server.running = 17
    assert tick(guard, server, batch, 16.0) == 9


def test_at_zero_it_probes_with_one_after_a_quiet_window():
    guard, server, batch = guarded()
    tick(guard, server, batch, 0.0)
    assert tick(guard, server, batch, 1.0, online_ttft_s=0.8) == 0  # 1 -> 0
    batch.finish(1.5, batch.in_flight, 0.1, 0.015)
    assert guard.allowed(1.5, 0) == 0  # in effect at 1.5
    heavy = [tick(guard, server, batch, float(t), online_ttft_s=0.8) for t in range(2, 14)]
    assert heavy == [0] * 12  # a heavy online phase: no batch at all
    quiet = {t: tick(guard, server, batch, float(t)) for t in range(14, 40)}
    assert quiet[14] == 0
    probe = min(t for t, allowed in quiet.items() if allowed == 1)
    assert probe == 23  # the window (13, 23] holds no slow online request any more
    assert quiet[24] == 2 and quiet[25] == 3  # then it grows like before


def test_with_no_online_request_in_the_baseline_it_measures_the_server_at_concurrency_1():
    guard, server, batch = guarded(slo=None)
    for t in range(0, 9):
        assert tick(guard, server, batch, float(t), online=0) == (0 if t < 8 else 1)
    assert guard.reading(8.0).phase == "measuring baseline"
    for t in range(9, 13):  # one batch request a second: 4 first tokens, not yet 5
        assert tick(guard, server, batch, float(t), online=0, own_ttft_s=0.15, own_gap_s=0.025) == 1
    tick(guard, server, batch, 13.0, online=0, own_ttft_s=0.15, own_gap_s=0.025)
    reading = guard.reading(13.0)
    assert reading.phase == "guarding"
    assert reading.ttft_target_s == pytest.approx(1.25 * (0.1 + 0.1 * 0.99))  # all in (0.1, 0.2]
    assert reading.itl_target_s == pytest.approx(1.25 * (0.02 + 0.01 * 0.99))  # all in (0.02, 0.03]


def test_a_batch_alone_on_the_server_grows_whatever_its_own_latency():
    guard, server, batch = guarded()
    for t in range(0, 5):
        tick(guard, server, batch, float(t), online=0, own_ttft_s=0.1, own_gap_s=0.015)
    assert batch.in_flight == 5
    # the batch's own tokens now take 45 ms (over the 40 ms target): nobody online sees it, so it keeps growing
    assert tick(guard, server, batch, 5.0, online=0, own_ttft_s=0.1, own_gap_s=0.045) == 6
    assert guard.reading(5.0).online_itl_p99_s is None
    # online requests come, and see it: the guard cuts
    assert tick(guard, server, batch, 6.0, online=2, online_ttft_s=0.1, online_itl_s=0.045,
                own_ttft_s=0.1, own_gap_s=0.045) == 3


def test_without_metrics_it_works_from_its_own_requests():
    guard = LatencyGuard(None, 64, slow_start=False, grow_every_s=0.0)
    batch = Batch(guard, server=None)
    assert batch.fill(0.0) == 1
    assert (guard.reading(0.0).basis, guard.reading(0.0).phase) == ("own requests", "measuring baseline")
    for t in range(1, 5):
        batch.finish(float(t), 1, 0.2, 0.03)
        assert batch.fill(float(t)) == 1
    batch.finish(5.0, 1, 0.2, 0.03)  # the 5th: own p99s 0.2 s and 30 ms at concurrency 1
    assert batch.fill(5.0) == 1
    reading = guard.reading(5.0)
    assert (reading.phase, reading.ttft_target_s, reading.itl_target_s) == ("guarding", pytest.approx(0.25), pytest.approx(0.0375))
    allowed = []
    for t in range(6, 10):  # faster than the baseline (0.15 s, 20 ms): grows once a second
        batch.finish(float(t), batch.in_flight, 0.15, 0.02)
        allowed.append(batch.fill(float(t)))
    assert allowed == [2, 3, 4, 5]
    batch.finish(10.0, batch.in_flight, 0.4, 0.02)  # the batch's own TTFT over 0.25
    assert guard.allowed(10.0, batch.in_flight) == 2
    assert guard.reading(10.0).describe() == "in flight <= 2; own p99 TTFT 0.40 s (target 0.25), inter-token 30 ms (target 38)"


def test_when_the_metrics_stop_it_falls_back_to_its_own_requests():
    guard, server, batch = guarded()
    for t in range(0, 4):
        tick(guard, server, batch, float(t))
    assert guard.reading(4.0).basis == "server metrics"
    assert guard.reading(14.5).basis == "own requests"  # the newest snapshot is more than window_s old
    batch.finish(14.5, batch.in_flight, 0.6, 0.02)
    assert guard.allowed(14.5, batch.in_flight) == 2


def test_describe():
    reading = GuardReading(allowed=12, online_ttft_p99_s=0.2104, online_itl_p99_s=0.0312, ttft_target_s=0.25, itl_target_s=0.04,
                           basis="server metrics", phase="guarding")
    assert reading.describe() == "in flight <= 12; online p99 TTFT 0.21 s (target 0.25), inter-token 31 ms (target 40)"
    guard, server, batch = guarded(slo=None)
    tick(guard, server, batch, 0.0)
    tick(guard, server, batch, 1.0)
    assert guard.reading(1.0).describe() == "measuring baseline; in flight <= 0; online p99 TTFT 0.10 s, inter-token 20 ms"
    partial = LatencyGuard(LatencySlo(itl_p99_s=0.05), 4)
    assert partial.reading(0.0).describe() == "in flight <= 1; own p99 TTFT unknown (no target), inter-token unknown (target 50)"


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


def test_own_gaps_within_stretches_are_those_seen_inside_any_of_them_with_the_stretchs_weight():
    own = OwnTimings()
    own.add(10.0, None, [1.0] * 10)  # gaps ended at 1, 2, ... 10
    found = own.gaps_within([(0.0, 2.0, 1.0), (4.0, 5.0, 3.0), (8.5, 20.0, 0.5)])
    assert found == [(1.0, 1.0), (1.0, 1.0), (1.0, 3.0), (1.0, 0.5), (1.0, 0.5)]  # at 1, 2, 5, 9 and 10
    assert own.gaps_within([(2.0, 3.0, 1.0)]) == [(1.0, 1.0)] and own.gaps_within([]) == []


def test_a_weighted_p99_is_where_99_percent_of_the_weight_lies():
    assert weighted_p99([(0.02, 1.0)] * 99 + [(0.05, 1.0)]) == 0.02  # as p99_of: the 99th of 100
    assert weighted_p99([(0.02, 1.0)] * 99 + [(0.05, 2.0)]) == 0.05
    assert weighted_p99([(0.05, 0.0), (0.02, 1.0)]) == 0.02
    assert weighted_p99([]) is None and weighted_p99([(0.02, 0.0)]) is None


def weighted_guard(online_at_end: int, batch_at_end: int) -> LatencyGuard:
    """9 s of 4 batch requests beside 4 online ones, their gaps 20 ms (450 of them), then a second
    with `online_at_end` and `batch_at_end` where the batch saw 3 gaps of 45 ms."""
    guard = LatencyGuard(SLO, 64, slow_start=False, grow_every_s=0.0)
    server = FakeServer()
    for t in range(0, 11):
        batch = batch_at_end if t == 10 else 4
        guard.allowed(float(t), batch)
        server.running = batch + (online_at_end if t == 10 else 4)
        server.serve(5, 0.1, 0.015)
        guard.observe_own(float(t), None, [0.045] * 3 if t == 10 else [0.02] * 50)
        guard.observe_server(server.snapshot(float(t)))
    return guard


def test_the_batchs_own_gaps_weigh_the_online_requests_per_batch_request_beside_them():
    assert p99_of([0.02] * 450 + [0.045] * 3) == 0.02  # unweighted, the slow steps are under 1 %
    # the same number of online and batch requests throughout: as unweighted
    assert weighted_guard(online_at_end=4, batch_at_end=4).reading(10.0).online_itl_p99_s == pytest.approx(0.02)
    # a burst of 40 online requests: each saw those slow steps (3 x 5.5 of 466.5)
    assert weighted_guard(online_at_end=40, batch_at_end=4).reading(10.0).online_itl_p99_s == pytest.approx(0.045)
    # the batch down to 1: its one request saw those steps once for the 4 online ones (3 x 4 / 2.5 of 454.8)
    assert weighted_guard(online_at_end=4, batch_at_end=1).reading(10.0).online_itl_p99_s == pytest.approx(0.045)


def test_online_latency_takes_out_only_the_own_timings_between_the_two_snapshots():
    server = FakeServer()
    start = server.snapshot(0.0)
    server.serve(1, 0.1, 0.015, tokens=2)  # online
    server.serve(1, 2.0, 0.015, tokens=2)  # the batch's, first token at 1.0
    own = OwnTimings()
    own.add(1.0, 2.0, [])
    own.add(-1.0, 2.0, [])  # an earlier request of the batch, before the window: not taken out
    latency = online_latency(start, server.snapshot(2.0), own)
    assert latency.ttft_count == 1 and latency.ttft_p99_s == pytest.approx(0.0995)
    assert p99_of([]) is None and p99_of([float(v) for v in range(1, 201)]) == 198.0


@pytest.mark.parametrize("options, quoted", [
    ({"max_in_flight": 0}, "0"),
    ({"max_in_flight": 4, "window_s": -1.0}, "-1.0"),
    ({"max_in_flight": 4, "cut_factor": 1.5}, "1.5"),
    ({"max_in_flight": 4, "grow_below": 0.95}, "0.95"),  # over the ease bound, 0.9
    ({"max_in_flight": 4, "grow_every_s": 12.0}, "12.0"),  # over the window: no level would ever be judged
])
def test_bad_settings_are_refused_with_their_value(options, quoted):
    with pytest.raises(ValueError, match=quoted):
        LatencyGuard(SLO, **options)


def test_the_band_of_an_slo_and_of_a_baseline():
    band = GuardTargets.from_slo(LatencySlo(ttft_p99_s=1.0, itl_p99_s=None), 0.75, 0.9)
    assert (band.ttft_grow_under_s, band.ttft_ease_over_s, band.ttft_target_s) == (0.75, 0.9, 1.0)
    assert (band.itl_grow_under_s, band.itl_ease_over_s, band.itl_target_s) == (None, None, None)
    baseline = GuardTargets.from_baseline(0.2, 0.04)  # targets 1.25x: half-way up the margin, then three quarters
    assert (baseline.ttft_grow_under_s, baseline.ttft_ease_over_s, baseline.ttft_target_s) == pytest.approx((0.225, 0.2375, 0.25))
    assert (baseline.itl_grow_under_s, baseline.itl_ease_over_s, baseline.itl_target_s) == pytest.approx((0.045, 0.0475, 0.05))
    with pytest.raises(ValueError, match="0.3, 0.2, 1.0"):
        GuardTargets(1.0, None, 0.3, None, 0.2, None)


def ttft_only(p99_s: float | None, bucket_s: tuple[float, float] | None) -> WindowLatency:
    return WindowLatency(ttft_p99_s=p99_s, itl_p99_s=None, ttft_count=10, itl_count=0, ttft_p99_bucket_s=bucket_s, itl_p99_bucket_s=None)


@pytest.mark.parametrize("p99_s, bucket_s, grows", [
    (0.15, (0.1, 0.2), True),  # under the growth bound, 0.1875
    (0.1875, (0.1875, 0.1875), False),  # exact, on the growth bound
    (0.2, (0.1, 0.2), True),  # over it, but its bucket is all under the ease bound, 0.225
    (0.2, (0.1, 0.3), False),  # its bucket reaches past the ease bound
    (0.199, (0.1875, 0.2), False),  # its bucket starts at the growth bound: over it for sure
    (0.3, (0.3, math.inf), False),  # the last bucket
    (None, None, True),  # nothing observed
])
def test_growth_on_a_p99_known_exactly_or_only_as_its_bucket(p99_s, bucket_s, grows):
    band = GuardTargets.from_slo(LatencySlo(ttft_p99_s=0.25, itl_p99_s=None), 0.75, 0.9)
    assert band.lets_grow(ttft_only(p99_s, bucket_s)) is grows
    no_ttft_bound = GuardTargets.from_slo(LatencySlo(ttft_p99_s=None, itl_p99_s=0.04), 0.75, 0.9)
    assert no_ttft_bound.lets_grow(ttft_only(p99_s, bucket_s)) is True


def test_snapshots_out_of_order_and_negative_in_flight_are_refused():
    guard, server, _ = guarded()
    guard.observe_server(server.snapshot(5.0))
    with pytest.raises(ValueError, match="4.0"):
        guard.observe_server(server.snapshot(4.0))
    with pytest.raises(ValueError, match="-1"):
        guard.allowed(5.0, -1)
