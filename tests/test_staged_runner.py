"""The planned executor with a scripted engine: stages on disjoint devices, engine
hand-over, exactly-once results across driver crashes and engine deaths, run.json."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchllm.engines.devices import DeviceSet, hardware_name
from batchllm.io.inputs import ROW_ID, InputTable
from batchllm.runtime.launch import run_dag_file
from batchllm.runtime.node_work import NodeWork
from batchllm.dag.model import NodeSpec, SamplingSpec
from tests.conftest import ENSEMBLE_DAG
from tests.fakes import DriverCrash, FakeEngineFactory

CPU2 = DeviceSet("cpu", (0, 1))
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def profiles(tmp_path) -> Path:
    """The embedded model's measured CPU profile, filed for the fake model directory."""
    root = tmp_path / "profiles"
    shutil.copytree(REPO / "profiles" / "cpu-intel-xeon" / "smollm2-135m", root / hardware_name("cpu") / "tiny-model",
                    ignore=shutil.ignore_patterns("logs"))
    return root


def run(workspace, profiles, factory, schedule="plan", dag_text=ENSEMBLE_DAG, out=None):
    return run_dag_file(workspace.dag(dag_text), out or workspace.out, CPU2, console=Console(quiet=True),
                        engine_factory=factory, prefix_order=False, schedule=schedule, profiles_root=profiles)


def journal_keys(out: Path, node: str) -> list[tuple[str, int]]:
    lines = (out / ".batchllm" / "journal" / f"{node}.jsonl").read_text().splitlines()[1:]
    return [(json.loads(line)["row_id"], json.loads(line)["step"]) for line in lines]


ALL_KEYS = [(f"q{i}", 0) for i in range(1, 5)]


def test_plan_runs_the_two_generators_side_by_side_then_the_judge(workspace, profiles):
    factory = FakeEngineFactory()
    run(workspace, profiles, factory)
    report = json.loads((workspace.out / "run.json").read_text())
    first = report["stages"][0]["nodes"]
    assert set(first) == {"a", "b"} and first["a"]["devices"] != first["b"]["devices"]
    assert {d for n in first.values() for d in n["devices"]} == {0, 1}
    assert report["schedule"] == "plan" and report["estimated_s"] > 0
    judged = pq.read_table(workspace.out / "judged.parquet").to_pylist()
    assert judged[0]["verdict"] == "<J <A What is a prime number?> | <B What is a prime number?>>"
    for node in ("a", "b", "judge"):
        assert sorted(journal_keys(workspace.out, node)) == ALL_KEYS
    # every engine ran on one core, and the judge took over the generators' engines
    assert all(len(e.config.replica.device_ids) == 1 for e in factory.started)
    assert len(factory.started) == 2


def test_max_heuristic_runs_one_node_at_a_time_on_both_cores(workspace, profiles):
    factory = FakeEngineFactory()
    run(workspace, profiles, factory, schedule="max")
    report = json.loads((workspace.out / "run.json").read_text())
    assert [list(s["nodes"]) for s in report["stages"]] == [["a"], ["b"], ["judge"]]
    assert all(n["devices"] == [0, 1] for s in report["stages"] for n in s["nodes"].values())


def test_driver_killed_at_random_points_then_resumed_gives_an_uninterrupted_runs_output(workspace, profiles, tmp_path):
    clean = tmp_path / "clean"
    run(workspace, profiles, FakeEngineFactory(), out=clean)
    rng = random.Random(5)
    crashes = 0
    while True:  # killed after 1-3 results of some engine, again and again, until a run gets through
        try:
            run(workspace, profiles, FakeEngineFactory(crash_after_results=rng.randint(1, 3)))
            break
        except DriverCrash:
            crashes += 1
    assert crashes >= 3
    for node in ("a", "b", "judge"):
        keys = journal_keys(workspace.out, node)
        assert sorted(keys) == ALL_KEYS and len(set(keys)) == len(keys), node
    assert pq.read_table(workspace.out / "judged.parquet").equals(pq.read_table(clean / "judged.parquet"))


def test_a_worker_that_dies_mid_stage_is_restarted_and_nothing_is_lost_or_repeated(workspace, profiles):
    factory = FakeEngineFactory(die_after=[1])  # the first engine started dies after one result
    run(workspace, profiles, factory)
    for node in ("a", "b", "judge"):
        keys = journal_keys(workspace.out, node)
        assert sorted(keys) == ALL_KEYS, node
    assert len(factory.started) == 3  # one restart


def _node_work(where: str | None) -> tuple[NodeWork, list[str]]:
    rows = ["r1", "r2", "r3"]
    table = InputTable(None, pa.table({ROW_ID: rows, "text": ["x", "y", "z"]}))
    node = NodeSpec(name="c", model="m", input_name="t", prompt="{{ text }} {{ router }}", system=None, chat=True,
                    sampling=SamplingSpec(), where=where, iterate=None, line=1, upstream=("router",))
    return NodeWork(node, table, {"router": {}}, {}), rows


def test_a_consumer_gets_rows_as_its_producer_finishes_them():
    work, _ = _node_work(where="router = 'yes'")
    assert work.ready_requests() == [] and work.total_units == 0
    work.add_upstream("router", {"r1": "yes", "r2": "no"})
    assert [r.request_id for r in work.ready_requests()] == ["c:r1:0"]
    work.add_upstream("router", {"r3": "yes"})
    assert [r.request_id for r in work.ready_requests()] == ["c:r3:0"]
    assert work.total_units == 2


def test_requests_lost_with_an_engine_are_handed_out_again_once():
    work, _ = _node_work(where=None)
    work.add_upstream("router", {"r1": "a", "r2": "b"})
    sent = work.ready_requests()
    work.requeue([sent[0].request_id])
    assert [r.request_id for r in work.ready_requests()] == [sent[0].request_id]
    assert work.ready_requests() == []


def test_an_engine_is_handed_no_more_requests_than_it_runs_at_once(workspace, profiles):
    rows = 40
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(rows)], "question": [f"Question {i}?" for i in range(rows)]}),
                   workspace.root / "questions.parquet")
    factory = FakeEngineFactory()
    run(workspace, profiles, factory)
    assert {e.ready.max_num_seqs for e in factory.started} == {8}
    assert max(e.most_queued for e in factory.started) == 8  # the rest waited in the driver's backlog
    for node in ("a", "b", "judge"):
        assert sorted(journal_keys(workspace.out, node)) == sorted((f"r{i}", 0) for i in range(rows))
