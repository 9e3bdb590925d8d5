"""`batchllm plan` as a pre-flight check: per node its rows, prompt tokens, rows over the
context, predicted output tokens, time, device-hours and cost, from the node's data summary
(`io.node_data`), which the planner consumes without reading data itself."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from typer.testing import CliRunner

from batchllm.cli import app
from batchllm.costmodel.estimator import ExecutionPlan, Workload, estimate
from batchllm.costmodel.profile import ReplicaShape, find_profile
from batchllm.costmodel.request_lengths import RequestLengths

REPO = Path(__file__).resolve().parent.parent
PROFILES = REPO / "profiles"

DAG = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    engine:
      max_model_len: 24
    nodes:
      answer:
        model: smollm2-135m
        prompt: "Answer in one line: {{ question }}"
        sampling: {max_tokens: 32}
      check:
        model: smollm2-135m
        prompt: "Is this right? {{ answer }}"
        sampling: {max_tokens: 8, n: 2}
    outputs:
      answers: {columns: {answer: answer, check: check}}
    prices:
      smollm2-135m: {prompt_per_1m: 1000, output_per_1m: 4000}
"""


def plan(workspace, tmp_path, body: str, *extra: str):
    result = CliRunner().invoke(app, ["plan", str(workspace.dag(body)), "--devices", "1xA100-80G", "--chart",
                                      str(tmp_path / "c.png"), *extra], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    return result.output


def test_plan_prints_a_pre_flight_table_before_the_stages(workspace, tmp_path):
    output = plan(workspace, tmp_path, DAG)
    preflight = [line.rstrip() for line in output[:output.index("dag on 1xA100-80G:")].splitlines()]
    assert preflight == [
        "pre-flight: dag on 1xA100-80G",
        "┏━━━━━━━━┳━━━━━━━━━━━━━━┳━━━━━━┳━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━┳━━━━━━━━━━━━━━━━┳━━━━━━━━┳━━━━━━━━┳━━━━━━━━━━┳━━━━━━━━┓",
        "┃ node   ┃ model        ┃ rows ┃ prompt p50/p90/max ┃ over ctx ┃ output p50/p90 ┃ source ┃ est. s ┃ device-h ┃   cost ┃",
        "┡━━━━━━━━╇━━━━━━━━━━━━━━╇━━━━━━╇━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━╇━━━━━━━━━━━━━━━━╇━━━━━━━━╇━━━━━━━━╇━━━━━━━━━━╇━━━━━━━━┩",
        "│ answer │ smollm2-135m │    4 │           23/24/25 │       ~1 │            1/2 │ prior  │    6.5 │    0.002 │ 0.1130 │",
        "│ check  │ smollm2-135m │    4 │           48/48/48 │       ~4 │            1/1 │ prior  │    0.1 │    0.000 │ 0.2240 │",
        "└────────┴──────────────┴──────┴────────────────────┴──────────┴────────────────┴────────┴────────┴──────────┴────────┘",
        "tokens: prompts of a sample of the rows, outputs predicted (capped by max_tokens and the context); est. s: time the node",
        "holds devices; cost at the DAG's prices",
        "note: answer: about 1 row (estimated on a sample of 4) would not fit max_model_len 24 (a prompt of 24 tokens or more",
        "leaves no room for an output token) and would get `error:` results; raise max_model_len in `engine:` or shorten the",
        "template",
        "note: check: about 4 rows (estimated on a sample of 4) would not fit max_model_len 24 (a prompt of 24 tokens or more",
        "leaves no room for an output token) and would get `error:` results; raise max_model_len in `engine:` or shorten the",
        "template",
    ]
    # "Answer in one line: " + the questions: 43, 51, 40, 44 characters at 4 a token + 12 of chat template = 23, 25, 22, 23;
    # only the 25 leaves no room in 24; `check` reads `answer`'s expected output (not known yet: ~ estimated)


def test_plan_json_has_each_nodes_pre_flight_figures(workspace, tmp_path):
    body = json.loads(plan(workspace, tmp_path, DAG, "--json"))
    assert body["estimated_s"] == body["total_s"]
    answer, check = body["nodes"]["answer"], body["nodes"]["check"]
    assert {k: answer[k] for k in ("rows", "rows_over_context", "prompt_tokens", "max_model_len", "sample_rows")} == {
        "rows": 4, "rows_over_context": 1, "prompt_tokens": {"p50": 23, "p90": 24, "max": 25}, "max_model_len": 24,
        "sample_rows": 4}
    assert answer["predicted_output_tokens"]["source"] == "prior"
    assert answer["predicted_output_tokens"]["p50"] <= answer["predicted_output_tokens"]["p90"] <= 2  # the context's room
    assert (check["rows"], check["requests"], check["rows_over_context"]) == (4, 8, 4)  # n = 2 samples a row
    # one device, one stage each: the node holds it for its stage, device-hours = seconds / 3600
    stages = {row["node"]: row["end_s"] - row["start_s"] for row in body["stages"]}
    for name, node in body["nodes"].items():
        assert abs(node["estimated_s"] - stages[name]) < 2e-3
        assert abs(node["device_hours"] - node["estimated_s"] / 3600) < 1e-6
        assert isinstance(node["cost"], float) and node["cost"] > 0


def test_without_prices_the_cost_is_null_and_the_table_has_no_cost_column(workspace, tmp_path):
    text = DAG[:DAG.index("    prices:")]
    body = json.loads(plan(workspace, tmp_path, text, "--json"))
    assert [node["cost"] for node in body["nodes"].values()] == [None, None]
    assert "cost" not in plan(workspace, tmp_path, text).split("dag on 1xA100-80G:")[0]


def test_rows_over_context_are_counted_exactly_on_all_rows_and_scaled_from_a_sample(workspace, monkeypatch):
    from batchllm.dag.loader import load_dag
    from batchllm.io import node_data
    from batchllm.io.dag_checks import check_dag
    from batchllm.io.node_data import NodeFacts, summarize_dag
    from batchllm.models.registry import batchllm_home

    texts = ["short"] * 6 + ["long " * 40] * 2  # 5 and 200 characters: 1 and 50 estimated tokens (no chat template)
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(8)], "text": texts}), workspace.root / "texts.parquet")
    dag = load_dag(workspace.dag("""
        inputs:
          texts: {path: texts.parquet, id_column: id}
        nodes:
          echo:
            model: smollm2-135m
            chat: false
            prompt: "{{ text }}"
        outputs:
          echoed: {columns: {echo: echo}}
    """))
    sources = check_dag(dag, batchllm_home(), resolve_models=False)
    (summary,) = summarize_dag(dag, sources, {"echo": NodeFacts(10.0, 16, 50)}).values()
    assert summary.prompt_tokens.tolist() == [1] * 6 + [50] * 2
    assert (summary.rows, summary.sample_over_context, summary.rows_over_context) == (8, 2, 2)  # 50 + 1 > 50
    assert summary.sample_is_all_rows and summary.prompt_token_stats() == {"p50": 1, "p90": 50, "max": 50}
    assert summary.samples[-1].last_user == "long " * 40 and summary.samples[0].template == "echo"
    monkeypatch.setattr(node_data, "SAMPLE_ROWS", 4)  # the first 4 rows, none over: 0 of 8 estimated
    (head,) = summarize_dag(dag, sources, {"echo": NodeFacts(10.0, 16, 50)}).values()
    assert (len(head.prompt_tokens), head.rows_over_context, head.over_context_estimated) == (4, 0, True)
    monkeypatch.setattr(node_data, "SAMPLE_ROWS", 1000)
    (roomy,) = summarize_dag(dag, sources, {"echo": NodeFacts(10.0, 16, 51)}).values()
    assert roomy.rows_over_context == 0


