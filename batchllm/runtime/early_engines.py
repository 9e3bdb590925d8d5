"""Engines that start while the driver checks and plans.

A command's first engines follow from its DAG's models, its devices and its engine settings
far more often than from its data, so the engines the last such command started first are
kept (`FirstEngines`, `$BATCHLLM_HOME/first-engines.json`, by `first_engines_key`) and the
next command starts them as it begins (`EarlyEngines.start`), before its checks, its length
models and its plan. The run's first reconcile (`EngineSet`) adopts those the plan wants
(same sharing key) and stops the others before it starts any engine of its own, so a wrong
guess costs the cores only while the driver checks and plans, never beside a stage.

Invariant: an early engine is either adopted by the run or stopped; a check that fails stops
them all before its exit (nothing written: their logs are in `$BATCHLLM_HOME/engine-logs/`,
the run folder gets a link to an adopted one's log).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from batchllm.core.errors import UserError
from batchllm.core.files import write_text_atomically
from batchllm.core.requests import ModelTask
from batchllm.costmodel.estimator import ExecutionPlan
from batchllm.costmodel.profile import ReplicaShape
from batchllm.dag.model import DagSpec
from batchllm.engines.devices import DeviceSet, Replica
from batchllm.engines.engine import Engine, EngineFactory, EngineFailed
from batchllm.engines.protocol import EngineConfig
from batchllm.models.registry import resolve_model
from batchllm.runtime.run_state import RunningPlan

GUESSES_FILE = "first-engines.json"
LOGS_FOLDER = "engine-logs"
KEEP_GUESSES = 64  # commands of other DAGs kept (the oldest dropped)
KEEP_LOGS = 32


def first_engines_key(dag: DagSpec, devices: DeviceSet, schedule: str, engine_version: str | None) -> str:
    """What decides a command's first engines, short of its data: the models of its nodes on
    devices with their tasks and adapters, the devices, the engine settings, the schedule."""
    nodes = sorted({(node.model, str(node.task), node.adapter or "") for name, node in dag.nodes.items() if not dag.on_endpoints(name)})
    return hashlib.sha256(json.dumps([nodes, str(devices), repr(dag.engine), schedule, engine_version]).encode()).hexdigest()[:32]


def _config_to_json(config: EngineConfig) -> dict:
    return {**asdict(replace(config, log_path=None)), "task": config.task.value}


def _config_from_json(data: dict) -> EngineConfig:
    replica = Replica(**{**data["replica"], "device_ids": tuple(data["replica"]["device_ids"])})
    return EngineConfig(**{**data, "replica": replica, "task": ModelTask(data["task"])})


class FirstEngines:
    """The first engines of the last command of each key."""

    def __init__(self, home: Path):
        self.path = home / GUESSES_FILE

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def load(self, key: str) -> list[EngineConfig]:
        try:
            return [_config_from_json(c) for c in self._read().get(key, {}).get("configs", [])]
        except (TypeError, KeyError, ValueError):
            return []  # written by another version: no guess

    def save(self, key: str, configs: list[EngineConfig]) -> None:
        kept = {k: v for k, v in self._read().items() if k != key}
        kept = dict(sorted(kept.items(), key=lambda item: item[1].get("at", 0))[-(KEEP_GUESSES - 1):])
        kept[key] = {"at": time.time(), "configs": [_config_to_json(c) for c in configs if c.endpoint is None]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(self.path, json.dumps(kept) + "\n")


def kept_first_engines(home: Path, key: str) -> list[EngineConfig]:
    """The engines a command of `key` starts early: those kept for it whose model is still here."""
    return [c for c in FirstEngines(home).load(key) if Path(c.model).is_dir()]


def early_plans(configs: list[EngineConfig], dag: DagSpec, devices: DeviceSet, home: Path,
                loading_for_s: float) -> dict[str, RunningPlan]:
    """Engines started early as the planner sees them: by the DAG node whose engine they are (the
    first in topological order with their model and kind of task), a plan of their replicas and
    their devices' indices, loading for `loading_for_s`. Configs of no node, or on devices not
    in `devices`, are left out."""
    owners: dict[str, list[EngineConfig]] = {}
    for config in configs:
        owner = next((name for name in dag.topological_order() if _serves(config, dag, name, home)), None)
        if owner is not None and all(i in devices.ids for i in config.replica.device_ids):
            owners.setdefault(owner, []).append(config)
    plans = {}
    for name, own in owners.items():
        shapes = {(len(c.replica.device_ids), c.replica.tp) for c in own}
        if len(shapes) != 1:
            continue  # replicas of two shapes: no one plan
        (size, tp), = shapes
        indices = tuple(sorted(devices.ids.index(i) for c in own for i in c.replica.device_ids))
        plans[name] = RunningPlan(ExecutionPlan(len(own), ReplicaShape(size, tp)), indices, loading_for_s)
    return plans


def _serves(config: EngineConfig, dag: DagSpec, node: str, home: Path) -> bool:
    """`config` is an engine of this node's model and kind of task (its model converted here)."""
    spec = dag.nodes[node]
    if dag.on_endpoints(node) or config.task.pools != spec.task.pools:
        return False
    try:
        ref = resolve_model(spec.model, dag_dir=dag.path.parent, home=home, where=f"nodes.{node}.model")
    except UserError:
        return False
    return Path(config.model) == Path(ref.config_dir(home))


