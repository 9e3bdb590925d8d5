"""The Python API, `batchllm.run` and `batchllm.plan`: the CLI's semantics without a shell.

The scripted fake engine stands in for vLLM here (orchestration only); the real engine runs
the ensemble example from a pandas frame in tests/test_real_engine.py.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from rich.console import Console

import batchllm
from batchllm.engines.devices import DeviceSet, hardware_name
from batchllm.runtime.launch import run_dag_file
from tests.conftest import ENSEMBLE_DAG, QUESTIONS
from tests.fakes import DriverCrash, FakeEngineFactory

CPU2 = DeviceSet("cpu", (0, 1))
REPO = Path(__file__).resolve().parent.parent
QUIET = Console(quiet=True)


def api_run(dag, workspace, factory, **kwargs):
    kwargs.setdefault("out", workspace.root / "api-out")
    return batchllm.run(dag, devices=CPU2, schedule="sequential", prefix_order=False, engine_factory=factory, console=QUIET,
                        **kwargs)


def questions_frame() -> pd.DataFrame:
    return pd.DataFrame({"id": [q for q, _ in QUESTIONS], "question": [t for _, t in QUESTIONS]})


def test_a_pandas_frame_gives_the_rows_the_cli_gives_from_the_file(workspace):
    dag = workspace.dag(ENSEMBLE_DAG)
    run_dag_file(dag, workspace.out, CPU2, console=QUIET, engine_factory=FakeEngineFactory(), prefix_order=False,
                 schedule="sequential")
    ran = api_run(dag, workspace, FakeEngineFactory(), inputs={"questions": questions_frame()})
    assert ran.tables["judged"] == pq.read_table(workspace.out / "judged.parquet")
    assert ran.tables["judged"].num_rows == len(QUESTIONS)
    assert set(ran.nodes) == {"a", "b", "judge"} and ran.engines_started == 1
    assert ran.summary[:2] == ("batchllm run summary", "a (tiny-model): 4/4 units")


def test_a_dict_dag_with_a_pyarrow_table_and_no_input_path(workspace):
    spec = yaml.safe_load(textwrap.dedent(ENSEMBLE_DAG))
    for node in spec["nodes"].values():
        node["model"] = str(workspace.root / "tiny-model")
    del spec["inputs"]["questions"]["path"]
    table = pa.table({"id": ["x1", "x2"], "question": ["one?", "two?"]})
    ran = api_run(spec, workspace, FakeEngineFactory(), inputs={"questions": table})
    judged = ran.tables["judged"].to_pylist()
    assert [row["row_id"] for row in judged] == ["x1", "x2"]
    assert judged[0]["verdict"] == "<J <A one?> | <B one?>>"


def test_calling_run_again_with_the_same_frame_resumes_and_starts_no_engine(workspace):
    dag = workspace.dag(ENSEMBLE_DAG)
    with pytest.raises(DriverCrash):
        api_run(dag, workspace, FakeEngineFactory(crash_after_results=5), inputs={"questions": questions_frame()})
    resumed = FakeEngineFactory()
    api_run(dag, workspace, resumed, inputs={"questions": questions_frame()})
    assert len(resumed.requests) == 3 * len(QUESTIONS) - 5  # nothing committed is asked again
    again = api_run(dag, workspace, FakeEngineFactory(), inputs={"questions": questions_frame()})
    assert again.engines_started == 0 and again.summary[0].startswith("Nothing to do")


def test_a_changed_frame_is_new_data_and_is_refused_unless_fresh(workspace):
    dag = workspace.dag(ENSEMBLE_DAG)
    api_run(dag, workspace, FakeEngineFactory(), inputs={"questions": questions_frame()})
    changed = questions_frame().assign(question=lambda f: f.question + " Briefly.")
    with pytest.raises(batchllm.UserError, match="different version of node .a.") as error:
        api_run(dag, workspace, FakeEngineFactory(), inputs={"questions": changed})
    assert "fresh=True" in error.value.hint
    ran = api_run(dag, workspace, FakeEngineFactory(), inputs={"questions": changed}, fresh=True)
    assert ran.tables["judged"].column("question")[0].as_py() == "What is a prime number? Briefly."


def test_an_unknown_input_name_is_refused_before_anything_is_written(workspace):
    dag = workspace.dag(ENSEMBLE_DAG)
    with pytest.raises(batchllm.UserError, match="inputs= names 'qestions', which the DAG does not declare") as error:
        api_run(dag, workspace, FakeEngineFactory(), inputs={"qestions": questions_frame()})
    assert error.value.hint == "the DAG's inputs: questions"
    assert not (workspace.root / "api-out").exists()


def test_a_bad_dict_dag_names_the_key_path(workspace):
    spec = yaml.safe_load(textwrap.dedent(ENSEMBLE_DAG))
    spec["nodes"]["judge"]["sampling"] = {"max_tokens": "many"}
    with pytest.raises(batchllm.UserError) as error:
        api_run(spec, workspace, FakeEngineFactory(), inputs={"questions": questions_frame()})
    assert "nodes.judge.sampling.max_tokens" in f"{error.value} {error.value.where}"
    assert not (workspace.root / "api-out").exists()


@pytest.mark.parametrize("change, where, message", [
    (lambda spec: spec["nodes"]["a"].update(prompt="A {{ questoin }}"), "nodes.a",
     "the template or `where` reads 'questoin', which is neither a node nor a column of input 'questions'"),
    (lambda spec: spec["nodes"]["b"].update(model="./no-such-model"), "nodes.b.model", None),
    (lambda spec: spec["nodes"]["judge"].update(prompt="J {{ a }} {% if %}"), "nodes.judge.prompt", None),
])
def test_a_dict_dags_errors_name_the_key_path_not_a_file(workspace, monkeypatch, change, where, message):
    monkeypatch.chdir(workspace.root)  # a dict's relative paths start here
    spec = yaml.safe_load(textwrap.dedent(ENSEMBLE_DAG))
    change(spec)
    with pytest.raises(batchllm.UserError) as error:
        api_run(spec, workspace, FakeEngineFactory(), inputs={"questions": questions_frame()})
    assert error.value.where == where, error.value.paragraph()
    if message is not None:
        assert error.value.message == message


def test_a_frame_whose_column_mixes_types_is_refused_with_a_hint(workspace):
    dag = workspace.dag(ENSEMBLE_DAG)
    mixed = pd.DataFrame({"id": ["q1", "q2"], "question": ["text", 3]})
    with pytest.raises(batchllm.UserError, match=r"inputs\['questions'\]: the DataFrame cannot be converted to Arrow"):
        api_run(dag, workspace, FakeEngineFactory(), inputs={"questions": mixed})


def test_plan_over_a_frame_returns_the_report_without_running(workspace, tmp_path):
    profiles = tmp_path / "profiles"
    shutil.copytree(REPO / "profiles" / "cpu-intel-xeon" / "smollm2-135m", profiles / hardware_name("cpu") / "tiny-model",
                    ignore=shutil.ignore_patterns("logs"))
    report = batchllm.plan(workspace.dag(ENSEMBLE_DAG), inputs={"questions": questions_frame()}, devices="cpu:2",
                           profiles_root=profiles)
    assert {name for stage in report.chosen.stages for name in stage.plans} == {"a", "b", "judge"}
    assert report.chosen.total_s > 0
    assert not (workspace.root / "out").exists()
