"""The simple executor: nodes in topological order, each on all devices.

Consecutive nodes that use the same model (and engine settings) share one running
engine, so a DAG that calls one model in several roles pays its load time once.
Nothing is started for a node whose results are all committed already, so a re-run
of a finished DAG loads no model. Ready requests go out in prefix order by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchllm.engines.devices import DeviceSet, whole_set_replica
from batchllm.engines.process_engine import Engine, EngineFactory, EngineFailed
from batchllm.engines.protocol import EngineConfig
from batchllm.errors import RunIncomplete
from batchllm.io.inputs import InputTable
from batchllm.io.journal import ResultJournal, ResultRecord
from batchllm.io.outputs import node_table, write_output_sets, write_parquet_atomically
from batchllm.runtime.engine_configs import engine_config
from batchllm.runtime.fingerprint import node_fingerprints
from batchllm.runtime.node_work import NodeWork
from batchllm.runtime.progress import NodeStats, RunProgress
from batchllm.runtime.request_ordering import PrefixOrdering
from batchllm.runtime.run_report import RunReport
from batchllm.runtime.run_dir import RunDir
from batchllm.dag.model import DagSpec

MAX_ENGINE_RESTARTS = 2


@dataclass(frozen=True)
class RunResult:
    engines_started: int
    nodes_failed: dict[str, str]  # node -> cause
    outputs: dict[str, Path]
    report: "RunReport | None" = None  # stages, estimates and overhead (planned runs)


class EnginePool:
    """At most one running engine; reused while the next node can share it."""

    def __init__(self, factory: EngineFactory):
        self._factory = factory
        self.current: Engine | None = None
        self.started = 0

    def can_share(self, config: EngineConfig) -> bool:
        return self.current is not None and self.current.config.sharing_key() == config.sharing_key()

    def engine_for(self, config: EngineConfig) -> Engine:
        if self.can_share(config):
            return self.current
        self.stop()
        self.current = self._factory(config)
        self.started += 1
        return self.current

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


class SequentialRunner:
    def __init__(self, dag: DagSpec, tables: dict[str, InputTable], run_dir: RunDir, devices: DeviceSet,
                 engine_factory: EngineFactory, progress: RunProgress, home: Path, ordering: PrefixOrdering | None = None):
        self.dag, self.tables, self.run_dir, self.devices = dag, tables, run_dir, devices
        self.pool = EnginePool(engine_factory)
        self.progress, self.home = progress, home
        self.ordering = ordering  # None: requests go in input order

    def run(self) -> RunResult:
        prints = node_fingerprints(self.dag)
        journals = {n: ResultJournal(self.run_dir.journal_path(n), prints[n], n) for n in self.dag.nodes}
        finals: dict[str, dict[str, ResultRecord]] = {}
        failed: dict[str, str] = {}
        try:
            for name in self.dag.topological_order():
                node = self.dag.nodes[name]
                blocked = [u for u in node.upstream if u in failed]
                if blocked:
                    failed[name] = f"upstream node {blocked[0]!r} failed"
                    continue
                upstream_texts = {u: {row: record.text for row, record in finals[u].items()} for u in node.upstream}
                work = NodeWork(node, self.tables[node.input_name], upstream_texts, journals[name].records)
                if not work.is_finished():
                    try:
                        self._run_node(work, journals[name])
                    except EngineFailed as exc:
                        failed[name] = str(exc)
                        self.progress.note(f"[red]node {name} failed:[/red] {exc}")
                journals[name].sync()
                write_parquet_atomically(node_table(list(journals[name].records.values()), node.sampling.n), self.run_dir.node_path(name))
                finals[name] = work.final_records()
        finally:
            self.pool.stop()
            for journal in journals.values():
                journal.close()
        outputs = self._write_outputs(finals)
        if failed:
            raise RunIncomplete("; ".join(f"node {n}: {cause.splitlines()[0]}" for n, cause in failed.items()))
        return RunResult(self.pool.started, failed, outputs)

    def _engine_config(self, model: str) -> EngineConfig:
        return engine_config(self.dag, model, whole_set_replica(self.devices), self.run_dir, self.home)

    def _run_node(self, work: NodeWork, journal: ResultJournal) -> None:
        node = work.node
        stats = NodeStats(node.name, node.model, work.total_units, work.done_units)
        self.progress.start_node(stats)
        restarts = 0
        while not work.is_finished():
            config = self._engine_config(node.model)
            starts = self.pool.started
            if not self.pool.can_share(config):
                self.progress.note(f"starting engine {node.model} on {self.devices} for node {node.name}")
            try:
                engine = self.pool.engine_for(config)
                if self.pool.started > starts:
                    stats.engine_load_s += engine.ready.load_time_s
                self._feed(work, engine, journal)
                if self.ordering is not None:
                    stats.ideal_cached_tokens = self.ordering.ideal_cached_tokens(node.name, engine.ready.block_size_tokens)
            except EngineFailed:
                self.pool.stop()  # a dead engine: stop() only reaps it
                work.requeue_in_flight()
                restarts += 1
                if restarts > MAX_ENGINE_RESTARTS:
                    self.progress.finish_node(node.name)
                    raise
                self.progress.note(f"[yellow]engine for {node.name} died; restarting ({restarts}/{MAX_ENGINE_RESTARTS})[/yellow]")
        self.progress.finish_node(node.name)

    def _feed(self, work: NodeWork, engine: Engine, journal: ResultJournal) -> None:
        def submit() -> None:
            requests = work.ready_requests()
            if self.ordering is not None:
                requests = self.ordering(work.node.name, requests, engine.config.model, engine.ready.block_size_tokens)
            engine.submit(requests)

        submit()
        while not work.is_finished():
            for result in engine.poll(timeout_s=0.5):
                record = work.record_for(result.request_id, result.texts, result.num_prompt_tokens,
                                         result.num_output_tokens, result.finish_reason)
                journal.append(record)
                self.progress.advance(work.node.name, result.num_prompt_tokens, result.num_output_tokens)
            self.progress.count_steps(work.node.name, engine.drain_steps())
            submit()

    def _write_outputs(self, finals: dict[str, dict[str, ResultRecord]]) -> dict[str, Path]:
        return write_output_sets(self.dag.outputs, self.tables, finals, self.run_dir.output_path)
