"""`Executor.step()` one turn at a time on a scripted engine: what each turn admits,
submits, collects and commits, as the ledger counts it and the step result says it."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from rich.console import Console

from batchllm.costmodel.output_lengths import MAX_TOKENS
from batchllm.dag.loader import load_dag
from batchllm.engines.devices import DeviceSet
from batchllm.engines.engine import EngineFailed
from batchllm.io.dag_checks import check_dag
from batchllm.runtime.executor import Executor
from batchllm.runtime.ledger import UnitStatus
from batchllm.runtime.node_run import NodeStatus
from batchllm.runtime.prepare import RequestPreparer
from batchllm.runtime.progress import RunProgress
from batchllm.runtime.run_dir import RunDir
from batchllm.runtime.run_spec import RunInputs, RunSpec
from batchllm.runtime.sequential_stages import SequentialStages
from batchllm.runtime.stage_chooser import RunPlanning
from tests.conftest import ENSEMBLE_DAG
from tests.fakes import FakeEngineFactory
from tests.test_executor import CPU2


class InlinePreparer(RequestPreparer):
    """Prepares a window at once, in the calling thread, so every turn is deterministic."""

    def submit(self, requests, model_dir, block_size, replicas, forecast=MAX_TOKENS) -> Future:
        done: Future = Future()
        done.set_result(self._prepare(None, requests, block_size, replicas, forecast))
        return done


def counts(executor: Executor, node: str) -> dict[str, int]:
    return {s.name: int(executor.ledger[node].counts[s]) for s in UnitStatus if executor.ledger[node].counts[s]}


@pytest.fixture
def executor(workspace, isolated_home):
    dag = load_dag(workspace.dag(ENSEMBLE_DAG))
    run_dir = RunDir(workspace.out)
    run_dir.open(fresh=False)
    factory = FakeEngineFactory()  # each engine answers at most 3 requests per poll and runs 8 at once
    with RunProgress(Console(quiet=True)) as progress:
        executor = Executor(RunSpec(workspace.out, CPU2, home=isolated_home), RunInputs(dag, check_dag(dag, isolated_home)), run_dir,
                            factory, progress, RunPlanning(SequentialStages(CPU2, dag.topological_order())),
                            InlinePreparer(prefix_order=False))
        executor.open()
        yield executor
        executor.engines.stop_all()
        for node in executor.nodes:
            node.journal.close()
    run_dir.close()


def test_each_turn_admits_submits_collects_and_commits(executor):
    assert counts(executor, "a") == {"WAITING": 4}
    executor.begin_stage()
    assert executor.stage_nodes == ("a",)

    first = executor.step()  # the feed admits the 4 rows and renders them; nothing is in an engine yet
    assert (first.submitted, first.committed, first.ended) == (0, 0, ())
    assert counts(executor, "a") == {"QUEUED": 4}

    second = executor.step()  # the prepared window goes to the engine, which answers 3
    assert (second.submitted, second.committed, second.ended) == (4, 3, ())
    assert [(c.node, len(c.results)) for c in second.commits] == [("a", 3)]
    assert counts(executor, "a") == {"RUNNING": 1, "COMMITTED": 3}
    assert executor.nodes["a"].journal.stats().committed == 3
    assert not executor.stage_over()

    third = executor.step()  # the last one: the node is settled and the stage is over
    assert (third.submitted, third.committed, third.ended) == (0, 1, ("a",))
    assert counts(executor, "a") == {"COMMITTED": 4}
    assert counts(executor, "judge") == {"WAITING": 4}  # it reads b, which has not run
    assert executor.stage_over()


def test_a_lost_engine_gives_its_units_back_in_the_same_turn(executor):
    executor.begin_stage()
    executor.step()
    (engine,) = executor.engines.running.values()
    engine.engine._die_after = 0  # dies at its next poll, with the 4 units inside
    result = executor.step()
    assert (result.submitted, result.committed) == (4, 0)
    assert [loss.cause for loss in result.losses] == ["fake engine: died"]
    assert counts(executor, "a") == {"READY": 4}  # READY again, to be queued for the restarted engine
    assert executor.nodes["a"].feed.has_more()


def test_step_is_the_loops_one_call_from_the_first_stage_to_the_last(executor):
    """Stages begin and end inside `step()`, engines start and are handed over, and every node
    finishes; `None` once nothing is left to run."""
    results = []
    while (result := executor.step()) is not None:
        results.append(result)
        assert len(results) < 1_000, "the run does not end"
    assert {node.name: node.status for node in executor.nodes} == {n: NodeStatus.FINISHED for n in ("a", "b", "judge")}
    assert [name for r in results for name in r.ended] == ["a", "b", "judge"]
    assert sum(r.committed for r in results) == 12  # 4 rows, 3 nodes: each unit once
    assert [list(stage.nodes) for stage in executor.report.stages] == [["a"], ["b"], ["judge"]]  # sequential: a node a stage
    assert {n: executor.nodes[n].journal.stats().committed for n in ("a", "b", "judge")} == {"a": 4, "b": 4, "judge": 4}


class OneCoreLeft:
    """A cluster whose node holding core 1 is gone: the rest is planned on core 0 alone."""

    def __init__(self, dag):
        self.dag, self.asked = dag, 0

    def after_loss(self, devices):
        self.asked += 1
        if len(devices.ids) == 1:
            return None  # an engine's own failure, not a lost node
        left = DeviceSet("cpu", (0,))
        return left, RunPlanning(SequentialStages(left, self.dag.topological_order()))


class FirstStartLost(FakeEngineFactory):
    """Its first engine never starts (its cluster node is gone); the rest do."""

    def __call__(self, config):
        if not getattr(self, "failed_once", False):
            self.failed_once = True
            raise EngineFailed("engine on core 0-1", "the node holding its devices is gone")
        return super().__call__(config)


def test_devices_lost_as_a_stage_starts_its_engines_end_it_before_any_turn_and_the_rest_is_replanned(workspace, isolated_home):
    dag = load_dag(workspace.dag(ENSEMBLE_DAG))
    run_dir = RunDir(workspace.out)
    run_dir.open(fresh=False)
    replanner = OneCoreLeft(dag)
    with RunProgress(Console(quiet=True)) as progress:
        executor = Executor(RunSpec(workspace.out, CPU2, home=isolated_home), RunInputs(dag, check_dag(dag, isolated_home)), run_dir,
                            FirstStartLost(), progress, RunPlanning(SequentialStages(CPU2, dag.topological_order())),
                            InlinePreparer(prefix_order=False), replanner=replanner)
        executor.open()
        results = []
        while (result := executor.step()) is not None:
            results.append(result)
            assert len(results) < 1_000, "the run does not end"
        executor.engines.stop_all()
        for node in executor.nodes:
            node.journal.close()
    run_dir.close()
    assert replanner.asked >= 1 and executor.devices.ids == (0,)
    first = executor.report.stages[0]  # planned on both cores, over as it began: no engine, no turn
    assert first.engine_busy_s == {} and [n.units_after - n.units_before for n in first.nodes.values()] == [0]
    assert {n: executor.nodes[n].journal.stats().committed for n in ("a", "b", "judge")} == {"a": 4, "b": 4, "judge": 4}
