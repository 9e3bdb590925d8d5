"""The executor: runs a DAG in execution stages of (node, plan) pairs on disjoint devices.

`step()` is the run's one loop call. When no stage runs, the stage chooser names the next from
what happened so far (nodes on servers join every stage until they finish) and the engines are
brought to it (`StageEngines`); then each node's engines are fed (`EngineFeeding`), their
results committed to the node's journal and the ledger, lost engines started again, and what
happened (`StepResult`) given to the observers: the progress and the stage's log
(`StageRecorder`), the calibration and the estimates. A stage ends when one of its nodes
finishes or fails, a pilot ends, or devices were lost.

Invariant: the ledger is the one record of where each (node, row, step) is, and each node's
`NodeRun.status` the one record of where the node is; a unit is committed to its journal only
from RUNNING, so at most once, and a unit lost with its engine is READY again. With the
journals' own exactly-once recovery, every unit is committed exactly once across crashes and
resumes.
"""

from __future__ import annotations

import time

import numpy as np

from batchllm.core.errors import RunIncomplete
from batchllm.core.requests import EngineResult, parse_finish_text
from batchllm.engines.engine import EngineFactory
from batchllm.runtime.early_engines import EarlyEngines, early_plans
from batchllm.runtime.engine_configs import endpoint_configs, stage_configs
from batchllm.runtime.engine_feeding import EngineFeeding
from batchllm.runtime.engine_set import EngineLoss, EngineSet
from batchllm.runtime.ledger import Ledger, node_units
from batchllm.runtime.length_learning import LengthSampler
from batchllm.runtime.memory import PeriodicTrim, release_free_memory
from batchllm.runtime.node_run import NodeRun, NodeRuns, open_node_runs
from batchllm.runtime.observer import RunObserver
from batchllm.runtime.output_writer import write_outputs
from batchllm.runtime.pilot import Pilots
from batchllm.runtime.prepare import RequestPreparer
from batchllm.runtime.progress import RunProgress
from batchllm.runtime.reuse import RunReuse
from batchllm.runtime.run_dir import RunDir
from batchllm.runtime.run_gantt import write_run_html
from batchllm.runtime.run_report import RunReport, RunResult, StageLog
from batchllm.runtime.run_spec import RunInputs, RunSpec
from batchllm.runtime.run_state import RunningPlan
from batchllm.runtime.stage_chooser import DeviceLossReplanner, RunPlanning
from batchllm.runtime.stage_engines import StageEngines
from batchllm.runtime.stage_recorder import StageRecorder
from batchllm.runtime.step_result import EngineStep, StepResult


