"""The executor: runs a DAG in execution stages of (node, plan) pairs on disjoint devices.

A stage chooser (`StagePlanner` for `plan`/`max`/`min`, `SequentialStages` for
`sequential`) names each stage from what actually happened so far. Per stage: engines
are reconciled replica by replica (kept, handed over, stopped, started side by side);
each node's feed finds ready units a window at a time, renders them, and the preparer
tokenizes them and splits them over the node's replicas in prefix order, off the main
loop; the backlog hands each engine what it runs at once; results are committed to the
node's journal and the ledger. A consumer in the same stage as its producer takes rows
as they are committed. The stage ends when one of its nodes finishes (or fails).

One turn is `step()`: admit (each node's ready units -> a prepared window -> its
backlog), submit (backlogs -> engines, up to what each runs at once), collect (the
engines' results and step records), commit (results -> journal + ledger; nodes finished
or failed). It returns what happened as a `StepResult`, which the stage loop hands to the
progress, the stage's log and the run's observers (calibration, estimates); engines lost
in a turn are restarted by the stage loop, not inside the turn.

Invariant: the ledger is the one record of where each (node, row, step) is; a unit is
committed to its journal only from RUNNING, so at most once, and a unit lost with its
engine is READY again. With the journals' own exactly-once recovery, every unit is
committed exactly once across crashes and resumes.
"""

from __future__ import annotations

import time
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchllm.core.endpoint import Endpoint
from batchllm.core.errors import RunIncomplete
from batchllm.core.requests import EngineResult
from batchllm.dag.model import DagSpec
from batchllm.engines.devices import DeviceSet
from batchllm.engines.engine import EngineFactory
from batchllm.engines.protocol import EngineConfig
from batchllm.io.input_source import InputSource
from batchllm.io.node_journal import ResultJournal, ResultRecord
from batchllm.io.output_files import FinalSource, InputFile, write_node_file, write_output_set
from batchllm.io.remote_files import copy_out
from batchllm.runtime.backlog import Backlog
from batchllm.runtime.engine_configs import endpoint_configs, engine_config
from batchllm.runtime.engine_set import EngineLoss, EngineSet, Polled
from batchllm.runtime.fingerprint import node_fingerprints
from batchllm.runtime.ledger import Ledger, NodeLedger, node_units
from batchllm.runtime.length_learning import LengthSampler
from batchllm.runtime.memory import PeriodicTrim, release_free_memory
from batchllm.runtime.node_feed import MergedUpstream, NodeFeed, Upstream
from batchllm.runtime.observer import RunObserver
from batchllm.runtime.pilot import Pilots, PilotSize
from batchllm.runtime.prepare import PreparedWindow, RequestPreparer, most_output_tokens, split
from batchllm.runtime.progress import NodeStats, RunProgress
from batchllm.runtime.run_dir import RunDir
from batchllm.runtime.run_gantt import write_run_html
from batchllm.runtime.run_report import RunReport, StageLog, engine_label
from batchllm.runtime.run_state import NodeProgress, RunningPlan, RunningSince
from batchllm.runtime.stage_chooser import DeviceLossReplanner, RunPlanning
from batchllm.runtime.step_result import EngineStep, NodeCommit, StepResult

POLL_S = 0.05
IDLE_S = 0.002  # nothing in an engine and nothing being prepared: the stage is about to end
MAX_ENGINE_RESTARTS = 2
FIRST_WINDOW_UNITS = 1_024  # a node's first window in a run (also a resumed one) is small: work at once
WINDOW_UNITS = 8_192  # later windows: large enough for the prefix order to find what is shared


@dataclass(frozen=True)
class RunResult:
    engines_started: int
    nodes_failed: dict[str, str]  # node -> cause
    outputs: dict[str, Path]
    report: RunReport
    rest_estimate_s: float | None = None  # after pilots only: the rest of the run, planned on what they measured

    @property
    def first_request_s(self) -> float | None:
        """From the first stage's engines being ready to the first request sent."""
        return self.report.first_request_s


