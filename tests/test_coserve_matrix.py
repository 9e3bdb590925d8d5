"""benchmarks/coserve.py's scenario matrix: its pure parts (phases, arrivals, sizing rules, the last lines), no server."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time

import httpx
import pytest

from benchmarks.coserve import (
    BURSTS,
    LONG_ANSWER,
    SATURATING,
    SATURATION_START_CLIENTS,
    STEADY,
    THREE_PHASES,
    ClosedLoop,
    Idle,
    Judge,
    Load,
    OnlineResult,
    Phase,
    ScenarioResult,
    Server,
    SideRun,
    burst_phases,
    by_server,
    closed_loop_client,
    final_line,
    heaviest,
    idle_of,
    long_answer_s,
    long_answer_tokens,
    make_arrivals,
    make_scenarios,
    median_or_none,
    phase_kind,
    pick_scenarios,
    reference_of,
    saturating_rate,
    scenario_phases,
    scenario_seconds,
    targets_line,
    tuning_flags,
    worst_window,
)

TUNED = Server("tuned", 128, 256)
A, B, C, D, E = make_scenarios(TUNED)


def test_the_matrix() -> None:
    assert [(s.key, s.name, s.server.name, s.unit, s.shape, s.loads, s.reference, s.oracle) for s in (A, B, C, D, E)] == [
        ("a", "light-heavy-light", "tuned", "1 / the idle request time", THREE_PHASES, (0.8, 2.4), "heavy", True),
        ("b", "saturated", "tuned", SATURATING, STEADY, (1.0,), "steady", False),
        ("c", "long-answers", "tuned", LONG_ANSWER, STEADY, (3.0,), "steady", False),
        ("d", "bursts", "tuned", "1 / the idle request time", BURSTS, (0.8,), "burst", False),
        ("e", "untuned", "untuned", "1 / the idle request time", THREE_PHASES, (0.8, 2.4), "heavy", True)]
    assert E.server == Server("untuned") and E.server.seqs == 128


def test_server_flags() -> None:
    assert tuning_flags(128, 256) == ["--max-num-seqs", "128", "--max-num-batched-tokens", "256"]
    assert tuning_flags(None, None) == []
    assert tuning_flags(4, None) == ["--max-num-seqs", "4"]
    assert TUNED.describe() == "tuned server (--max-num-seqs 128 --max-num-batched-tokens 256)"
    assert Server("untuned").describe() == "untuned server (no tuning flags)"


def test_pick_and_group_by_server() -> None:
    catalogue = make_scenarios(TUNED)
    assert pick_scenarios("e,a,bursts", catalogue) == [A, D, E]  # the matrix's order
    with pytest.raises(ValueError, match="unknown scenarios: f"):
        pick_scenarios("a,f", catalogue)
    with pytest.raises(ValueError):
        pick_scenarios(",", catalogue)
    assert by_server([A, B, E, D]) == [(TUNED, [A, B, D]), (Server("untuned"), [E])]  # one start per server


def test_burst_phases() -> None:
    assert burst_phases(3, 30.0, 0.5) == [
        Phase("light1", 0.5, 0.0, 12.5), Phase("burst1", 5.0, 12.5, 17.5), Phase("light2", 0.5, 17.5, 42.5),
        Phase("burst2", 5.0, 42.5, 47.5), Phase("light3", 0.5, 47.5, 72.5), Phase("burst3", 5.0, 72.5, 77.5),
        Phase("light4", 0.5, 77.5, 90.0)]
    assert [phase_kind(p.name) for p in burst_phases(2, 10.0, 1.0)] == ["light", "burst", "light", "burst", "light"]


def test_scenario_phases() -> None:
    assert scenario_phases(A, 1.25, 60.0, 30.0) == [Phase("light", 1.0, 0.0, 60.0), Phase("heavy", 3.0, 60.0, 120.0),
                                                   Phase("light2", 1.0, 120.0, 180.0)]
    assert scenario_phases(B, 12.0, 60.0, 30.0) == [Phase("ramp", 12.0, 0.0, 30.0), Phase("steady", 12.0, 30.0, 90.0)]
    assert scenario_phases(C, 0.0625, 60.0, 10.0) == [Phase("ramp", 0.1875, 0.0, 10.0), Phase("steady", 0.1875, 10.0, 30.0)]
    assert scenario_phases(D, 1.25, 60.0, 30.0) == burst_phases(3, 30.0, 1.0)


def test_burst_arrivals() -> None:
    phases = burst_phases(200, 30.0, 1.0)
    arrivals = make_arrivals(phases, ["p", "q"], seed=3)
    assert arrivals == make_arrivals(phases, ["p", "q"], seed=3)  # the same for every side
    times = [a.at_s for a in arrivals]
    assert times == sorted(times) and 0.0 < times[0] and times[-1] < 6000.0
    assert {a.prompt for a in arrivals} == {"p", "q"} and all(32 <= a.max_tokens <= 64 and not a.ignore_eos for a in arrivals)
    in_bursts = sum(1 for t in times if any(p.start_s <= t < p.end_s for p in phases if p.name.startswith("burst")))
    per_s_burst, per_s_light = in_bursts / (200 * 5.0), (len(times) - in_bursts) / (200 * 25.0)
    assert per_s_burst == pytest.approx(10.0, rel=0.1) and per_s_light == pytest.approx(1.0, rel=0.1)


def test_long_answer_arrivals() -> None:
    arrivals = make_arrivals([Phase("steady", 0.5, 0.0, 100.0)], ["p"], seed=0, max_tokens=(883, 883), ignore_eos=True)
    assert arrivals and all(a.max_tokens == 883 and a.ignore_eos for a in arrivals)


def test_idle_of_lone_requests() -> None:
    results = [OnlineResult(0.0, [(0.1, 1), (0.12, 1), (0.16, 2)]),  # gaps 0.02, then 0.04 over 2 tokens
               OnlineResult(1.0, [(1.2, 1), (1.23, 1)]),
               OnlineResult(1.5, [], error="HTTP 500"),
               OnlineResult(2.0, [(2.3, 1), (2.34, 1), (2.38, 1)])]
    idle = idle_of(results)
    assert idle.ttft_s == pytest.approx(0.2) and idle.itl_s == pytest.approx(0.025) and idle.request_s == pytest.approx(0.23)
    with pytest.raises(RuntimeError):
        idle_of([OnlineResult(0.0, [(0.1, 1)])])  # no second token: no inter-token latency


def test_long_answers_outlast_the_guard_window() -> None:
    assert long_answer_tokens(0.017) == 883  # ceil(15 / 0.017)
    assert long_answer_tokens(0.025) == 600
    assert long_answer_tokens(0.002) == 4096  # capped
    assert long_answer_tokens(0.5) == 64  # at least a normal answer's most
    assert long_answer_s(Idle(0.1, 0.02, 1.0), 751) == pytest.approx(15.1)


def test_saturating_rate_steps_up_then_splits_the_last_step() -> None:
    calls: list[float] = []

    def itl_at(rate: float) -> float:  # 10 ms per request/s
        calls.append(rate)
        return 0.01 * rate

    rate, reached = saturating_rate(itl_at, 5.0, 0.1, step=1.5, probes=8)  # 5, 7.5, 11.25, then 9.19 below the target and 10.17 over it
    assert rate == pytest.approx(11.25 / 1.5 ** 0.25) and reached
    assert calls == [5.0, 7.5, 11.25, pytest.approx(11.25 / math.sqrt(1.5)), pytest.approx(11.25 / 1.5 ** 0.25)]
    calls.clear()
    rate, reached = saturating_rate(itl_at, 5.0, 0.09, step=1.5, probes=8)  # 9.19 over it, then 8.30 below
    assert rate == pytest.approx(9.185586535436919) and reached and len(calls) == 5
    assert saturating_rate(itl_at, 5.0, 0.1, step=1.5, splits=1) == (11.25, True)  # one split: 9.19 below, the step's top
    calls.clear()
    assert saturating_rate(itl_at, 20.0, 0.1, step=1.5) == (20.0, True) and calls == [20.0]  # the first probe reaches it
    assert saturating_rate(lambda rate: 0.01, 5.0, 0.1, step=1.5, probes=3) == (11.25, False)  # bounded: the highest probed
    assert saturating_rate(lambda rate: float("nan"), 1.0, 0.1, step=2.0, probes=4) == (8.0, False)
    populations: list[float] = []  # (b)'s defaults: 16 clients, doubled, then the last doubling halved twice
    assert saturating_rate(lambda n: populations.append(n) or 0.001 * n, SATURATION_START_CLIENTS, 0.1) == (
        pytest.approx(128 / 2 ** 0.25), True)
    assert [round(n) for n in populations] == [16, 32, 64, 128, 91, 108]


def test_a_saturated_scenario_runs_a_population_joining_over_its_ramp() -> None:
    phases = scenario_phases(B, 0.0, 30.0, 30.0)
    load = Load(0.0, (32, 64), False, "probed", clients=90).online(phases, ["p1", "p2"], 7)
    assert load == ClosedLoop(90, 30.0, 90.0, ("p1", "p2"), 7, (32, 64))
    at_a_rate = scenario_phases(B, 0.5, 30.0, 30.0)  # Poisson arrivals where the load is a rate
    arrivals = Load(0.5, (32, 64), False, "rate").online(at_a_rate, ["p1", "p2"], 7)
    assert arrivals == make_arrivals(at_a_rate, ["p1", "p2"], 7, (32, 64)) and len(arrivals) > 0


def test_each_client_of_a_population_has_one_request_in_flight_and_none_sent_after_the_end() -> None:
    in_flight, most, sent = [0], [0], []

    async def handler(request: httpx.Request) -> httpx.Response:
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        sent.append(json.loads(request.content)["messages"][0]["content"])
        await asyncio.sleep(0.02)
        in_flight[0] -= 1
        chunk = json.dumps({"choices": [{"token_ids": [1, 2]}]})
        return httpx.Response(200, text=f"data: {chunk}\n\ndata: {chunk}\n\ndata: [DONE]\n\n")

    load = ClosedLoop(3, 0.05, 0.3, ("a", "b", "c"), 1)

    async def population() -> list[list[OnlineResult]]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            t0 = time.monotonic()
            return await asyncio.gather(*(closed_loop_client(client, "http://server", load, k, t0) for k in range(3)))

    clients = asyncio.run(population())
    assert most[0] <= 3 and all(len(results) >= 2 for results in clients)  # one at a time each, again and again
    assert all(r.sent_s < load.end_s and r.error is None and len(r.chunks) == 2 for results in clients for r in results)
    for results in clients:  # a client's next request is sent once its last one ended
        assert all(later.sent_s >= earlier.chunks[-1][0] for earlier, later in zip(results, results[1:]))
    assert set(sent) <= {"a", "b", "c"}


def test_reference_pools_the_phases_of_its_kind() -> None:
    phases = burst_phases(2, 10.0, 1.0)  # bursts 2.5-7.5 and 12.5-17.5
    online = [OnlineResult(3.0, [(3.5, 1), (3.6, 1)]), OnlineResult(13.0, [(13.5, 1), (13.6, 1)]),
              OnlineResult(9.0, [(19.0, 1), (29.0, 1)])]  # a light one, far slower
    run = SideRun("alone", phases, online, [], [])
    reference = reference_of(run, "burst")
    assert reference is not None
    assert reference.ttft_p99_s == pytest.approx(0.5) and reference.itl_p99_s == pytest.approx(0.1)
    assert reference_of(SideRun("alone", phases, [], [], []), "burst") is None


def test_the_reference_is_alones_heaviest_p99_so_alone_keeps_every_window_it_is_judged_on() -> None:
    phases = burst_phases(2, 10.0, 1.0)
    online = [OnlineResult(3.0, [(3.5, 1), (3.6, 1)]), OnlineResult(13.0, [(13.5, 1), (13.6, 1)]),
              OnlineResult(9.0, [(19.0, 1), (29.0, 1)])]  # a light one: its gap of 10 s is the worst window's
    run = SideRun("alone", phases, online, [], [])
    by_phase = reference_of(run, "burst")
    assert by_phase is not None
    windows = [{"ttft_p99": 0.5, "itl_p99": 0.1}, {"ttft_p99": 10.0, "itl_p99": float("nan")}, {"ttft_p99": 0.2, "itl_p99": 10.0}]
    reference = heaviest(by_phase, windows)
    assert (reference.ttft_p99_s, reference.itl_p99_s) == (10.0, 10.0)
    assert worst_window(windows, Judge(reference)) == (1.0, 1.0, 3, 3)
    # against an SLO of alone itself the window at alone's heaviest keeps it, none over it does
    assert worst_window(windows + [{"ttft_p99": 10.5, "itl_p99": 1.0}], Judge(reference, 1.0))[2:] == (3, 4)
    assert heaviest(by_phase, [{"ttft_p99": 0.1, "itl_p99": 0.05}]) == by_phase  # lighter windows leave the phases' p99


def test_median_or_none() -> None:
    assert median_or_none([0.64, None, 1.5]) == pytest.approx(1.07)
    assert median_or_none([1.0, 2.0, 4.0]) == 2.0
    assert median_or_none([0.5]) == 0.5
    assert median_or_none([None, float("nan")]) is None
    assert median_or_none([]) is None


def result(scenario, ttft=None, itl=None, gain=None) -> ScenarioResult:
    return ScenarioResult(scenario, ttft, itl, 5, 5, 100.0, gain, 60.0)


def test_final_line() -> None:
    results = [result(A, 1.12, 1.24, 0.64), result(B, 1.31, 1.1), result(C, 1.0, 1.0), result(D, 0.9, 1.2),
               result(E, 0.9, 1.3, 1.5)]
    assert final_line(results) == ("worst scenario: online p99 TTFT 1.31x, inter-token 1.30x of alone; batch 1.07x the best "
                                   "safe fixed concurrency (median over (a), (e))")
    assert final_line([result(A, 1.0, 1.1), result(B, 1.2, float("nan"))]) == (
        "worst scenario: online p99 TTFT 1.20x, inter-token 1.10x of alone; batch n/a the best safe fixed concurrency "
        "(median over (a), (e))")
    assert final_line([result(B)]) == ("worst scenario: online p99 TTFT n/a, inter-token n/a of alone; batch n/a the best safe "
                                       "fixed concurrency (median over (a), (e))")


def test_targets_line() -> None:
    results = [result(A, 1.12, 1.24, 0.64), result(B, 1.31, 1.1), result(E, 0.9, 1.3, 1.5)]
    assert targets_line(results) == (
        "targets: online p99 TTFT and inter-token <= 1.25x alone in every scenario's worst window: no ((b) saturated TTFT "
        "1.31x, (e) untuned inter-token 1.30x); batch >= 1.0x the best safe fixed concurrency (median over (a), (e)): yes")
    assert targets_line([result(A, 1.0, 1.25, 0.9), result(C)]) == (
        "targets: online p99 TTFT and inter-token <= 1.25x alone in every scenario's worst window: yes; not measured: "
        "(c) long-answers; batch >= 1.0x the best safe fixed concurrency (median over (a), (e)): no")
    assert targets_line([result(B)]) == (
        "targets: online p99 TTFT and inter-token <= 1.25x alone in every scenario's worst window: n/a; batch >= 1.0x the best "
        "safe fixed concurrency (median over (a), (e)): n/a")


def test_the_matrix_plan_fits_an_hour() -> None:
    args = argparse.Namespace(quick=False, phase_s=30.0, window_s=30.0, sides=["fixed", "oracle", "batchllm"], probe_min_s=20.0)
    plans = {s.key: scenario_seconds(args, s) for s in (A, B, C, D, E)}
    assert plans == {"a": (690.0, 1240.0), "b": (490.0, 490.0), "c": (280.0, 280.0), "d": (250.0, 250.0), "e": (690.0, 1240.0)}
    again = argparse.Namespace(**{**vars(args), "sides": ["batchllm", "again"]})
    assert scenario_seconds(again, B) == (600.0, 600.0)  # alone once more: one side's phases and overhead
    assert 2 * 60.0 + sum(likely for likely, _ in plans.values()) < 45 * 60
    single = argparse.Namespace(quick=False, phase_s=60.0, window_s=30.0, sides=["fixed", "oracle", "batchllm"],
                                probe_min_s=20.0)
    assert scenario_seconds(single, A) == (1230.0, 2230.0)  # a single (a), 60 s phases: with its server, as planned before