class Executor:
    def __init__(self, spec: RunSpec, inputs: RunInputs, run_dir: RunDir, engine_factory: EngineFactory, progress: RunProgress,
                 planning: RunPlanning, preparer: RequestPreparer, replanner: DeviceLossReplanner | None = None,
                 length_sampler: LengthSampler | None = None, reuse: RunReuse | None = None, early: EarlyEngines | None = None):
        """`inputs`: what the checks found (their known prompt sets need no pilot); `length_sampler`:
        remembers a sample of each node's requests for the length model (an observer too); `reuse`:
        the result store requests are answered from, and what the engines compute is filed in
        (`inputs.store_keys` gives each node's keys); `early`: engines started before the run, which
        the first stage adopts where it wants them (early_engines.py)."""
        dag, devices = inputs.dag, spec.devices
        self.dag, self.sources, self.run_dir, self.devices, self.home = dag, inputs.sources, run_dir, devices, spec.home
        self.vector_dimensions = inputs.vector_dimensions
        self.device_ids = devices.ids  # every device the run started with (run.html draws a row for each)
        self.replanner = replanner  # on a cluster: a new planning on the devices left when nodes are gone
        self.engines = EngineSet(engine_factory, early)
        self._endpoint_configs = {model: endpoint_configs(dag, model, servers, run_dir, spec.home) for model, servers in inputs.endpoints.items()}
        self.progress, self.planning, self.preparer = progress, planning, preparer
        self.pilots, self.pilots_only, self.length_sampler = Pilots(spec.pilot, inputs.known_prompt_sets), spec.pilots_only, length_sampler
        self.reuse, self._store_keys = reuse, inputs.store_keys
        self.nodes, self.ledger = NodeRuns([]), Ledger([])
        self.stage: StageLog | None = None  # the current stage's log; None: between stages
        self.stage_nodes: tuple[str, ...] = ()  # the current stage's nodes as it began
        self._replan = False  # devices were lost: the stage ends and the rest is planned on those left
        self._pilot_ended = False  # a pilot ended: the stage ends and the rest is planned on its lengths
        self._started = time.monotonic()
        self._ready_at_s: float | None = None
        self._trim = PeriodicTrim()
        self.report = RunReport(dag.name, str(devices), planning.chooser.method, models={n: s.model for n, s in dag.nodes.items()})
        self.recorder = StageRecorder(progress)

    def run(self) -> RunResult:
        self.open()
        journals = self.nodes.journals()
        try:
            while self.step() is not None:
                pass
            left = self.nodes.planned_progress(self._clock_s()) if self.pilots_only else None  # the rest is planned from here
        finally:
            self._end_stage_loop(time.monotonic() - self._started)
        rest_s = self.planning.chooser.rest_s(left) if left is not None and not self.report.failed else None
        release_free_memory()
        try:
            outputs = {} if self.pilots_only else write_outputs(self.dag, self.sources, journals, self.run_dir, self.report)
            if self.report.outputs:
                self.report.write(self.run_dir.root / "run.json")
        finally:
            for journal in journals.values():
                journal.close()
        if self.report.failed:
            raise RunIncomplete("; ".join(f"node {n}: {cause}" for n, cause in self.report.failed.items()), outputs)
        loads = sum(1 for start in self.engines.starts if start.config.endpoint is None)
        return RunResult(len(self.engines.starts), dict(self.report.failed), outputs, self.report, rest_s, loads)

    def open(self) -> None:
        """Each node's record: its journal, ledger and feed, and its pilot where its prompt set is new."""
        self.nodes, self.ledger, prints = open_node_runs(self.dag, self.sources, self.run_dir, self.progress.note, self.vector_dimensions)
        self._give_lengths()
        self.feeding = EngineFeeding(self.engines, self.ledger, self.preparer, self.pilots_only, self.length_sampler, self.reuse)
        if self.reuse is not None:
            self._take_stored()
        self.stage_engines = StageEngines(self.engines, self.nodes, self.ledger, self.feeding, self.progress.note)
        for run in self.nodes:
            if run.lengths is not None:  # a pilot teaches a node's lengths to a cost model
                if pilot := self.pilots.begin(run.spec, run.ledger, prints[run.name]):
                    run.pilot = pilot
                    self.progress.note(pilot.note())
                elif (rows := self.pilots.ended_earlier(run.spec, run.ledger, prints[run.name])) is not None:
                    self._learn_earlier_pilot(run, rows)
        self._started = time.monotonic()

    def _take_stored(self) -> None:
        """Before the first stage: what the result store answers is committed, and the nodes
        it answers whole finish without an engine (`RunReuse.take_before_start`)."""
        assert self.reuse is not None
        for run in self.nodes:
            run.keys = self._store_keys.get(run.name)
        for name, count in self.reuse.take_before_start(self.nodes).items():
            run = self.nodes[name]
            run.earlier = run.earlier.plus(run.reused)  # done before this run's engines: in the counts, not in its pace
            self.progress.note(f"{name}: {count:,} of {run.ledger.total_units:,} units taken from the result store")

    def _learn_earlier_pilot(self, run: NodeRun, rows: np.ndarray) -> None:
        """The answers of a pilot an earlier command ran in this folder teach the node's lengths,
        as its end would have in that command (without them the rest was planned at the length
        model's level for a new prompt set: +19 % on a set of long answers after `plan --pilot`)."""
        assert run.lengths is not None
        sizes = run.journal.answer_sizes(rows, np.zeros(len(rows), np.int32))
        run.lengths.observe([EngineResult(0, ("",), prompt, output, *parse_finish_text(reason))
                             for prompt, output, reason in filter(None, sizes)])  # an error's says nothing: observe skips it
        if (learnt := run.lengths.pilot_ended()) is not None:
            self.progress.note(f"{learnt.note(run.name)} (its pilot's {len(rows):,} rows ran in an earlier command)")

    def _give_lengths(self) -> None:
        """Each node its answer lengths from the planning (as the nodes open, and when a new planning
        replaces it after devices were lost)."""
        for run in self.nodes:
            run.lengths = self.planning.lengths.get(run.name)

    def _end_pilots(self) -> None:
        """A pilot of this stage has every result: the stage ends, and the rest is planned on it."""
        ended = self.nodes.end_pilots(self.stage_nodes)
        self._pilot_ended = self._pilot_ended or bool(ended)
        for run in ended:
            run.since = None  # the rest is a run of its own from the next stage on, not a pilot's sequel
            if run.lengths is None:
                continue
            learnt = run.lengths.pilot_ended(self.length_sampler.answers(run.name) if self.length_sampler else [])
            if learnt is not None:
                self.progress.note(learnt.note(run.name))

    def _end_stage_loop(self, wall_s: float) -> None:
        """Stop the engines, sync the journals, write the report, and free the node records before
        the output writes allocate: their ledgers' per-unit arrays (two bytes a row per node: 60 MB
        for three nodes at 10M rows), feeds and backlogs. (A stage cut short by an error is left out.)"""
        self.stage = self.recorder.log = None
        self.engines.stop_all()
        self.preparer.close()
        if self.reuse is not None:
            self.reuse.flush()
        for run in self.nodes:
            run.feed.close()
            run.journal.sync()
        self.report.finish(wall_s, self.nodes.failures())
        if self.report.stages or self.report.failed:
            self.report.write(self.run_dir.root / "run.json")
            write_run_html(self.report, self.device_ids, self.run_dir.root / "run.html")
        self.progress.keep_counts()
        self.nodes, self.ledger = NodeRuns([]), Ledger([])
        del self.feeding, self.stage_engines  # and with them the last references to the ledger

    def _settle(self) -> None:
        """Nodes finished or failed by what happened (`NodeRuns.settle`), told to the report and progress."""
        failed, finished = self.nodes.settle()
        for run in failed:
            self._tell_failure(run)
        for run in finished:
            self._start_progress(run)
            self.progress.finish_node(run.name)

    def _clock_s(self) -> float:
        return time.monotonic() - self._started

    # -- the loop's one call ---------------------------------------------------------------
    def step(self) -> StepResult | None:
        """One turn of the run: the stage that is over ends and, when none runs, the next begins
        (None: nothing is left to run); then the nodes' engines are fed, what they finished is
        committed, lost engines are started again, and the observers are told."""
        while self.stage is None or self.stage_over():  # a stage can be over as it begins: its engines' start lost devices
            self.end_stage()
            self._settle()
            if not self.nodes.open_ones() or (self.pilots_only and not self.nodes.piloting()):
                return None
            self.begin_stage()
        submitted = self.feeding.feed(self.nodes.with_engines())
        if submitted and self.report.first_request_s is None and self._ready_at_s is not None:
            self.report.first_request_s = time.monotonic() - self._ready_at_s
        result = self._turn(submitted)
        for observer in (self.recorder, *self._observers()):
            observer.observe(result)
        if result.losses and not self._devices_lost():  # gone with their cluster nodes: the stage ends, the rest is re-planned
            self._count_losses([loss for loss in result.losses if loss.cause])
            self._reconcile()
        self.stage_engines.note_servers()
        self.progress.tick()
        self._trim.tick()
        for observer in self.planning.observers:
            observer.tick(self._clock_s(), self.progress, lambda: (self.nodes.planned_progress(self._clock_s()), self.nodes.running_plans()))
        return result

    def _turn(self, submitted: int) -> StepResult:
        """Collect what the engines finished and commit it; nodes finished or failed settle."""
        polled = self.stage_engines.poll()
        indices, units = node_units(np.fromiter((r.request_id for r in polled.results), np.int64, len(polled.results)))
        commits = []
        for index in dict.fromkeys(indices.tolist()):  # nodes in the order their first result came
            picked = np.flatnonzero(indices == index)
            run, results = self.nodes.at(index), [polled.results[k] for k in picked.tolist()]
            commits.append(run.commit(units[picked], results, self.ledger))
            if self.reuse is not None:
                self.reuse.keep(run, units[picked], results)
        engine_steps = tuple(EngineStep(owner.name if (owner := self.nodes.owner_of(config)) else None, config, step)
                             for config, step in polled.steps)
        self.stage_engines.release(polled.losses)
        open_before = {run.name for run in self.nodes.open_ones()}
        self._settle()
        self._end_pilots()
        ended = tuple(run.name for run in self.nodes if run.name in open_before and not run.is_open)
        return StepResult(submitted, tuple(commits), engine_steps, tuple(polled.losses), ended)

    def _running_plans(self) -> dict[str, RunningPlan]:
        """The nodes' engines, and before the first stage those started early, still loading: a
        plan that keeps them pays only what is left of their start."""
        running = self.nodes.running_plans()
        if (early := self.engines.early_loading()) is not None:
            configs, loading_for_s = early
            running = {**early_plans(configs, self.dag, self.devices, self.home, loading_for_s), **running}
        return running

    def _observers(self) -> tuple[RunObserver, ...]:
        """What learns from the run: the planning's, and the length sampler."""
        return (*self.planning.observers, *((self.length_sampler,) if self.length_sampler is not None else ()))

    # -- stages ------------------------------------------------------------------------------
    def begin_stage(self) -> StageLog:
        """Ask the stage chooser for the next stage of the nodes on devices, add the nodes on
        servers (they take no devices, so they run in every stage until they finish), and
        bring the engines to it."""
        now_s = self._clock_s()
        on_devices = self.nodes.planned_progress(now_s)
        if self.pilots_only:  # only pilots run: a stage of nodes whose pilot ended would wait for ever
            on_devices = {name: progress for name, progress in on_devices.items() if self.nodes[name].pilot is not None}
        choice = self.planning.chooser.choose(on_devices, self._running_plans()) if on_devices else None
        if choice is not None and choice.schedule is not None:
            self.report.plan_made(choice.schedule, self.devices.ids)
        self.stage = log = StageLog(len(self.report.stages), now_s, *((choice.stage.duration_s, choice.rest_s, choice.search_s)
                                                                      if choice else (None, None, 0.0)))
        self.recorder.log = log
        self._replan = self._pilot_ended = False
        assigned = stage_configs(self.dag, choice, self.devices, self.run_dir, self.home) if choice is not None else {}
        assigned |= {run.name: list(self._endpoint_configs[run.spec.model]) for run in self.nodes.open_ones() if run.on_servers}
        self.nodes.begin_stage(assigned, {n: RunningPlan(plan, choice.stage.placement[n]) for n, plan in choice.stage.plans.items()}
                               if choice is not None else {})
        for run in self.nodes.in_stage():
            placed = choice.stage.placement.get(run.name, ()) if choice is not None else ()
            plan = str(choice.stage.plans[run.name]) if choice is not None and placed else f"{len(run.replicas)} server(s)"
            log.add_node(run.name, plan, [self.devices.ids[i] for i in placed], run.ledger.committed_units)
        self.stage_nodes = tuple(run.name for run in self.nodes.in_stage())
        for run in self.nodes.in_stage():
            self._start_progress(run)
            if run.replicas[0].model:
                self.preparer.preload(run.replicas[0].model)
        self._reconcile()
        for run in self.nodes:
            run.start_clock(self._clock_s())
        if self._ready_at_s is None:
            self._ready_at_s = time.monotonic()
        for run in self.nodes.with_engines():
            self.feeding.regroup(run)
        return log

    def stage_over(self) -> bool:
        """One of the stage's nodes finished or failed, a pilot ended, or devices were lost."""
        return self._replan or self._pilot_ended or any(not self.nodes[n].is_open for n in self.stage_nodes)

    def end_stage(self) -> None:
        if self.stage is None:
            return
        self.stage.end(self._clock_s(), {n: self.nodes[n].ledger.committed_units for n in self.stage_nodes})
        self.report.stages.append(self.stage)
        self.stage = self.recorder.log = None

    # -- engines -------------------------------------------------------------------------------
    def _reconcile(self) -> None:
        """Bring the engines to what the stage assigns; engines that fail to start count as
        restarts of their node (`StageEngines.count_losses`)."""
        while True:
            started, failed = self.stage_engines.reconcile()
            for start in started:
                owner, running = self.nodes.owner_of(start.config), self.engines.get(start.config)
                if owner is not None and running is not None:
                    for observer in (self.recorder, *self._observers()):
                        observer.engine_started(owner.name, start.config, start.load_time_s, running.engine.ready)
            if not failed or self._devices_lost():
                return
            self._count_losses(failed)

    def _count_losses(self, losses: list[EngineLoss]) -> None:
        for run, cause in self.stage_engines.count_losses(losses):
            self.nodes.fail(run, cause)  # its pilot with it: a run of pilots only would wait for it for ever
            self._tell_failure(run)
        self._settle()

    def _tell_failure(self, run: NodeRun) -> None:
        """A node failed: the progress says why, when it started (the report reads it at the end)."""
        if run.stats is not None and run.failure is not None:
            self.progress.node_failed(run.name, run.failure)

    def _devices_lost(self) -> bool:
        """On a cluster, after engines were lost: when their nodes are gone, the stage ends and
        the rest of the run is planned again on the devices that survive."""
        changed = self.replanner.after_loss(self.devices) if self.replanner is not None else None
        if changed is None:
            return False
        self.devices, self.planning = changed
        self._give_lengths()
        for run in self.nodes:
            run.plan = None
        self._replan = True
        self.progress.note(f"[yellow]cluster nodes lost: re-planning on {self.devices}[/yellow]")
        return True

    def _start_progress(self, run: NodeRun) -> None:
        if stats := run.start(self.dag.prices.get(run.spec.model)):
            self.progress.start_node(stats)
