"""The executor with a scripted engine: outputs, engine sharing, resume, failures."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchllm.engines.devices import DeviceSet
from batchllm.errors import RunIncomplete
from batchllm.runtime.launch import run_dag_file
from tests.conftest import ENSEMBLE_DAG
from tests.fakes import DriverCrash, FakeEngineFactory

CPU2 = DeviceSet("cpu", (0, 1))


def run(workspace, dag_text, factory, fresh=False):
    """The fake model directory has no tokenizer, so requests go in the given order here;
    prefix ordering is tested in test_prefix_order.py and used by the real-engine tests."""
    dag = workspace.dag(dag_text)
    return run_dag_file(dag, workspace.out, CPU2, fresh=fresh, console=Console(quiet=True), engine_factory=factory,
                        prefix_order=False)


def journal_keys(workspace, node):
    lines = (workspace.out / ".batchllm" / "journal" / f"{node}.jsonl").read_text().splitlines()[1:]
    import json

    return [(json.loads(line)["row_id"], json.loads(line)["step"]) for line in lines]


def test_ensemble_outputs_and_one_shared_engine(workspace):
    factory = FakeEngineFactory()
    result, _ = run(workspace, ENSEMBLE_DAG, factory)
    assert result.engines_started == 1  # three nodes, one model: loaded once
    judged = pq.read_table(workspace.out / "judged.parquet").to_pylist()
    assert judged[0] == {"row_id": "q1", "question": "What is a prime number?",
                         "verdict": "<J <A What is a prime number?> | <B What is a prime number?>>",
                         "a_tokens": len("<A What is a prime number?>")}
    nodes = pq.read_table(workspace.out / "nodes" / "a.parquet")
    assert nodes.column_names == ["row_id", "step", "text", "num_prompt_tokens", "num_output_tokens", "finish_reason"]
    assert nodes.num_rows == 4


def test_a_finished_run_starts_no_engine_when_run_again(workspace):
    run(workspace, ENSEMBLE_DAG, FakeEngineFactory())
    again = FakeEngineFactory()
    result, _ = run(workspace, ENSEMBLE_DAG, again)
    assert result.engines_started == 0 and again.started == []


def test_resume_after_a_driver_crash_is_exactly_once(workspace):
    with pytest.raises(DriverCrash):
        run(workspace, ENSEMBLE_DAG, FakeEngineFactory(crash_after_results=6))  # dies inside node b
    assert len(journal_keys(workspace, "a")) == 4 and len(journal_keys(workspace, "b")) == 2
    resumed = FakeEngineFactory()
    run(workspace, ENSEMBLE_DAG, resumed)
    assert sorted(r.request_id for r in resumed.requests) == ["b:q3:0", "b:q4:0"] + [f"judge:q{i}:0" for i in range(1, 5)]
    for node in ("a", "b", "judge"):
        keys = journal_keys(workspace, node)
        assert sorted(keys) == [(f"q{i}", 0) for i in range(1, 5)], node


def test_engine_death_is_retried_then_the_node_fails_and_independent_nodes_finish(workspace):
    dag = ENSEMBLE_DAG.replace("judge:\n        model: ./tiny-model", "judge:\n        model: ./other-model")
    (workspace.root / "other-model").mkdir()
    (workspace.root / "other-model" / "config.json").write_text("{}")
    # a: first engine dies after 1 result, second after 1 more, third after 1 more -> node a fails;
    # b needs a fresh engine (the pool forgot the dead one) and succeeds; judge needs a, so it is skipped.
    factory = FakeEngineFactory(die_after=[1, 1, 1])
    with pytest.raises(RunIncomplete, match="node a: fake engine died; node judge: upstream node 'a' failed"):
        run(workspace, dag, factory)
    assert len(journal_keys(workspace, "a")) == 3
    assert len(journal_keys(workspace, "b")) == 4
    judged = pq.read_table(workspace.out / "judged.parquet").to_pylist()
    assert [row["verdict"] for row in judged] == [None] * 4


def test_a_changed_node_refuses_old_results_unless_fresh(workspace):
    from batchllm.errors import UserError

    run(workspace, ENSEMBLE_DAG, FakeEngineFactory())
    changed = ENSEMBLE_DAG.replace('"B {{ question }}"', '"B2 {{ question }}"')
    with pytest.raises(UserError, match="different version of node 'b'"):
        run(workspace, changed, FakeEngineFactory())
    factory = FakeEngineFactory()
    run(workspace, changed, factory, fresh=True)
    assert len(factory.requests) == 12


def test_sampling_n_keeps_every_completion(workspace):
    factory = FakeEngineFactory()
    run(workspace, ENSEMBLE_DAG.replace('prompt: "A {{ question }}"', 'prompt: "A {{ question }}"\n        sampling: {n: 2, seed: 3}'), factory)
    table = pq.read_table(workspace.out / "nodes" / "a.parquet")
    assert table.column("texts").to_pylist()[0] == ["<A What is a prime number?>"] * 2
    assert {r.seed for r in factory.requests if r.request_id.startswith("a:")} == {3}


def test_ctrl_c_keeps_committed_results_and_says_how_to_resume(workspace, monkeypatch):
    from typer.testing import CliRunner

    from batchllm import cli
    from batchllm.runtime import launch

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "run_dag_file", interrupted)
    result = CliRunner().invoke(cli.app, ["run", str(workspace.dag(ENSEMBLE_DAG)), "--out", str(workspace.out)])
    assert result.exit_code == 130
    assert result.output == "interrupted: finished results are kept; run the same command again to resume.\n"
