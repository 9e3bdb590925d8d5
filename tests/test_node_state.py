"""A node's run state is one record (`NodeRun`), and only `NodeRuns` maps node names to it
(issue 71): walked on an executor of a three-node DAG as it runs, no other runtime object keeps
a mapping keyed by node name; and a field added to `NodeRun` is read where the progress and the
report reach the node, with no other class touched."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from batchllm.runtime.executor import Executor
from batchllm.runtime.node_run import NodeRun, NodeRuns, NodeStatus
from tests.test_executor_step import executor as opened

executor = opened  # the fixture: ENSEMBLE_DAG's a, b and judge, opened on a scripted engine
MAX_DEPTH = 8
# What is not a node's run state: the DAG as given (its spec, `executor.dag`), and the run's
# history as run.json records it, one entry per stage (the stage logs, the current one
# included) and the DAG's node -> model there.
NOT_RUN_STATE = ("executor.dag", "executor.stage.nodes", "executor.recorder.log.nodes", "executor.report.models")
HISTORY = "executor.report.stages["


def node_keyed(root: object, names: frozenset[str]) -> Iterator[str]:
    """The paths from `root` to every mapping whose keys are all node names, through batchllm's
    objects and the containers they hold (NodeRuns and the NodeRun records excepted)."""
    seen: set[int] = set()

    def walk(value: object, path: str, depth: int) -> Iterator[str]:
        if depth > MAX_DEPTH or id(value) in seen or isinstance(value, (NodeRuns, NodeRun, np.ndarray, str, bytes, int, float)):
            return
        seen.add(id(value))
        if isinstance(value, dict):
            if value and all(isinstance(k, str) and k in names for k in value):
                yield path
            for key, item in value.items():
                yield from walk(item, f"{path}[{key!r}]", depth + 1)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for index, item in enumerate(value):
                yield from walk(item, f"{path}[{index}]", depth + 1)
        elif type(value).__module__.startswith("batchllm."):
            fields = dict(vars(value)) if hasattr(value, "__dict__") else {}
            fields |= {slot: getattr(value, slot) for slot in getattr(type(value), "__slots__", ()) if hasattr(value, slot)}
            for name, item in fields.items():
                yield from walk(item, f"{path}.{name}", depth + 1)

    yield from walk(root, "executor", 0)


def run_a_while(runner: Executor, turns: int) -> None:
    for _ in range(turns):
        if runner.step() is None:
            return


def test_no_runtime_object_but_node_runs_keeps_a_map_by_node_name(executor):
    names = frozenset(executor.dag.nodes)
    assert names == {"a", "b", "judge"}
    run_a_while(executor, 8)
    assert any(run.status is NodeStatus.FINISHED for run in executor.nodes) and executor.progress.stats
    found = [path for path in node_keyed(executor, names)
             if not path.startswith(NOT_RUN_STATE) and not (path.startswith(HISTORY) and path.endswith("].nodes"))]
    assert found == [], found


def test_a_field_added_to_node_run_is_the_one_the_progress_and_the_report_read(executor, monkeypatch):
    """A per-node feature is a field of the node's record: here one added at test time (a
    failure count of its own, say), set on the record and read where the progress and the
    report reach the node, without a change to any other class."""
    monkeypatch.setattr(NodeRun, "late_answers", 0, raising=False)  # the new field, default 0
    run_a_while(executor, 8)
    a = executor.nodes["a"]
    a.late_answers = 2  # type: ignore[attr-defined]
    # the progress: its counters of a node are the node's own, reached from the record
    assert executor.progress.stats["a"] is a.stats
    assert [s.node for s in executor.progress.stats.values()] == [run.name for run in executor.nodes if run.stats is not None]
    assert executor.progress.stats["a"] is next(run for run in executor.nodes if run.late_answers == 2).stats
    # the report: the failures it writes are the records' own, read when it is given them at the end
    judge = executor.nodes["judge"]
    executor.nodes.fail(judge, f"{a.late_answers} late answers of a")  # type: ignore[attr-defined]
    assert judge.status is NodeStatus.FAILED and judge.pilot is None
    executor.report.finish(1.0, executor.nodes.failures())
    assert executor.report.failed == {"judge": "2 late answers of a"}
    assert executor.report.to_dict()["failed"] == {"judge": "2 late answers of a"}
