"""The plan of what the result store leaves: a node's answered share is done before the first
stage, a node answered whole is no stage, and its consumer is ready at once."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from batchllm.cli import app
from batchllm.planner.answered_work import answered_states
from batchllm.planner.baselines import lower_bound_s
from batchllm.planner.best import best_schedule
from batchllm.planner.timeline import Timeline
from tests.conftest import ENSEMBLE_DAG
from tests.fakes import FakeEngineFactory
from tests.test_planner import node, problem
from tests.test_run_cli import run_cli_with


def rest_of(plan_problem, answered_share) -> Timeline:
    """The start of a plan of the requests the result store does not answer, as plan_dag builds it."""
    return Timeline(plan_problem, 0.0, answered_states(plan_problem, answered_share))


def test_an_answered_share_is_done_and_a_node_answered_whole_is_no_stage():
    chain = problem(2, node("gen", 100, 0.1), node("judge", 100, 0.1, producers=["gen"]))
    states = answered_states(chain, {"gen": 1.0, "judge": 0.25})
    assert "gen" not in states
    assert states["judge"].done_requests(chain.nodes["judge"]) == pytest.approx(25.0)
    whole = best_schedule(Timeline.start(chain))
    rest = best_schedule(rest_of(chain, {"gen": 1.0, "judge": 0.25}))
    assert {name for stage in rest.stages for name in stage.plans} == {"judge"}
    assert lower_bound_s(rest_of(chain, {"gen": 1.0, "judge": 0.25})) <= rest.total_s < whole.total_s
    assert best_schedule(rest_of(chain, {})).total_s == pytest.approx(whole.total_s)
    assert best_schedule(rest_of(chain, {"gen": 1.0, "judge": 1.0})).stages == ()


def test_plan_after_a_run_estimates_what_the_store_leaves(workspace, monkeypatch, profiles):
    """The ensemble run once; its judge edited: plan's schedule is of the judge's requests only,
    and says what computing everything would have taken."""
    assert run_cli_with(workspace, monkeypatch, FakeEngineFactory(), "--out", "out").exit_code == 0
    monkeypatch.setattr("batchllm.engines.settings_check.check_engine_settings", lambda dag, home, kind: None)
    edited = workspace.dag(ENSEMBLE_DAG.replace('prompt: "J {{ a }} | {{ b }}"', 'prompt: "Judge {{ a }} or {{ b }}"'), "edited.yaml")
    result = CliRunner().invoke(app, ["plan", str(edited), "--json", "--profiles", str(profiles), "--chart", str(workspace.root / "c.png")])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["stored"] == {"a": {"stored": 4, "units": 4}, "b": {"stored": 4, "units": 4}, "judge": {"stored": 0, "units": 4}}
    assert {node for stage in plan["stages"] for node in [stage["node"]]} == {"judge"}
    assert plan["lower_bound_s"] <= plan["total_s"] < plan["all_computed_s"]
