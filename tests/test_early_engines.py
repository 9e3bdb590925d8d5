"""Engines started while the driver checks and plans (runtime/early_engines.py), on fake engines."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from batchllm.core.requests import ModelTask
from batchllm.dag.loader import load_dag_mapping
from batchllm.engines.devices import DeviceSet, Replica
from batchllm.engines.protocol import EngineConfig
from batchllm.runtime.early_engines import EarlyEngines, FirstEngines, first_engines_key
from batchllm.runtime.engine_set import EngineSet
from tests.fakes import FakeEngine, FakeEngineFactory

CPU2 = DeviceSet("cpu", (0, 1))


def config(model: str = "/models/a", cores: tuple[int, ...] = (0,), log: str | None = None, **fields) -> EngineConfig:
    return EngineConfig(model=model, replica=Replica("cpu", cores), max_num_seqs=8, log_path=log, **fields)


class StoppableFake(FakeEngine):
    """A fake engine that says how it was stopped."""

    def __init__(self, config):
        super().__init__(config)
        self.how: str | None = None

    def stop(self):
        self.how = "stop"

    def stop_now(self):
        self.how = "at once"


def early_of(*configs: EngineConfig) -> tuple[EarlyEngines, dict[str, StoppableFake]]:
    engines = {c.model: StoppableFake(c) for c in configs}
    return EarlyEngines({c.sharing_key(): engines[c.model] for c in configs}), engines


def dag(tmp_path: Path, model: str = "/models/a", engine: dict | None = None, prompt: str = "{{ q }}"):
    mapping = {"name": "d", "inputs": {"rows": {"path": str(tmp_path / "rows.parquet")}},
               "nodes": {"answer": {"model": model, "prompt": prompt}}, "outputs": {}}
    if engine:
        mapping["engine"] = engine
    return load_dag_mapping(mapping, tmp_path, "dag")


def test_the_first_engines_are_kept_per_key_without_their_log_and_read_back_equal(tmp_path):
    store = FirstEngines(tmp_path)
    kept = [config(cores=(0,), log="/runs/x/engine.log"), config("/models/e", (1,), task=ModelTask.EMBED, max_loras=2, max_lora_rank=8)]
    store.save("k1", kept)
    store.save("k2", [config("/models/b")])
    assert store.load("k1") == [replace(c, log_path=None) for c in kept]
    assert [c.model for c in store.load("k2")] == ["/models/b"] and store.load("k3") == []


def test_an_unreadable_or_foreign_file_gives_no_guess(tmp_path):
    (tmp_path / "first-engines.json").write_text("{not json")
    assert FirstEngines(tmp_path).load("k") == []
    (tmp_path / "first-engines.json").write_text(json.dumps({"k": {"at": 1, "configs": [{"model": "m", "unknown": 1}]}}))
    assert FirstEngines(tmp_path).load("k") == []


def test_the_key_follows_models_devices_and_engine_settings_not_prompts(tmp_path):
    base = first_engines_key(dag(tmp_path), CPU2, "plan", "vllm 1")
    assert first_engines_key(dag(tmp_path, prompt="Answer: {{ q }}"), CPU2, "plan", "vllm 1") == base
    assert first_engines_key(dag(tmp_path, model="/models/b"), CPU2, "plan", "vllm 1") != base
    assert first_engines_key(dag(tmp_path), DeviceSet("cpu", (0,)), "plan", "vllm 1") != base
    assert first_engines_key(dag(tmp_path, engine={"max_num_seqs": 4}), CPU2, "plan", "vllm 1") != base
    assert first_engines_key(dag(tmp_path), CPU2, "sequential", "vllm 1") != base
    assert first_engines_key(dag(tmp_path), CPU2, "plan", "vllm 2") != base


def test_the_first_reconcile_adopts_the_early_engine_it_wants_whatever_its_log_and_stops_the_others_at_once():
    early, engines = early_of(config("/models/a", log="/home/engine-logs/1.log"), config("/models/b", (1,)))
    factory = FakeEngineFactory()
    engine_set = EngineSet(factory, early)
    wanted = [config("/models/a", log="/runs/out/.batchllm/logs/a.log"), config("/models/c", (1,))]
    stopped, failed = engine_set.reconcile(wanted)
    assert (stopped, failed) == ([], [])
    assert engine_set.of(wanted[0]).engine is engines["/models/a"] and engines["/models/a"].how is None
    assert engine_set.of(wanted[0]).config == wanted[0]  # the run's config (its steps and losses name it), not the early log's
    assert engines["/models/b"].how == "at once"
    assert [e.config.model for e in factory.started] == ["/models/c"]  # only what no early engine serves is started
    assert engine_set.first_wanted == wanted and len(early) == 0
    engine_set.reconcile([config("/models/b", (1,))])  # a later stage: early engines are gone, it starts its own
    assert [e.config.model for e in factory.started] == ["/models/c", "/models/b"]


def test_early_engines_no_reconcile_adopted_are_stopped_with_the_run():
    early, engines = early_of(config("/models/a"))
    EngineSet(FakeEngineFactory(), early).stop_all()
    assert engines["/models/a"].how == "at once"


def test_early_engines_log_into_the_home_and_an_adopted_ones_log_is_linked_into_the_run_folder(tmp_path):
    factory = FakeEngineFactory()
    early = EarlyEngines.start([config("/models/a")], factory, tmp_path / "home")
    [engine] = factory.started
    assert Path(engine.config.log_path).parent == tmp_path / "home" / "engine-logs"
    Path(engine.config.log_path).write_text("loading\n")
    run_log = tmp_path / "out" / ".batchllm" / "logs" / "engine-a.log"
    assert early.take(config("/models/a", log=str(run_log))) is engine
    assert run_log.is_symlink() and run_log.read_text() == "loading\n"
    assert early.take(config("/models/a")) is None and early.stop_rest() == 0


def test_early_engines_are_planned_as_their_nodes_engines_still_loading(workspace, profiles):
    """Two one-core engines of the DAG's model started early: the first node of that model owns
    them as dp2 on both cores; a stage that keeps them pays only what is left of their start,
    so the estimate is shorter by the time they have loaded."""
    from batchllm.dag.loader import load_dag
    from batchllm.planner.plan_file import plan_dag
    from batchllm.planner.timeline import LoadingEngine
    from batchllm.runtime.early_engines import early_plans
    from tests.conftest import ENSEMBLE_DAG

    spec = load_dag(workspace.dag(ENSEMBLE_DAG))
    model = str(workspace.root / "tiny-model")
    configs = [config(model, (0,)), config(model, (1,)), config("/models/other", (0,))]
    plans = early_plans(configs, spec, CPU2, workspace.root, loading_for_s=3.0)
    assert list(plans) == ["a"] and str(plans["a"].plan) == "dp2xw1-tp1" and plans["a"].devices == (0, 1)
    assert plans["a"].loading_for_s == 3.0
    on_one = early_plans(configs, spec, DeviceSet("cpu", (1, 2)), workspace.root, 3.0)  # core 0 is not this run's
    assert str(on_one["a"].plan) == "dp1xw1-tp1" and on_one["a"].devices == (0,)  # core 1: the run's first device
    devices = "cpu:2"
    plain = plan_dag(spec, devices, profiles_root=profiles)
    first = plain.chosen.stages[0]
    kept = {name: LoadingEngine(plan, tuple(first.placement[name]), 3.0) for name, plan in first.plans.items()}
    early = plan_dag(spec, devices, profiles_root=profiles, loading=kept)
    assert plain.chosen.total_s - 3.5 < early.chosen.total_s < plain.chosen.total_s - 1.0
