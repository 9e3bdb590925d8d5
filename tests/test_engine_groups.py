"""Engine groups: a base model's nodes and its adapters' planned as one node (one plan, one load,
their requests batched together), and the runtime given the plan back in DAG nodes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rich.console import Console

from batchllm.costmodel.estimator import Workload
from batchllm.costmodel.profile import Profile
from batchllm.dag.loader import load_dag
from batchllm.engines.devices import parse_devices
from batchllm.planner.engine_groups import engine_groups, grouped, merged
from batchllm.planner.plan_file import plan_dag_file
from batchllm.planner.problem import GroupMember, NodeWorkload
from batchllm.runtime.launch import run_dag_file
from batchllm.runtime.run_state import NodeProgress
from batchllm.runtime.stage_planner import group_progress
from testkit.lora_adapters import TINY_BASE, make_lora_adapter
from tests.conftest import QUESTIONS
from tests.fakes import FakeEngineFactory, fake_text

ROUTER_DAG = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      route:
        model: ./tiny-model
        prompt: "R {{ question }}"
      plain:
        model: ./tiny-model
        prompt: "P {{ question }}"
      tuned_a:
        model: ./tiny-model
        adapter: adapters/a
        where: "route = 'code'"
        prompt: "A {{ question }}"
      tuned_b:
        model: ./tiny-model
        adapter: adapters/b
        where: "route = 'other'"
        prompt: "B {{ question }}"
      judge:
        model: ./tiny-model
        adapter: adapters/b
        prompt: "J {{ plain }}"
"""
CODE_QUESTIONS = {"q2", "q4"}


def answer(request) -> str:
    """The router's label by the question; every other node's the fake engine's echo."""
    if request.prompt.startswith("R "):
        return "code" if any(word in request.prompt for word in ("Python", "SQL")) else "other"
    return fake_text(request)


@pytest.fixture
def router(workspace):
    (workspace.root / "tiny-model" / "config.json").write_text(json.dumps(TINY_BASE))
    for seed, name in enumerate("ab"):
        make_lora_adapter(workspace.root / "adapters" / name, TINY_BASE, seed=seed, rank=4)
    return workspace


def test_a_group_holds_one_models_nodes_none_of_which_reads_another(router):
    dag = load_dag(router.dag(ROUTER_DAG))
    # plain reads nothing, so it joins the router; the judge reads plain, so it joins the adapters
    assert engine_groups(dag) == (("route", "plain"), ("tuned_a", "tuned_b", "judge"))


def test_nodes_of_a_model_without_adapters_are_no_group(router):
    text = ROUTER_DAG.replace("        adapter: adapters/a\n", "").replace("        adapter: adapters/b\n", "")
    assert engine_groups(load_dag(router.dag(text))) == ()


def workload_of(name: str, prompts: list[int], rounds: int, producers=(), n: int = 1) -> NodeWorkload:
    profile = Profile.load(_smollm_profile())
    return NodeWorkload(name, profile, Workload.of(prompts, 64), (rounds,), producers, n)


def _smollm_profile():
    from pathlib import Path

    return Path(__file__).resolve().parent.parent / "profiles" / "cpu-intel-xeon" / "smollm2-135m"


def test_a_groups_sample_weighs_each_member_by_its_requests():
    a = workload_of("a", [100] * 10, rounds=300, producers=("up",))
    b = workload_of("b", [7] * 10, rounds=100, producers=("up", "a_up"), n=2)
    group = merged([a, b])
    assert group.name == "a+b" and group.rounds == (400,) and group.requests_per_unit == 1
    assert group.producers == ("up", "a_up")
    assert sorted(group.workload.prompt_tokens.tolist()) == [7] * 5 + [100] * 15  # 20 requests, 3:1 as 300:100
    assert group.members == (GroupMember("a", 300, 1), GroupMember("b", 100, 2))
    np.testing.assert_allclose(group.workload.output_lengths.log_shift, 0.0)  # one model's lengths, unshifted


def test_grouped_puts_each_group_where_its_first_member_was():
    items = [workload_of(name, [10], rounds=1) for name in ("x", "a", "y", "b")]
    assert [w.name for w in grouped(items, (("a", "b"),))] == ["x", "a+b", "y"]


def test_a_groups_progress_adds_its_members_requests_done():
    members = (GroupMember("a", 300, 1), GroupMember("b", 100, 2), GroupMember("c", 50, 1))
    progress = {"a": NodeProgress(30, 60, True, running_s=4.0, done_units_before=6),  # half done
                "b": NodeProgress(10, 40, False, running_s=9.0)}  # 10 units of 2 requests; c finished
    assert group_progress(members, progress) == NodeProgress(150 + 20 + 50, 450, False, 9.0, 30 + 0 + 50)


def test_plan_shows_a_group_as_one_node_of_its_members(router, profiles):
    report = plan_dag_file(router.dag(ROUTER_DAG), "cpu:2", profiles_root=profiles)
    assert set(report.problem.nodes) == {"route+plain", "tuned_a+tuned_b+judge"}
    assert report.problem.nodes["tuned_a+tuned_b+judge"].producers == ("route+plain",)


def test_a_planned_run_gives_each_group_one_plan_and_devices_and_its_members_one_engine(router, profiles):
    factory = FakeEngineFactory(answer=answer)
    result, _ = run_dag_file(router.dag(ROUTER_DAG), router.out, parse_devices("cpu:2"), console=Console(quiet=True),
                             engine_factory=factory, prefix_order=False, schedule="plan", profiles_root=profiles)
    assert result.nodes_failed == {}
    report = json.loads((router.out / "run.json").read_text())
    for stage in report["stages"]:
        placed = {name: (node["plan"], tuple(node["devices"])) for name, node in stage["nodes"].items()}
        for group in (("route", "plain"), ("tuned_a", "tuned_b", "judge")):
            assert len({placed[n] for n in group if n in placed}) <= 1, stage  # members: one plan on the same devices
    # one engine per replica the run's plans used (at most one per core), never one per node
    replicas = {tuple(e.config.replica.device_ids) for e in factory.started}
    assert result.model_loads == len(factory.started) == len(replicas) <= 2
    by_node: dict[str, set[str]] = {}
    for request in factory.requests:
        by_node.setdefault(request.prompt.split(" ")[0], set()).add(request.prompt)
    assert {prefix: len(prompts) for prefix, prompts in by_node.items()} == \
        {"R": len(QUESTIONS), "P": len(QUESTIONS), "A": len(CODE_QUESTIONS), "B": len(QUESTIONS) - len(CODE_QUESTIONS),
         "J": len(QUESTIONS)}
