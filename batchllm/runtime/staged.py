"""The planned executor: execution stages of (node, plan) pairs on disjoint devices.

At every boundary the rest of the run is planned again from what actually happened
(`StagePlanner`) and its first stage runs: engines are reconciled replica by replica
(kept, handed over, stopped, started side by side), each node's ready requests are
split over its data-parallel replicas by estimated work in prefix order and handed to
an engine as it has room (`Backlog`), and a consumer in the same stage as its producer
receives rows as they are produced. The stage ends when one of its nodes finishes (or
fails).

Invariant: a (node, row, step) is committed to the journal at most once (NodeWork hands
a unit out once, and only when the journal lacks it); a request lost with its engine is
handed out again, so together with resume every unit is committed exactly once.
"""

from __future__ import annotations

import time
from pathlib import Path

from batchllm.engines.devices import DeviceSet, Replica
from batchllm.engines.process_engine import EngineFactory
from batchllm.engines.protocol import EngineConfig, EngineRequest
from batchllm.errors import RunIncomplete
from batchllm.io.inputs import InputTable
from batchllm.io.journal import ResultJournal
from batchllm.io.outputs import node_table, write_output_sets, write_parquet_atomically
from batchllm.runtime.backlog import Backlog
from batchllm.runtime.engine_configs import engine_config
from batchllm.runtime.engine_set import EngineLoss, EngineSet, request_work
from batchllm.runtime.fingerprint import node_fingerprints
from batchllm.runtime.node_work import NodeWork
from batchllm.runtime.progress import NodeStats, RunProgress
from batchllm.runtime.request_ordering import PrefixOrdering
from batchllm.runtime.run_dir import RunDir
from batchllm.runtime.run_gantt import write_run_html
from batchllm.runtime.run_report import RunReport, StageLog, engine_label
from batchllm.runtime.sequential import MAX_ENGINE_RESTARTS, RunResult
from batchllm.runtime.stage_planner import NodeProgress, RunningPlan, StagePlanner
from batchllm.dag.model import DagSpec

POLL_S = 0.2