class EarlyEngines:
    def __init__(self, engines: dict[tuple, Engine], started_at: float | None = None):
        self._engines = engines
        self.started_at = time.monotonic() if started_at is None else started_at  # when their starts began

    def configs(self) -> list[EngineConfig]:
        """The early engines not taken yet, as they were started."""
        return [engine.config for engine in self._engines.values()]

    @classmethod
    def start(cls, configs: list[EngineConfig], factory: EngineFactory, home: Path) -> EarlyEngines:
        """Start these engines now (their loads go on while the caller checks and plans), each
        logging into `home`'s engine-logs folder; one that cannot start is left out."""
        started_at = time.monotonic()
        logs = home / LOGS_FOLDER
        logs.mkdir(parents=True, exist_ok=True)
        _prune(logs)
        engines: dict[tuple, Engine] = {}
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        for k, config in enumerate(configs):
            log = logs / f"{stamp}-{k}-{Path(config.model).name}.log"
            try:
                engine = factory(replace(config, log_path=str(log)))
            except EngineFailed:
                continue
            engines[config.sharing_key()] = engine
            with open(log, "a", encoding="utf-8") as header:  # the worker appends its own lines
                header.write(f"batchllm: engine process {getattr(engine, 'pid', None)} started early by command process "
                             f"{os.getpid()}, while it checks and plans\n")
        return cls(engines, started_at)

    def __len__(self) -> int:
        return len(self._engines)

    def take(self, config: EngineConfig) -> Engine | None:
        """The early engine that serves `config`, if any (its log linked into the run folder)."""
        engine = self._engines.pop(config.sharing_key(), None)
        if engine is not None and config.log_path and engine.config.log_path:
            link = Path(config.log_path)
            try:
                link.parent.mkdir(parents=True, exist_ok=True)
                link.unlink(missing_ok=True)
                link.symlink_to(engine.config.log_path)
            except OSError:
                pass  # the log stays where the engine writes it (its failures name that path)
        return engine

    def stop_rest(self) -> int:
        """Stop the early engines not taken, side by side; how many."""
        rest = list(self._engines.values())
        self._engines.clear()
        if rest:
            with ThreadPoolExecutor(max_workers=len(rest), thread_name_prefix="early-stop") as pool:
                list(pool.map(_stop_now, rest))
        return len(rest)


def _stop_now(engine: Engine) -> None:
    """An engine process ends at once (`ProcessEngine.stop_now`): a clean stop would wait for its
    load to end first. Other engines stop as they do."""
    getattr(engine, "stop_now", engine.stop)()


def _prune(logs: Path) -> None:
    old = sorted(logs.glob("*.log"), key=lambda p: p.stat().st_mtime)[:-KEEP_LOGS or None]
    for path in old:
        path.unlink(missing_ok=True)
