"""`batchllm plan` on every example DAG and on DAGs of big models (70B,
Mixtral-8x7B, 34B, each alone, the three in a chain, and a six-model mix of 7B to 70B)
at 1, 2, 3, 4 and 8 GPUs of each catalog kind, with the analytic GPU profiles; at 3 and 4 GPUs
with `--compare` and a chart too.

Each case either plans (exit 0: every node finishes exactly once, no stage holds more
devices than there are or one device twice, no method beats the lower bound) or, exactly
when one of its models' smallest replica needs more GPUs than there are, exits 2 naming
such a model, what it needs and how many there are. Never a traceback. The expected
outcome is computed from the profiles' replica shapes, not from the planner.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from batchllm.cli import app
from batchllm.costmodel.profile import ReplicaShape

REPO = Path(__file__).resolve().parent.parent
PROFILES = REPO / "profiles"
KINDS = sorted(yaml.safe_load((PROFILES / "analytic" / "catalog.yaml").read_text())["hardware"])
COUNTS = (1, 2, 3, 4, 8)
COMPARED_COUNTS = (3, 4)  # `--compare` runs every method, the exact search too (at 8 GPUs seconds a case: test_planner has one)
QUESTIONS = REPO / "examples" / "questions.parquet"


def _node(model: str, prompt: str) -> dict:
    return {"model": model, "prompt": prompt, "sampling": {"max_tokens": 128}}


def _dag(name: str, nodes: dict[str, dict], output: str) -> dict:
    return {"name": name, "inputs": {"questions": {"path": str(QUESTIONS), "id_column": "id"}},
            "nodes": nodes, "outputs": {"out": {"columns": {"answer": output}}}}


BIG_DAGS = {
    **{f"alone-{m}": _dag(f"alone-{m}", {"big": _node(m, "{{ question }}")}, "big")
       for m in ("llama-2-70b", "mixtral-8x7b", "codellama-34b")},
    "chain-of-three": _dag("chain-of-three", {
        "draft": _node("llama-2-70b", "{{ question }}"),
        "rewrite": _node("mixtral-8x7b", "Rewrite: {{ draft }}"),
        "review": _node("codellama-34b", "Review: {{ rewrite }}"),
    }, "review"),
    "six-models": _dag("six-models", {  # 7B to 70B and Mixtral: two fan-outs feed a judge
        "small": _node("llama-2-7b", "{{ question }}"),
        "medium": _node("llama-2-13b", "{{ question }}"),
        "code": _node("codellama-34b", "{{ question }} Hint: {{ small }}"),
        "large": _node("llama-2-70b", "{{ question }} Hint: {{ medium }}"),
        "experts": _node("mixtral-8x7b", "{{ question }}"),
        "judge": _node("mistral-7b", "A: {{ code }} B: {{ large }} C: {{ experts }}. Which is best?"),
    }, "judge"),
}


def _example_dags() -> list[Path]:
    """The example DAGs the planner has a cost model for: none with an embed node (`plan` refuses those, exit 2)."""
    return [path for path in sorted((REPO / "dags").glob("*.yaml"))
            if all(node.get("task", "generate") == "generate" for node in yaml.safe_load(path.read_text())["nodes"].values())]


@pytest.fixture(scope="module")
def dag_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("sweep-dags")
    files = {path.stem: path for path in _example_dags()}
    for name, body in BIG_DAGS.items():
        files[name] = folder / f"{name}.yaml"
        files[name].write_text(yaml.safe_dump(body, sort_keys=False))
    return files


def _smallest_replica(kind: str, model: str) -> int:
    shapes = json.loads((PROFILES / "analytic" / kind / model / "profile.json").read_text())["shapes"]
    return min(ReplicaShape.parse(key).devices for key in shapes)


def _models(path: Path) -> set[str]:
    return {node["model"] for node in yaml.safe_load(path.read_text())["nodes"].values()}


CASES = [(dag, kind, count) for dag in [p.stem for p in _example_dags()] + list(BIG_DAGS)
         for kind in KINDS for count in COUNTS]


def test_the_sweep_covers_the_example_dags_the_big_models_and_every_catalog_kind():
    assert KINDS == ["A100-80G", "H100-80G"]
    assert {dag for dag, _, _ in CASES} == {"chain_summary", "ensemble_judge", "router", *BIG_DAGS}
    assert len(CASES) == (len(_example_dags()) + len(BIG_DAGS)) * len(KINDS) * len(COUNTS)


@pytest.mark.parametrize(("dag", "kind", "count"), CASES, ids=[f"{d}-{c}x{k}" for d, k, c in CASES])
def test_plan_plans_or_names_the_model_that_fits_nowhere(dag_files, tmp_path, dag, kind, count):
    path = dag_files[dag]
    chart = tmp_path / "chart.png"
    compared = count in COMPARED_COUNTS
    options = ["--compare", "--chart", str(chart)] if compared else []
    result = CliRunner().invoke(app, ["plan", str(path), "--devices", f"{count}x{kind}", "--json", *options])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    too_big = {m: n for m in _models(path) if (n := _smallest_replica(kind, m)) > count}
    if too_big:
        assert result.exit_code == 2, result.output
        named = [m for m in too_big if f"model {m!r} fits on no plan of {count}x{kind}" in result.output]
        assert len(named) == 1, result.output
        there = "there is 1" if count == 1 else f"there are {count}"
        assert f"its smallest replica needs {too_big[named[0]]} {kind} GPUs, {there}" in " ".join(result.output.split())
        assert not chart.exists()
        return
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    finished = sorted(row["node"] for row in body["stages"] if row["finished"])
    assert finished == sorted(body["nodes"])  # every node finishes exactly once
    for stage in {row["stage"] for row in body["stages"]}:
        devices = [d for row in body["stages"] if row["stage"] == stage for d in row["devices"]]
        assert len(devices) == len(set(devices)) and all(0 <= d < count for d in devices)
    assert body["total_s"] >= body["lower_bound_s"] * (1 - 1e-6)
    if not compared:
        assert body["compared"] == [] and not chart.exists()
        return
    methods = {s["method"]: s["total_s"] for s in body["compared"]}
    assert {"greedy+rollout", "greedy", "greedy-no-preemption", "max-heuristic", "min-heuristic"} <= set(methods)
    assert ("exact" in methods) == (len(body["nodes"]) <= 5)
    assert [s["method"] for s in body["not_run"]] == ([] if len(body["nodes"]) <= 5 else ["exact"])
    for total_s in (body["total_s"], *methods.values()):
        assert total_s >= body["lower_bound_s"] * (1 - 1e-6)
    assert body["total_s"] <= min(methods[m] for m in ("greedy+rollout", "max-heuristic", "min-heuristic")) + 1e-3
    assert chart.exists() and chart.with_suffix(".html").exists()