class StagedRunner:
    def __init__(self, dag: DagSpec, tables: dict[str, InputTable], run_dir: RunDir, devices: DeviceSet,
                 engine_factory: EngineFactory, progress: RunProgress, home: Path, planner: StagePlanner,
                 ordering: PrefixOrdering | None = None):
        self.dag, self.tables, self.run_dir, self.devices = dag, tables, run_dir, devices
        self.engines = EngineSet(engine_factory)
        self.progress, self.home, self.planner, self.ordering = progress, home, planner, ordering
        self.works: dict[str, NodeWork] = {}
        self.backlogs: dict[str, Backlog] = {n: Backlog(request_work) for n in dag.nodes}
        self.finished: set[str] = set()
        self.failed: dict[str, str] = {}
        self.restarts: dict[str, int] = {}
        self.assigned: dict[str, list[EngineConfig]] = {}  # node -> its replicas in the current stage
        self.running_plans: dict[str, RunningPlan] = {}
        self.plan_since_s: dict[str, float] = {}  # node -> clock when its current plan's engines were ready
        self.owner: dict[str, str] = {}  # request id -> node
        self._started = time.monotonic()  # reset when run() starts
        self.report = RunReport(dag.name, str(devices), planner.method, models={n: s.model for n, s in dag.nodes.items()})

    # -- the run ------------------------------------------------------------------------
    def run(self) -> RunResult:
        prints = node_fingerprints(self.dag)
        self.journals = {n: ResultJournal(self.run_dir.journal_path(n), prints[n], n) for n in self.dag.nodes}
        self._started = started = time.monotonic()
        try:
            for name in self.dag.topological_order():
                node = self.dag.nodes[name]
                upstream = {u: {r: rec.text for r, rec in self.works[u].final_records().items()} for u in node.upstream}
                self.works[name] = NodeWork(node, self.tables[node.input_name], upstream, self.journals[name].records)
            self._settle()
            while self._unfinished():
                self._run_stage()
        finally:
            self.engines.stop_all()
            for name, journal in self.journals.items():
                journal.sync()
                write_parquet_atomically(node_table(list(journal.records.values()), self.dag.nodes[name].sampling.n),
                                         self.run_dir.node_path(name))
                journal.close()
            self.report.finish(time.monotonic() - started)
            if self.report.stages:
                self.report.write(self.run_dir.root / "run.json")
                write_run_html(self.report, self.devices.ids, self.run_dir.root / "run.html")
        outputs = self._write_outputs()
        if self.failed:
            raise RunIncomplete("; ".join(f"node {n}: {cause.splitlines()[0]}" for n, cause in self.failed.items()))
        return RunResult(len(self.engines.starts), dict(self.failed), outputs, self.report)

    def _unfinished(self) -> list[str]:
        return [n for n in self.dag.topological_order() if n not in self.finished and n not in self.failed]

    def _settle(self) -> None:
        """Mark nodes finished (every producer finished, every unit committed) or failed
        (a producer failed)."""
        for name in self._unfinished():
            node, work = self.dag.nodes[name], self.works[name]
            blocked = [u for u in node.upstream if u in self.failed]
            if blocked:
                self.failed[name] = f"upstream node {blocked[0]!r} failed"
            elif all(u in self.finished for u in node.upstream) and work.is_finished():
                self.finished.add(name)
                if name in self.progress.stats:
                    self.progress.finish_node(name)

    # -- one stage ------------------------------------------------------------------------
    def _clock_s(self) -> float:
        return time.monotonic() - self._started

    def _run_stage(self) -> None:
        now_s = self._clock_s()
        choice = self.planner.choose(self._progress(now_s), {n: r for n, r in self.running_plans.items() if n not in self.failed})
        stage = choice.stage
        self.report.plan_made(choice.schedule, self.devices.ids)
        log = StageLog(len(self.report.stages), now_s, stage.duration_s, choice.rest_s, choice.search_s)
        self.assigned = {}
        for name, plan in stage.plans.items():
            size = plan.shape.devices
            ids = [self.devices.ids[i] for i in stage.placement[name]]
            replicas = [Replica(self.devices.kind, tuple(ids[k * size:(k + 1) * size]), plan.shape.tp) for k in range(plan.dp)]
            self.assigned[name] = [engine_config(self.dag, self.dag.nodes[name].model, r, self.run_dir, self.home) for r in replicas]
            log.add_node(name, str(plan), ids, self.works[name].done_units)
            self._start_progress(name)
        kept = {n for n, p in stage.plans.items() if self.running_plans.get(n) == RunningPlan(p, stage.placement[n])}
        self.running_plans = {n: RunningPlan(p, stage.placement[n]) for n, p in stage.plans.items()}
        if self.ordering is not None:
            for configs in self.assigned.values():
                self.ordering.preload(configs[0].model)
        self._reconcile(log)
        self.plan_since_s = {n: self.plan_since_s[n] if n in kept else self._clock_s() for n in stage.plans}
        for name, configs in self.assigned.items():
            self.backlogs[name].regroup(len(configs), lambda batch, parts, name=name: self._split(name, batch, parts))
        dirty = set(stage.plans)
        while not self._stage_over(stage.plans):
            for name in [n for n in stage.plans if n in self.assigned]:
                if name in dirty:
                    self._feed(name)
                self._top_up(name)
            dirty = self._collect(log)
        log.end(self._clock_s(), {n: self.works[n].done_units for n in stage.plans})
        self.report.stages.append(log)

    def _progress(self, now_s: float) -> dict[str, NodeProgress]:
        """Each unfinished node's units done, and how long it has run on its current plan."""
        return {n: NodeProgress(self.works[n].done_units, self.works[n].total_units,
                                all(u in self.finished for u in self.dag.nodes[n].upstream),
                                now_s - self.plan_since_s[n] if n in self.running_plans else 0.0)
                for n in self._unfinished()}

    def _stage_over(self, plans) -> bool:
        return any(n in self.finished or n in self.failed for n in plans)

    def _reconcile(self, log: StageLog) -> None:
        """Bring the engines to what the stage assigns; engines that fail to start count
        as restarts of their node, which fails after MAX_ENGINE_RESTARTS."""
        while True:
            starts_before = len(self.engines.starts)
            stopped, failed = self.engines.reconcile([c for configs in self.assigned.values() for c in configs])
            self._requeue(stopped)
            for start in self.engines.starts[starts_before:]:
                node = self._node_of(start.config)
                log.add_start(node, engine_label(start.config), start.load_time_s)
                if node is not None:
                    self.progress.stats[node].engine_load_s += start.load_time_s
            if not failed:
                return
            self._count_failures(failed)

    def _count_failures(self, losses: list[EngineLoss]) -> None:
        for loss in losses:
            node = self._node_of(loss.config)
            if node is None:
                continue
            self.restarts[node] = self.restarts.get(node, 0) + 1
            if self.restarts[node] > MAX_ENGINE_RESTARTS:
                self.failed[node] = loss.cause or "engine lost"
                self.assigned.pop(node, None)
                self.progress.note(f"[red]node {node} failed:[/red] {loss.cause}")
            else:
                self.progress.note(f"[yellow]engine for {node} lost; restarting ({self.restarts[node]}/{MAX_ENGINE_RESTARTS})[/yellow]")
        self._settle()

    def _node_of(self, config: EngineConfig) -> str | None:
        return next((n for n, configs in self.assigned.items() if config in configs), None)

    def _requeue(self, losses: list[EngineLoss]) -> None:
        for loss in losses:
            by_node: dict[str, list[str]] = {}
            for request_id in loss.request_ids:
                by_node.setdefault(self.owner.pop(request_id), []).append(request_id)
            for node, ids in by_node.items():
                self.works[node].requeue(ids)

    def _feed(self, name: str) -> None:
        """Ready requests of the node into its backlog, split over its replicas by estimated work."""
        requests = self.works[name].ready_requests()
        if not requests:
            return
        configs = self.assigned[name]
        self.backlogs[name].add(self._split(name, requests, len(configs)), [self.engines.get(c).queued_work for c in configs])

    def _split(self, name: str, requests: list[EngineRequest], parts: int) -> list[list[EngineRequest]]:
        if self.ordering is None:
            return _split_by_work(requests, parts)
        config = self.assigned[name][0]
        block_size = self.engines.get(config).engine.ready.block_size_tokens
        self.report.block_size_tokens = block_size
        return self.ordering.split(name, requests, config.model, block_size, parts)

    def _top_up(self, name: str) -> None:
        """Hand each of the node's engines waiting requests up to what it runs at once."""
        backlog = self.backlogs[name]
        for index, config in enumerate(self.assigned[name]):
            if not len(backlog):
                return
            running = self.engines.get(config)
            batch = backlog.take(index, running.engine.ready.max_num_seqs - len(running.in_flight))
            if batch:
                for request in batch:
                    self.owner[request.request_id] = name
                self.engines.submit(config, batch)

    def _collect(self, log: StageLog) -> set[str]:
        """Commit what the engines finished; returns the nodes with new ready work."""
        polled = self.engines.poll(POLL_S)
        dirty: set[str] = set()
        finals: dict[str, dict[str, str]] = {}  # producer -> rows it just finished
        for config, result in polled.results:
            name = self.owner.pop(result.request_id)
            work = self.works[name]
            record = work.record_for(result.request_id, result.texts, result.num_prompt_tokens,
                                     result.num_output_tokens, result.finish_reason)
            self.journals[name].append(record)
            self._start_progress(name)
            self.progress.advance(name, result.num_prompt_tokens, result.num_output_tokens)
            log.add_tokens(name, result.num_prompt_tokens, result.num_output_tokens)
            dirty.add(name)  # an iterating node's next step
            if work.is_last_step(record):
                finals.setdefault(name, {})[record.row_id] = record.text
        for producer, texts in finals.items():  # once per poll: a `where:` is one DuckDB query per call
            for consumer in self.dag.nodes:
                if producer in self.dag.nodes[consumer].upstream:
                    self.works[consumer].add_upstream(producer, texts)
                    dirty.add(consumer)
        for config, step in polled.steps:
            node = self._node_of(config)
            log.add_step(engine_label(config), step.wall_s)
            if node is not None:
                self.progress.count_steps(node, [step])
        if polled.losses:
            self._requeue(polled.losses)
            self._count_failures([loss for loss in polled.losses if loss.cause])
            self._reconcile(log)
            dirty.update(self.assigned)
        for name in dirty:
            if name in self.progress.stats:
                self.progress.set_total(name, self.works[name].total_units)
        self._settle()
        return dirty

    def _start_progress(self, name: str) -> None:
        if name not in self.progress.stats:
            work = self.works[name]
            self.progress.start_node(NodeStats(name, self.dag.nodes[name].model, work.total_units, work.done_units))

    def _write_outputs(self) -> dict[str, Path]:
        if self.ordering is not None:
            for name, stats in self.progress.stats.items():
                if name in self.assigned or name in self.finished:
                    stats.ideal_cached_tokens = self.ordering.ideal_cached_tokens(name, self.report.block_size_tokens)
        finals = {name: work.final_records() for name, work in self.works.items()}
        return write_output_sets(self.dag.outputs, self.tables, finals, self.run_dir.output_path)


def _split_by_work(requests: list[EngineRequest], parts: int) -> list[list[EngineRequest]]:
    """Longest processing time first: each request to the lightest part so far; each part
    keeps the given order."""
    parts_of: list[int] = [0] * len(requests)
    loads = [0.0] * parts
    for index in sorted(range(len(requests)), key=lambda i: request_work(requests[i]), reverse=True):
        k = loads.index(min(loads))
        parts_of[index] = k
        loads[k] += request_work(requests[index])
    return [[r for r, k in zip(requests, parts_of) if k == part] for part in range(parts)]