def test_a_length_source_plugs_into_the_plan_and_its_lengths_drive_the_estimate(workspace):
    from batchllm.costmodel.output_lengths import UnlearntLengths, profile_lengths
    from batchllm.dag.loader import load_dag
    from batchllm.planner.length_sources import length_prompts
    from batchllm.planner.plan_file import plan_dag

    dag = load_dag(workspace.dag(DAG.replace("max_model_len: 24", "max_model_len: 2048").replace("max_tokens: 32", "max_tokens: 1024")))
    seen = {}

    class Longer(UnlearntLengths):
        def sample_lengths(self, summary, profile):
            seen[summary.name] = length_prompts(summary)
            base = profile_lengths(summary, profile)
            return RequestLengths(base.base, np.full(len(base), np.log(0.25)), "length model")

    default = plan_dag(dag, "1xA100-80G", profiles_root=PROFILES)
    plugged = plan_dag(dag, "1xA100-80G", profiles_root=PROFILES, lengths={name: Longer() for name in dag.nodes})
    assert seen["answer"][0].last_user == "Answer in one line: What is a prime number?"
    assert {p.max_tokens for p in seen["check"]} == {8} and seen["check"][0].template == "check"
    assert default.preflight["answer"].output_source == "prior" and plugged.preflight["answer"].output_source == "length model"
    assert plugged.preflight["answer"].output_p90 < default.preflight["answer"].output_p90
    assert plugged.chosen.total_s < default.chosen.total_s  # outputs a quarter as long take less time


