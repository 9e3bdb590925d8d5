"""The engines running now: one per replica (model + engine settings + devices), each
with a slot number that the ledger records for the units it runs.

A stage says which replicas it wants; `reconcile` stops the others (the ledger hands
their units back to be queued again, by slot) and starts the missing ones side by side.
An engine serves whichever node the stage gives it: a node that takes over an idle
engine of its model and devices pays no start, and results of a node that lost its
engine to another node of the same model still arrive and are kept.

Invariant: a slot number names one engine for the whole run (never reused), so a unit
the ledger has RUNNING on a slot is in that engine until its result is polled or the
engine is reported lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from batchllm.core.requests import EngineRequest, EngineResult
from batchllm.engines.engine import Engine, EngineFactory, EngineFailed
from batchllm.engines.protocol import EngineConfig, StepRecord
from batchllm.runtime.early_engines import EarlyEngines


@dataclass(frozen=True)
class RunningEngine:
    engine: Engine
    slot: int
    config: EngineConfig  # as the run wants it (an early engine's own names another log file)


@dataclass(frozen=True)
class EngineStart:
    config: EngineConfig
    load_time_s: float  # from launch until ready, as the driver waited for it


@dataclass(frozen=True)
class EngineLoss:
    config: EngineConfig
    slot: int
    cause: str | None  # None: stopped on purpose


@dataclass(frozen=True)
class Polled:
    results: list[EngineResult]
    steps: list[tuple[EngineConfig, StepRecord]]
    losses: list[EngineLoss]


class EngineSet:
    def __init__(self, factory: EngineFactory, early: EarlyEngines | None = None):
        """`early`: engines started before the run (early_engines.py), adopted by the first
        reconcile where it wants them; it stops the others before starting any."""
        self._factory, self._early = factory, early
        self.running: dict[tuple, RunningEngine] = {}
        self.starts: list[EngineStart] = []
        self.first_wanted: list[EngineConfig] = []  # what the first reconcile wanted: the next command's early engines
        self._next_slot = 0

    def get(self, config: EngineConfig) -> RunningEngine | None:
        return self.running.get(config.sharing_key())

    def of(self, config: EngineConfig) -> RunningEngine:
        """The engine of a replica that runs (every replica a stage assigns, once reconciled)."""
        return self.running[config.sharing_key()]

    def reconcile(self, wanted: list[EngineConfig]) -> tuple[list[EngineLoss], list[EngineLoss]]:
        """Keep the wanted engines that run, stop the rest, start the missing ones in
        parallel. Returns (stopped, failed to start)."""
        keys = {c.sharing_key(): c for c in wanted}
        stopped = self._stop_many([key for key in self.running if key not in keys])
        missing = [c for key, c in keys.items() if key not in self.running]
        failed: list[EngineLoss] = []
        self.first_wanted = self.first_wanted or list(wanted)
        adopted = self._adopt_early(missing)
        launched_at = time.monotonic()
        launched = [(config, adopted.get(config.sharing_key()) or self._launch(config)) for config in missing]  # all load side by side
        for config, outcome in launched:
            if not isinstance(outcome, EngineFailed):
                try:
                    outcome.ready  # noqa: B018  waits for this one; the others keep loading meanwhile
                except EngineFailed as failure:
                    outcome.stop()
                    outcome = failure
            if isinstance(outcome, EngineFailed):
                failed.append(EngineLoss(config, -1, str(outcome)))
            else:
                self.running[config.sharing_key()] = RunningEngine(outcome, self._next_slot, config)
                self._next_slot += 1
                # the worker times its engine's load; the driver also sees process start and imports
                self.starts.append(EngineStart(config, max(outcome.ready.load_time_s, time.monotonic() - launched_at)))
        return stopped, failed

    def _adopt_early(self, missing: list[EngineConfig]) -> dict[tuple, Engine]:
        """The early engines these configs want (once, at the first reconcile); the others stopped."""
        if self._early is None:
            return {}
        early, self._early = self._early, None
        adopted = {c.sharing_key(): engine for c in missing if (engine := early.take(c)) is not None}
        early.stop_rest()
        return adopted

    def early_loading(self) -> tuple[list[EngineConfig], float] | None:
        """The early engines no reconcile has adopted yet, and how long they have been loading."""
        if self._early is None or not len(self._early):
            return None
        return self._early.configs(), time.monotonic() - self._early.started_at

    def stop_early(self) -> None:
        """Stop early engines no reconcile adopted (a run that ended before its first stage)."""
        if self._early is not None:
            self._early.stop_rest()
            self._early = None

    def _launch(self, config: EngineConfig) -> Engine | EngineFailed:
        """Start an engine from this (the main) thread; see process_engine on why."""
        try:
            return self._factory(config)
        except EngineFailed as failure:
            return failure

    def _stop(self, key: tuple, cause: str | None) -> EngineLoss:
        running = self.running.pop(key)
        running.engine.stop()
        return EngineLoss(running.config, running.slot, cause)

    def submit(self, config: EngineConfig, requests: list[EngineRequest]) -> None:
        self.running[config.sharing_key()].engine.submit(requests)

    def poll(self, timeout_s: float, busy: Callable[[int], bool]) -> Polled:
        """Results and step records of every engine, waiting only on `busy` slots; an
        engine that died is dropped and reported."""
        results: list[EngineResult] = []
        steps: list[tuple[EngineConfig, StepRecord]] = []
        losses: list[EngineLoss] = []
        wait_s = timeout_s / max(len(self.running), 1)
        for key, running in list(self.running.items()):
            try:
                batch = running.engine.poll(timeout_s=wait_s if busy(running.slot) else 0.0)
            except EngineFailed as failure:
                losses.append(self._stop(key, cause=str(failure)))
                continue
            results.extend(batch)
            steps.extend((running.config, step) for step in running.engine.drain_steps())
        if not self.running:
            time.sleep(min(timeout_s, 0.05))
        return Polled(results, steps, losses)

    def _stop_many(self, keys: list[tuple]) -> list[EngineLoss]:
        """Stop engines on purpose, side by side (each waits for its worker to shut down)."""
        stopping = [self.running.pop(key) for key in keys]
        if stopping:
            with ThreadPoolExecutor(max_workers=len(stopping), thread_name_prefix="engine-stop") as pool:
                list(pool.map(lambda running: running.engine.stop(), stopping))
        return [EngineLoss(running.config, running.slot, None) for running in stopping]

    def stop_all(self) -> list[EngineLoss]:
        self.stop_early()
        return self._stop_many(list(self.running))