class Executor:
    def __init__(self, dag: DagSpec, sources: dict[str, InputSource], run_dir: RunDir, devices: DeviceSet,
                 engine_factory: EngineFactory, progress: RunProgress, home: Path, planning: RunPlanning,
                 preparer: RequestPreparer, replanner: DeviceLossReplanner | None = None, pilot: PilotSize | None = PilotSize(),
                 known_prompt_sets: frozenset[str] = frozenset(), pilots_only: bool = False,
                 length_sampler: LengthSampler | None = None, endpoints: dict[str, tuple[Endpoint, ...]] | None = None):
        """`pilot`: the size of a new prompt set's pilot (None: no pilots); `known_prompt_sets`:
        the node fingerprints whose outputs the local store has seen (their prompt sets are not new);
        `pilots_only`: run the pilots, then stop (no outputs are written); `length_sampler`:
        remembers a sample of each node's requests for the length model (an observer too);
        `endpoints`: the servers of each model the DAG sends to servers (`endpoints:`), checked."""
        self.dag, self.sources, self.run_dir, self.devices = dag, sources, run_dir, devices
        self.device_ids = devices.ids  # every device the run started with (run.html draws a row for each)
        self.replanner = replanner  # on a cluster: a new planning on the devices left when nodes are gone
        self._replan = False  # devices were lost: the stage ends and the rest is planned on those left
        self._pilot_ended = False  # a pilot ended: the stage ends and the rest is planned on its lengths
        self.engines = EngineSet(engine_factory)
        self._endpoint_configs = {model: endpoint_configs(dag, model, servers, home) for model, servers in (endpoints or {}).items()}
        self.progress, self.home, self.planning, self.preparer = progress, home, planning, preparer
        self.pilots, self.pilots_only = Pilots(pilot, known_prompt_sets), pilots_only
        self.length_sampler = length_sampler
        self.left_at_end: dict[str, NodeProgress] = {}
        self.order = dag.topological_order()
        self._ancestors = {name: dag.ancestors(name) for name in self.order}
        self.finished: set[str] = set()
        self.failed: dict[str, str] = {}
        self.restarts: dict[str, int] = {}
        self.assigned: dict[str, list[EngineConfig]] = {}  # node -> its replicas in the current stage
        self.stage_nodes: tuple[str, ...] = ()  # the current stage's nodes
        self.running_plans: dict[str, RunningPlan] = {}
        self.running_since: dict[str, RunningSince] = {}  # node -> when its current plan's engines were ready (or its pilot ended)
        self.backlogs = {n: Backlog() for n in dag.nodes}
        self.preparing: dict[str, tuple[Future, bool]] = {}  # node -> window being prepared, fresh units?
        self.windows_taken: set[str] = set()  # nodes that took a window in this run
        self.block_size_tokens = 16
        self._started = time.monotonic()
        self._ready_at_s: float | None = None
        self._trim = PeriodicTrim()
        self._servers_noted_at = 0.0
        self.report = RunReport(dag.name, str(devices), planning.chooser.method, models={n: s.model for n, s in dag.nodes.items()})

    # -- the run ------------------------------------------------------------------------
    def run(self) -> RunResult:
        self.open()
        started = self._started
        try:
            self._settle()
            while self._unfinished() and not (self.pilots_only and not self.pilots):
                self._run_stage()
            self.left_at_end = self._planned_progress(self._clock_s())  # what the rest of the run is planned from
        finally:
            self._end_stage_loop(time.monotonic() - started)
        release_free_memory()
        try:
            outputs = {} if self.pilots_only else self._write_outputs()
            if self.report.outputs:
                self.report.write(self.run_dir.root / "run.json")
        finally:
            for journal in self.journals.values():
                journal.close()
        if self.failed:
            raise RunIncomplete("; ".join(f"node {n}: {cause}" for n, cause in self.failed.items()), outputs)
        return RunResult(len(self.engines.starts), dict(self.failed), outputs, self.report)

    def open(self) -> None:
        """The journals (what earlier invocations committed), the ledger restored from them,
        and each node's feed."""
        prints = node_fingerprints(self.dag, self.sources)
        self.journals = {n: ResultJournal(self.run_dir.journal_folder(n), prints[n], n, samples=self.dag.nodes[n].sampling.n,
                                          logprobs=self.dag.nodes[n].sampling.logprobs)
                         for n in self.order}
        for journal in self.journals.values():
            for damage in journal.damage:
                self.progress.note(f"[yellow]journal damaged:[/yellow] {damage}")
        self.earlier = {n: j.stats() for n, j in self.journals.items()}  # what earlier invocations committed
        self.ledger = Ledger({n: self._node_ledger(n) for n in self.order})
        self.feeds = {}
        for index, name in enumerate(self.order):
            node = self.dag.nodes[name]
            self.feeds[name] = NodeFeed(node, index, self.ledger[name], self.sources[node.input_name], self.journals[name],
                                        self._upstream_of(name))
        for name in self.order:
            self._begin_pilot(name, prints[name])
        self._started = time.monotonic()

    def _begin_pilot(self, name: str, fingerprint: str) -> None:
        planned = self.planning.calibration is not None and not self.dag.on_endpoints(name)
        pilot = self.pilots.begin(self.dag.nodes[name], self.ledger[name], fingerprint) if planned else None
        if pilot is not None:
            rows = self.ledger[name].rows
            self.progress.note(f"pilot: {len(pilot.rows):,} random rows of {name} first ({len(pilot.rows) / rows:.1%} of "
                               f"{rows:,}), to learn its answer lengths; then the rest is planned on them")

    def _end_pilots(self) -> None:
        """A pilot of this stage has every result: the stage ends, and the rest is planned on it."""
        ended = self.pilots.end(self.stage_nodes, {n: self.ledger[n] for n in self.stage_nodes})
        self._pilot_ended = self._pilot_ended or bool(ended)
        calibration = self.planning.calibration
        for pilot in ended:
            self.running_since.pop(pilot.node, None)  # the rest is a run of its own from the next stage on, not a pilot's sequel
            if calibration is None:
                continue
            answers = self.length_sampler.answers(pilot.node) if self.length_sampler is not None else []
            learnt = calibration.pilot_ended(pilot.node, answers)
            held = "" if learnt.spread is None else \
                f"; the length model's differences between its requests: {learnt.spread:.0%} of them held on it"
            self.progress.note(f"pilot of {pilot.node} done: mean answer {learnt.mean_output_tokens:.0f} tokens at max_tokens "
                               f"{learnt.max_tokens} (the prior's {learnt.prior_mean_output_tokens:.0f}){held}; planning the rest on it")

    def _end_stage_loop(self, wall_s: float) -> None:
        """Stop the engines, sync the journals, write the report, and free what only the
        stage loop reads before the output writes allocate: the ledger's per-unit arrays
        (two bytes a row per node: 60 MB for three nodes at 10M rows), the feeds and the
        backlogs. The writes read the journals and the inputs. (A method, so that no local
        of `run` keeps a feed, and through it every ledger, alive during the writes.)"""
        self.engines.stop_all()
        self.preparer.close()
        for feed in self.feeds.values():
            feed.close()
        for journal in self.journals.values():
            journal.sync()
        self.report.finish(wall_s)
        if self.report.stages or self.report.failed:
            self.report.write(self.run_dir.root / "run.json")
            write_run_html(self.report, self.device_ids, self.run_dir.root / "run.html")
        self.feeds, self.backlogs, self.preparing = {}, {}, {}
        self.progress.keep_counts()
        self.ledger = Ledger({})

    def _upstream_of(self, name: str) -> dict[str, Upstream | MergedUpstream]:
        """What the node's templates read by name: upstream nodes, and merges of them."""
        producer = lambda u: Upstream(self.ledger[u], self.journals[u])  # noqa: E731
        merges = self.dag.merges
        return {n: MergedUpstream([producer(u) for u in merges[n]]) if n in merges else producer(n)
                for n in self.dag.nodes[name].reads}

    def _node_ledger(self, name: str) -> NodeLedger:
        node = self.dag.nodes[name]
        source = self.sources[node.input_name]
        steps = source.list_lengths(node.iterate.over) if node.iterate else None
        ledger = NodeLedger(name, source.num_rows, steps)
        for rows, steps_done in self.journals[name].committed_key_batches():  # a segment at a time
            ledger.restore_committed(rows, steps_done)
        return ledger

    def _unfinished(self) -> list[str]:
        return [n for n in self.order if n not in self.finished and n not in self.failed]

    def _settle(self) -> None:
        """Mark nodes finished (every producer finished, every unit committed or skipped)
        or failed (a producer failed)."""
        for name in self._unfinished():
            node, ledger = self.dag.nodes[name], self.ledger[name]
            blocked = [u for u in node.upstream if u in self.failed]
            if blocked:
                self._fail(name, f"upstream node {blocked[0]!r} failed")
                continue
            if not all(u in self.finished for u in node.upstream):
                continue
            if not ledger.is_settled() and name not in self.assigned:
                self.feeds[name].admit_all()  # rows no upstream output reaches need no engine
            if ledger.is_settled():
                self.finished.add(name)
                self._start_progress(name)
                self.progress.finish_node(name)

    # -- one stage ------------------------------------------------------------------------
    def _clock_s(self) -> float:
        return time.monotonic() - self._started

    def _run_stage(self) -> None:
        log = self.begin_stage()
        while not self.stage_over():
            result = self.step()
            self._record(result, log)
            if result.losses:
                self._recover(result.losses, log)
            self._note_servers()
            self.progress.tick()
            self._trim.tick()
            for observer in self.planning.observers:
                observer.tick(self._clock_s(), self.progress, lambda: (self._planned_progress(self._clock_s()), self._running()))
        self.end_stage(log)

    def _note_servers(self) -> None:
        """What each server's latency guard allows and reads, for the progress and `status`
        (once a second: a reading walks the guard's window)."""
        if time.monotonic() < self._servers_noted_at + 1.0:
            return
        self._servers_noted_at = time.monotonic()
        for name, configs in self.assigned.items():
            if self.dag.on_endpoints(name):
                running = [self.engines.get(c) for c in configs]
                self.progress.stats[name].servers = tuple(note for r in running if r is not None and (note := r.engine.note()))

    def begin_stage(self) -> StageLog:
        """Ask the stage chooser for the next stage of the nodes on devices, add the nodes on
        servers (they take no devices, so they run in every stage until they finish), and
        bring the engines to it."""
        now_s = self._clock_s()
        on_devices = self._planned_progress(now_s)
        choice = self.planning.chooser.choose(on_devices, self._running()) if on_devices else None
        if choice is not None and choice.schedule is not None:
            self.report.plan_made(choice.schedule, self.devices.ids)
        log = StageLog(len(self.report.stages), now_s, *((choice.stage.duration_s, choice.rest_s, choice.search_s) if choice
                                                         else (None, None, 0.0)))
        plans = choice.stage.plans if choice is not None else {}
        placement = choice.stage.placement if choice is not None else {}
        self.assigned, self._replan, self._pilot_ended = {}, False, False
        for name, plan in plans.items():
            size, placed = plan.shape.devices, placement[name]
            ids = [self.devices.ids[i] for i in placed]
            replicas = [self.devices.replica(placed[k * size:(k + 1) * size], plan.shape.tp) for k in range(plan.dp)]
            self.assigned[name] = [engine_config(self.dag, self.dag.nodes[name].model, r, self.run_dir, self.home) for r in replicas]
            log.add_node(name, str(plan), ids, self.ledger[name].committed_units)
        for name in self._unfinished():
            if self.dag.on_endpoints(name):
                self.assigned[name] = self._endpoint_configs[self.dag.nodes[name].model]
                log.add_node(name, f"{len(self.assigned[name])} server(s)", [], self.ledger[name].committed_units)
        self.stage_nodes = tuple(self.assigned)
        for name, configs in self.assigned.items():
            self._start_progress(name)
            if configs[0].model:
                self.preparer.preload(configs[0].model)
        kept = {n for n, p in plans.items() if self.running_plans.get(n) == RunningPlan(p, placement[n])}
        self.running_plans = {n: RunningPlan(p, placement[n]) for n, p in plans.items()}
        self._reconcile(log)
        since = {n: RunningSince(self._clock_s(), self.ledger[n].committed_units) for n in plans}
        self.running_since = {n: self.running_since.get(n, since[n]) if n in kept else since[n] for n in plans}
        if self._ready_at_s is None:
            self._ready_at_s = time.monotonic()
        for name in self.assigned:
            self._regroup(name)
        return log

    def _planned_progress(self, now_s: float) -> dict[str, NodeProgress]:
        """`_progress` of the nodes the stage chooser plans (see `_plannable`)."""
        return {n: p for n, p in self._progress(now_s).items() if self._plannable(n)}

    def _plannable(self, name: str) -> bool:
        """A node the stage chooser places on devices: not on servers, and not behind an
        unfinished node on servers, directly or through others (the chooser plans the nodes on
        devices only, so it cannot know when that one ends)."""
        return not self.dag.on_endpoints(name) and not any(self.dag.on_endpoints(a) and a not in self.finished
                                                           for a in self._ancestors[name])

    def stage_over(self) -> bool:
        """One of the stage's nodes finished or failed, a pilot ended, or devices were lost."""
        return self._replan or any(n in self.finished or n in self.failed for n in self.stage_nodes) or self._pilot_ended

    def end_stage(self, log: StageLog) -> None:
        log.end(self._clock_s(), {n: self.ledger[n].committed_units for n in self.stage_nodes})
        self.report.stages.append(log)

    def _record(self, result: StepResult, log: StageLog) -> None:
        """Give what a turn did to the progress, the stage's log and the observers."""
        for commit in result.commits:
            self._start_progress(commit.node)
            self.progress.advance(commit.node, prompt_tokens=commit.prompt_tokens, output_tokens=commit.output_tokens,
                                  failed=commit.failed)
            log.add_tokens(commit.node, commit.prompt_tokens, commit.output_tokens)
        for engine_step in result.engine_steps:
            log.add_step(engine_label(engine_step.config), engine_step.step.wall_s)
            if engine_step.node is not None:
                self.progress.count_steps(engine_step.node, [engine_step.step])
        for observer in self._observers():
            observer.observe(result)

    def _observers(self) -> tuple[RunObserver, ...]:
        """What learns from the run: the planning's, and the length sampler."""
        return (*self.planning.observers, *((self.length_sampler,) if self.length_sampler is not None else ()))

    def _recover(self, losses: tuple[EngineLoss, ...], log: StageLog) -> None:
        """Engines died in a turn (their units are READY again): re-plan when their cluster
        nodes are gone, else count the failures and start the engines again."""
        if not self._devices_lost():
            self._count_failures([loss for loss in losses if loss.cause])
            self._reconcile(log)

    def _running(self) -> dict[str, RunningPlan]:
        return {n: r for n, r in self.running_plans.items() if n not in self.failed}

    def _progress(self, now_s: float) -> dict[str, NodeProgress]:
        """Each unfinished node's units done, and how long it has run on its current plan (from
        how many units done)."""
        progress = {}
        for n in self._unfinished():
            done = self.ledger[n].committed_units
            since = self.running_since.get(n) if n in self.running_plans else None
            running_s, before = (now_s - since.at_s, since.done_units) if since is not None else (0.0, done)
            progress[n] = NodeProgress(done, self.ledger[n].total_units, all(u in self.finished for u in self.dag.nodes[n].upstream),
                                       running_s, before)
        return progress

    def _reconcile(self, log: StageLog) -> None:
        """Bring the engines to what the stage assigns; engines that fail to start count
        as restarts of their node, which fails after MAX_ENGINE_RESTARTS."""
        while True:
            starts_before = len(self.engines.starts)
            stopped, failed = self.engines.reconcile([c for configs in self.assigned.values() for c in configs])
            self._release(stopped)
            for start in self.engines.starts[starts_before:]:
                node = self._node_of(start.config)
                log.add_start(node, engine_label(start.config), start.load_time_s)
                if node is not None:
                    self.progress.stats[node].engine_load_s += start.load_time_s
                    if running := self.engines.get(start.config):
                        for observer in self._observers():
                            observer.engine_started(node, start.config, start.load_time_s, running.engine.ready)
            for config in (c for configs in self.assigned.values() for c in configs if c.endpoint is None):
                running = self.engines.get(config)
                if running is not None:
                    self.block_size_tokens = running.engine.ready.block_size_tokens
            if not failed or self._devices_lost():
                return
            self._count_failures(failed)

    def _count_failures(self, losses: list[EngineLoss]) -> None:
        for loss in losses:
            node = self._node_of(loss.config)
            if node is None:
                continue
            if loss.config.endpoint is not None and self._server_left(node, loss.config):
                self.assigned[node] = [c for c in self.assigned[node] if c != loss.config]
                self._regroup(node)
                self.progress.note(f"[yellow]server {loss.config.endpoint.url} of {node} lost ({loss.cause}); the other servers "
                                   f"take its requests, and it is tried again at the next stage[/yellow]")
                continue
            self.restarts[node] = self.restarts.get(node, 0) + 1
            if self.restarts[node] > MAX_ENGINE_RESTARTS:
                self._fail(node, loss.cause or "engine lost")
                self.assigned.pop(node, None)
            else:
                self.progress.note(f"[yellow]engine for {node} lost; restarting ({self.restarts[node]}/{MAX_ENGINE_RESTARTS})[/yellow]")
        self._settle()

    def _server_left(self, node: str, lost: EngineConfig) -> bool:
        """Whether another server of the node runs (one server's loss then does not fail the node)."""
        return any(c != lost and c.endpoint is not None and self.engines.get(c) is not None for c in self.assigned[node])

    def _regroup(self, node: str) -> None:
        """Spread what waits for the node over its replicas as they are now."""
        self.backlogs[node].regroup(len(self.assigned[node]), lambda batch, parts: split(batch, parts, self.block_size_tokens,
                                                                                          self.preparer.prefix_order).replicas)

    def _fail(self, node: str, cause: str) -> None:
        self.failed[node] = cause
        self.report.failed[node] = cause
        if node in self.progress.stats:
            self.progress.node_failed(node, cause)

    def _devices_lost(self) -> bool:
        """On a cluster, after engines were lost: when their nodes are gone, the stage ends and
        the rest of the run is planned again on the devices that survive."""
        changed = self.replanner.after_loss(self.devices) if self.replanner is not None else None
        if changed is None:
            return False
        self.devices, self.planning = changed
        self.running_plans, self._replan = {}, True
        self.progress.note(f"[yellow]cluster nodes lost: re-planning on {self.devices}[/yellow]")
        return True

    def _node_of(self, config: EngineConfig) -> str | None:
        return next((n for n, configs in self.assigned.items() if config in configs), None)

    def _release(self, losses) -> None:
        """Units on stopped or lost engines are READY again."""
        for loss in losses:
            for node, units in self.ledger.release(loss.slot).items():
                self.feeds[node].requeue(units)

    # -- one turn -----------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One turn of the current stage: admit, submit, collect, commit. Returns what happened."""
        submitted = 0
        for name in [n for n in self.order if n in self.assigned]:  # producers first
            self._admit(name)
            submitted += self._submit(name)
        polled = self._collect()
        indices, units = node_units(np.fromiter((r.request_id for r in polled.results), np.int64, len(polled.results)))
        commits = []
        for index in dict.fromkeys(indices.tolist()):  # nodes in the order their first result came
            picked = np.flatnonzero(indices == index)
            commits.append(self._commit(self.order[index], units[picked], [polled.results[k] for k in picked.tolist()]))
        engine_steps = tuple(EngineStep(self._node_of(config), config, step) for config, step in polled.steps)
        self._release(polled.losses)
        unfinished = set(self._unfinished())
        self._settle()
        self._end_pilots()
        ended = tuple(n for n in self.order if n in unfinished and n not in self._unfinished())
        return StepResult(submitted, tuple(commits), engine_steps, tuple(polled.losses), ended)

    def _admit(self, name: str) -> None:
        """Keep the node's backlog ahead of its engines: take a prepared window when it is
        ready, and start preparing the next when what waits runs low."""
        configs, backlog = self.assigned[name], self.backlogs[name]
        if name in self.preparing:
            future, fresh = self.preparing[name]
            if not future.done():
                return
            del self.preparing[name]
            window: PreparedWindow = future.result()
            if len(window.replicas) != len(configs):  # the replicas changed while it was prepared
                window = split([p for part in window.replicas for p in part], len(configs), self.block_size_tokens,
                               self.preparer.prefix_order)
            backlog.add(window.replicas, [self._engine_load(c) * window.mean_work for c in configs])
            if fresh:
                self.progress.stats[name].ideal_cached_tokens = (self.progress.stats[name].ideal_cached_tokens or 0) + window.ideal_cached_tokens
        at_once = sum(self.engines.of(c).engine.ready.max_num_seqs for c in configs)
        feed = self.feeds[name]
        if len(backlog) >= max(WINDOW_UNITS, at_once) or not feed.has_more():  # the next window is prepared while one waits
            return
        fresh = not feed.retry
        size = WINDOW_UNITS if name in self.windows_taken else FIRST_WINDOW_UNITS  # the first of this run: small
        pilot = self.pilots.of(name)
        if pilot is None and self.pilots_only:
            return
        if pilot is None:
            self.windows_taken.add(name)
            units = feed.take_ready(max(size, 2 * at_once))
        elif not pilot.taken:
            pilot.taken = True
            units = feed.take_rows(pilot.rows)
        else:  # while the pilot runs, only its own units lost with an engine
            units = feed.take_ready(len(pilot.rows)) if feed.retry else np.zeros(0, np.int64)
        if len(units):
            requests = feed.render(units)
            if self.length_sampler is not None:
                self.length_sampler.remember(name, requests)
            calibration = self.planning.calibration
            forecast = calibration.output_forecast(name) if calibration is not None and not self.dag.on_endpoints(name) else most_output_tokens
            self.preparing[name] = (self.preparer.submit(requests, configs[0].model or None, self.block_size_tokens, len(configs),
                                                         forecast), fresh)

    def _engine_load(self, config: EngineConfig) -> int:
        """Units running in the engine (their work is estimated by the caller)."""
        return self.ledger.running_on[self.engines.of(config).slot]

    def _submit(self, name: str) -> int:
        """Hand each of the node's engines waiting requests up to what it runs at once.
        Returns how many were handed over."""
        backlog, submitted = self.backlogs[name], 0
        if not len(backlog):
            return 0
        engines = [self.engines.of(c) for c in self.assigned[name]]
        limits = [running.engine.in_flight_limit() for running in engines]  # a server's: what its latency guard allows now
        in_engine = [self.ledger.running_on[running.slot] for running in engines]  # on a server also calls held back or retried
        serving = [min(count, limit) for count, limit in zip(in_engine, limits)]
        for index, (config, running) in enumerate(zip(self.assigned[name], engines)):
            if not len(backlog):
                break
            batch = backlog.take(index, limits[index] - in_engine[index], serving)
            if batch:
                _, units = node_units(np.fromiter((r.request_id for r in batch), np.int64, len(batch)))
                self.ledger.send(name, units, running.slot)
                self.engines.submit(config, batch)
                submitted += len(batch)
                in_engine[index] += len(batch)
                if self.report.first_request_s is None and self._ready_at_s is not None:
                    self.report.first_request_s = time.monotonic() - self._ready_at_s
        return submitted

    def _collect(self) -> Polled:
        """What the engines finished and measured. With nothing in an engine, wait for a
        window being prepared instead (spinning here would starve the preparing thread)."""
        if not any(self.ledger.running_on.values()):
            pending = [future for future, _ in self.preparing.values()]
            if pending:
                futures.wait(pending, timeout=POLL_S, return_when=futures.FIRST_COMPLETED)
            else:  # work waiting while nothing runs: the servers' guards allow none now
                time.sleep(POLL_S if any(len(self.backlogs[n]) for n in self.assigned) else IDLE_S)
        return self.engines.poll(POLL_S, busy=lambda slot: self.ledger.running_on[slot] > 0)

    def _commit(self, name: str, units: np.ndarray, results: list[EngineResult]) -> NodeCommit:
        """Journal the node's results (of `units`, in the same order) and mark them committed."""
        rows, steps = self.ledger[name].row_step_of(units)
        self.journals[name].append_many([
            ResultRecord(row, step, r.texts, r.num_prompt_tokens, r.num_output_tokens, r.finish_text(), r.logprobs)
            for row, step, r in zip(rows.tolist(), steps.tolist(), results)])
        self.feeds[name].requeue(self.ledger.commit(name, units))
        return NodeCommit.of(name, results)

    def _start_progress(self, name: str) -> None:
        if name not in self.progress.stats:
            ledger = self.ledger[name]
            model = self.dag.nodes[name].model
            self.progress.start_node(NodeStats(name, model, ledger.unit_counts, ledger.committed_units,
                                               earlier=self.earlier[name], price=self.dag.prices.get(model)))

    # -- outputs ------------------------------------------------------------------------------
    def _write_outputs(self) -> dict[str, Path]:
        """The node files and the output data sets. A run with a failed node writes only what
        has results (a file of nulls would pass for an answer), marks those files incomplete
        in run.json, and copies none to `copy_to`; the run that completes replaces them."""
        complete = not self.failed
        has_results = {n: self.journals[n].stats().committed > 0 for n in self.order}
        files = {name: InputFile(source.path, source.id_column) for name, source in self.sources.items()}
        for name in self.order:
            if complete or has_results[name]:
                write_node_file(self.journals[name], files[self.dag.nodes[name].input_name], self.run_dir.node_path(name))
        finals = {n: FinalSource(self.journals[n], iterate.over if (iterate := self.dag.nodes[n].iterate) else None)
                  for n in self.order}
        written = {}
        for name, spec in self.dag.outputs.items():
            feeding = {member for ref in spec.columns.values() if ref.node for member in self.dag.merges.get(ref.node, (ref.node,))}
            if not complete and not any(has_results[n] for n in feeding):
                continue
            written[name] = self.run_dir.output_path(name, spec.format)
            write_output_set(spec, files[spec.input_name], finals, self.dag.merges, written[name])
            self.report.outputs[name] = {"path": str(written[name]), "complete": complete}
            if spec.copy_to is not None and complete:
                copy_out(written[name], spec.copy_to, where=f"outputs.{name}.copy_to")
        return written