def test_per_request_lengths_with_no_shift_sample_what_the_profile_samples():
    profile = find_profile(PROFILES, "A100-80G", "smollm2-135m")
    plan = ExecutionPlan(1, ReplicaShape(1, 1))
    prompts = np.arange(10, 210, 10)
    plain = Workload.of(prompts, 64)
    shared = Workload.of(prompts, 64, output_lengths=RequestLengths.shared(profile.lengths, len(prompts), "prior"))
    for seed in range(3):
        assert estimate(profile, plan, plain, seed=seed).output_tokens.tolist() == \
            estimate(profile, plan, shared, seed=seed).output_tokens.tolist()


def test_the_planner_reads_no_data_itself():
    readers = {"batchllm.io.input_source", "batchllm.io.sql", "batchllm.models.tokens", "batchllm.models.embedded",
               "batchllm.dag.node_prompt", "batchllm.dag.context", "batchllm.ordering.prefix_tree"}
    for path in sorted((REPO / "batchllm" / "planner").glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module} | \
            {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert not imported & readers, f"{path.name} imports {sorted(imported & readers)}"


def test_plan_pilot_json_is_the_plans_json_with_the_pilots_figures(workspace):
    """`plan --pilot --json` prints the schema `plan --json` prints (nodes with their pre-flight
    fields, stages, notes), the pilots' figures added: a script reads either."""
    from batchllm.dag.loader import load_dag
    from batchllm.planner.plan_file import plan_dag
    from batchllm.planner.report import report_json, with_pilot

    plan = report_json(plan_dag(load_dag(workspace.dag(DAG)), "1xA100-80G", profiles_root=PROFILES))
    piloted = with_pilot(plan, pilot_s=12.3456, rest_estimated_s=40.0, out="runs/x")
    assert set(piloted) == set(plan) | {"pilot_s", "rest_estimated_s", "out"}
    assert {key: piloted[key] for key in plan if key != "estimated_s"} == {key: plan[key] for key in plan if key != "estimated_s"}
    assert (piloted["estimated_s"], piloted["pilot_s"], piloted["rest_estimated_s"], piloted["out"]) == (52.346, 12.346, 40.0, "runs/x")
    assert set(plan["nodes"]["answer"]) >= {"model", "requests", "rounds", "producers"} and plan["stages"]
