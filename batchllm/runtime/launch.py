"""`batchllm run` without the command line: validate, choose how stages are picked, execute."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from batchllm.core.errors import RunIncomplete, UserError
from batchllm.core.process_clock import process_age_s
from batchllm.costmodel.calibration.store import ProfileStore
from batchllm.costmodel.command_times import CommandTimes, CommandTimesStore, command_key
from batchllm.costmodel.server_pace import ServerPaceStore
from batchllm.dag.loader import load_dag
from batchllm.dag.model import DagSpec
from batchllm.engines.devices import DeviceSet
from batchllm.engines.endpoint.http_engine import with_endpoints
from batchllm.engines.endpoint.server_check import check_endpoints
from batchllm.engines.engine import EngineFactory
from batchllm.engines.hardware import HardwareIdentity, this_machine
from batchllm.engines.process_engine import start_vllm_engine
from batchllm.engines.protocol import EngineConfig
from batchllm.engines.settings_check import check_engine_settings
from batchllm.engines.version import installed_engine_version, untested_vllm_note
from batchllm.io.dag_checks import check_dag, node_vector_dimensions
from batchllm.io.input_source import InputSource
from batchllm.io.node_data import NodeFacts
from batchllm.io.remote_files import check_copy_target
from batchllm.io.result_store import ResultStore
from batchllm.models.registry import batchllm_home
from batchllm.planner.cluster import local_cluster, run_settings
from batchllm.planner.from_dag import dag_workloads, measured_paces, server_node_facts
from batchllm.planner.length_sources import LengthModels
from batchllm.planner.problem import build_problem
from batchllm.runtime.calibrated_stages import CalibratedStages, RunEstimates
from batchllm.runtime.early_engines import EarlyEngines, FirstEngines, first_engines_key, kept_first_engines
from batchllm.runtime.executor import Executor
from batchllm.runtime.fingerprint import node_fingerprints
from batchllm.runtime.length_learning import LengthSampler
from batchllm.runtime.prepare import RequestPreparer
from batchllm.runtime.progress import RunProgress
from batchllm.runtime.request_keys import NodeKeys
from batchllm.runtime.reuse import RunReuse
from batchllm.runtime.reuse_census import answered_whole
from batchllm.runtime.run_calibration import RunCalibration
from batchllm.runtime.run_dir import RunDir
from batchllm.runtime.run_report import CommandStart, RunReport, RunResult
from batchllm.runtime.run_spec import RunInputs, RunSpec
from batchllm.runtime.sequential_stages import SequentialStages
from batchllm.runtime.server_paces import save_server_paces
from batchllm.runtime.stage_chooser import RunPlanning

if TYPE_CHECKING:
    from batchllm.cluster.session import RaySession

RUN_GC_THRESHOLD = 50_000  # allocations between young collections during a run (Python's default: 700)


@contextmanager
def _run_gc() -> Iterator[None]:
    """A run allocates a few short-lived containers per request (token ids, results); with
    Python's default threshold the collector's passes cost more than the work itself (the
    driver's CPU per request roughly halves in the prepare step). Restored afterwards."""
    before = gc.get_threshold()
    gc.set_threshold(RUN_GC_THRESHOLD, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def run_dag_file(dag_path: Path, out: Path, devices: DeviceSet, *, console: Console, engine_factory: EngineFactory | None = None,
                 cluster: RaySession | None = None, **spec: Any) -> tuple[RunResult, RunProgress]:
    """`run_dag` on a DAG file, the `RunSpec` given by its fields."""
    return run_dag(load_dag(dag_path), RunSpec(out, devices, **spec), console=console, engine_factory=engine_factory,
                   cluster=cluster)


def run_dag(dag: DagSpec, spec: RunSpec, *, console: Console, engine_factory: EngineFactory | None = None,
            cluster: RaySession | None = None) -> tuple[RunResult, RunProgress]:
    """Check everything first (nothing is written on bad input), then run.

    `engine_factory`: the engines (None: vLLM's, which check the DAG's settings first, and
    whose first engines start while the driver checks and plans where an earlier command of
    the same models, devices and settings says which they are: early_engines.py).
    `cluster`: a connected `batchllm.cluster.session.RaySession`; `spec.devices` are then its
    nodes' devices, engines run as Ray actors, and a lost node's work is re-planned on the
    devices that survive."""
    entered_s, checked_at = process_age_s(), time.monotonic()
    first_key = first_engines_key(dag, spec.devices, spec.schedule, installed_engine_version()) \
        if engine_factory is None and cluster is None else None
    early = _start_early(first_key, spec.home)
    try:
        return _checked_run(dag, spec, console, engine_factory, cluster, entered_s, checked_at, early, first_key)
    finally:
        if early is not None:
            early.stop_rest()  # a check failed, or the run needed no engine: none outlives the command


def _start_early(first_key: str | None, home: Path) -> EarlyEngines | None:
    if first_key is None:
        return None
    configs = kept_first_engines(home, first_key)
    return EarlyEngines.start(configs, start_vllm_engine, home) if configs else None


def _checked_run(dag: DagSpec, spec: RunSpec, console: Console, engine_factory: EngineFactory | None, cluster: RaySession | None,
                 entered_s: float, checked_at: float, early: EarlyEngines | None, first_key: str | None) -> tuple[RunResult, RunProgress]:
    inputs, checks_s = _checked_inputs(dag, spec, vllm_engines=engine_factory is None, console=console)
    if spec.store is not None:
        inputs = replace(inputs, store_keys={name: NodeKeys.of(dag, node, spec.devices.kind, spec.home)
                                             for name, node in dag.nodes.items() if not dag.on_endpoints(name)})
    # a run the result store answers whole computes nothing: no length model's fit, no plan
    store = ResultStore(spec.store) if spec.store is not None else None  # a path that is no store: exit 2 before anything is written
    stored_whole = spec.store is not None and answered_whole(dag, inputs.sources, spec.store, spec.devices.kind, spec.home)
    planning, planned_at = None, time.monotonic()
    lengths = _length_models(dag, spec.home, console) if not stored_whole else LengthModels({}, {}, {}, frozenset())
    inputs = replace(inputs, known_prompt_sets=lengths.known_prompt_sets)
    on_devices = dag.on_devices()  # the part the planner places: nodes on servers take no devices
    if spec.planned and on_devices.nodes and not stored_whole:
        planning, why_not = _calibrated_planning(on_devices, inputs.sources, spec.devices, spec.schedule, spec.profiles_root,
                                                 spec.home, lengths,
                                                 server_node_facts(dag, measured_paces(dag, ServerPaceStore(spec.home))))
        if planning is None:
            console.print(f"[yellow]no plan:[/yellow] {why_not}; running node by node on all devices", soft_wrap=True)
        for note in planning.calibration.problem.notes if planning and planning.calibration else ():  # e.g. what the profile differs in from this machine
            console.print(f"plan note: {note}", markup=False, highlight=False, soft_wrap=True)
    planning = planning or RunPlanning(SequentialStages(spec.devices, on_devices.topological_order()))
    start = CommandStart(entered_s, planned_at - checked_at, checks_s, time.monotonic() - planned_at)
    replanner = None
    if cluster is not None:
        from batchllm.cluster.replan import NodeLossReplanner
        from batchllm.engines.ray_engine import start_ray_engine

        engine_factory = engine_factory or with_endpoints(start_ray_engine)
        replanner = NodeLossReplanner(cluster.alive_nodes, lambda left: _planning_for(on_devices, inputs.sources, left, spec))
    sampler = LengthSampler(node_fingerprints(dag, inputs.sources), {name: node.model for name, node in dag.nodes.items()},
                            installed_engine_version())
    timed = _command_timing(spec, dag, checks_s) if engine_factory is None and cluster is None else None
    run_dir = RunDir(spec.out)
    run_dir.open(fresh=spec.fresh)
    try:
        with _run_gc(), RunProgress(console, status_path=run_dir.status_path) as progress:
            reuse = RunReuse(store, f"{spec.out} {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}", progress.note) if store is not None else None
            executor = Executor(spec, inputs, run_dir, engine_factory or with_endpoints(start_vllm_engine), progress, planning,
                                RequestPreparer(spec.prefix_order), replanner, sampler, reuse, early)
            if timed is not None:
                executor.report.command_start_s, progress.end_s = process_age_s(), timed.expected_end_s
                executor.report.start = start
            try:
                result = executor.run()
            except KeyboardInterrupt:
                progress.close("interrupted")
                raise
            except RunIncomplete:
                progress.close("incomplete")
                raise
            finally:
                if reuse is not None:
                    reuse.close()
                if first_key is not None and executor.engines.first_wanted:
                    _keep_first_engines(spec.home, first_key, executor.engines.first_wanted, console)
                _save_learnt(executor.planning.calibration, console)
                _save_lengths(sampler, spec.home, console)
                _save_server_paces(dag, progress, spec.home, console)
            progress.close("incomplete" if spec.pilots_only else "finished")
        if timed is not None:
            timed.record(result.report, console)
        return result, progress
    finally:
        run_dir.close()


def _checked_inputs(dag: DagSpec, spec: RunSpec, *, vllm_engines: bool, console: Console) -> tuple[RunInputs, float]:
    """Every check of the DAG before anything is written: its inputs, its servers (each answers
    and serves its model), vLLM's verdict on its settings (`vllm_engines`; a caller's own engines
    check their own), its copy targets. Also how long vLLM's check took (a later command finds
    its verdict kept)."""
    sources = check_dag(dag, spec.home)
    endpoints = check_endpoints(dag)
    checks_s = 0.0
    if vllm_engines:
        checked_at = time.monotonic()
        check_engine_settings(dag, spec.home, spec.devices.kind)
        checks_s = time.monotonic() - checked_at
        if note := untested_vllm_note():
            console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    for name, output in dag.outputs.items():  # a bad target found at the end would cost the run's hours
        if output.copy_to is not None:
            check_copy_target(output.copy_to, where=dag.where(output.line, f"outputs.{name}.copy_to"))
    return RunInputs(dag, sources, endpoints, frozenset(), node_vector_dimensions(dag, spec.home)), checks_s


def _length_models(dag: DagSpec, home: Path, console: Console) -> LengthModels:
    """The length models the DAG's models have here (fit again when new outputs were filed)."""
    lengths = LengthModels.at_home(home, [node.model for node in dag.nodes.values()])
    for model, why in lengths.verdicts.items():
        console.print(f"length model for {model}: {why}", markup=False, highlight=False, soft_wrap=True)
    return lengths


def _planning_for(dag: DagSpec, sources: dict[str, InputSource], devices: DeviceSet, spec: RunSpec) -> RunPlanning:
    """How stages are chosen on these devices, as `run_dag` picks it (without its notes)."""
    planning = _calibrated_planning(dag, sources, devices, spec.schedule, spec.profiles_root, spec.home)[0] if spec.planned else None
    return planning or RunPlanning(SequentialStages(devices, dag.topological_order()))


def _calibrated_planning(dag: DagSpec, sources: dict[str, InputSource], devices: DeviceSet, method: str,
                         profiles_root: Path, home: Path | None = None, lengths: LengthModels | None = None,
                         outside: dict[str, NodeFacts] | None = None) -> tuple[RunPlanning | None, str | None]:
    """Stages planned on a cost model that calibrates itself as the run goes, starting from
    what the local profile store learnt on this machine, else the shipped profiles; `outside`:
    the nodes on servers its nodes read (`server_node_facts`)."""
    cluster = local_cluster(devices.kind, len(devices.ids), devices.node_sizes)
    store = ProfileStore.at_home(home or batchllm_home())
    try:
        workloads = dag_workloads(dag, sources, cluster, profiles_root, store, home or batchllm_home(),
                                  lengths=lengths.planned(dag) if lengths is not None else None,
                                  outside=outside)
    except UserError as missing:
        return None, missing.paragraph()
    calibration = RunCalibration(build_problem(cluster, workloads.planning_nodes(), workloads.notes), workloads.nodes, store=store,
                                 settings=run_settings(dag.engine, cluster), source=f"a run of {dag.name}",
                                 log_shifts=lengths.log_shifts(dag) if lengths is not None else None)
    return RunPlanning(CalibratedStages(calibration, method), (calibration, RunEstimates(calibration, method)), calibration,
                       calibration.lengths), None


@dataclass(frozen=True)
class _CommandTiming:
    """A CLI command's own start and end on this machine: what was kept, and where to keep more."""

    store: CommandTimesStore
    identity: HardwareIdentity
    key: str
    kept: CommandTimes | None
    checks_s: float  # of this command's start: vLLM's settings check

    @property
    def expected_end_s(self) -> float:
        return self.kept.end_s if self.kept is not None else 0.0

    def record(self, report: RunReport, console: Console) -> None:
        """This command's start (to its first stage) and end (from its stage loop's end to now)."""
        if report.command_start_s is None:
            return
        end_s = max(0.0, process_age_s() - report.command_start_s - report.wall_s)
        try:
            self.store.record(self.identity, self.key, report.command_start_s, end_s, self.checks_s)
        except OSError as error:
            console.print(f"this command's start and end were not kept: {error}", markup=False, highlight=False, soft_wrap=True)


def _command_timing(spec: RunSpec, dag: DagSpec, checks_s: float) -> _CommandTiming | None:
    if spec.command is None:
        return None
    store, identity = CommandTimesStore.at_home(spec.home), this_machine(spec.devices.kind)
    key = command_key(spec.command, [node.model for node in dag.nodes.values()])
    return _CommandTiming(store, identity, key, store.load(identity, key), checks_s)


def _keep_first_engines(home: Path, key: str, configs: list[EngineConfig], console: Console) -> None:
    try:
        FirstEngines(home).save(key, configs)
    except OSError as error:
        console.print(f"the first engines were not kept for the next command: {error}", markup=False, highlight=False, soft_wrap=True)


def _save_lengths(sampler: LengthSampler, home: Path, console: Console) -> None:
    """The answer lengths a run saw go to the length model's store (never fails the run)."""
    try:
        saved = sampler.save(home)
    except OSError as error:
        console.print(f"the answer lengths seen were not saved: {error}", markup=False, highlight=False, soft_wrap=True)
        return
    if saved:
        console.print(f"{saved:,} answer lengths filed for the length model", markup=False, highlight=False, soft_wrap=True)


def _save_server_paces(dag: DagSpec, progress: RunProgress, home: Path, console: Console) -> None:
    """How fast the servers answered goes to the local store for later plans (never fails the run)."""
    try:
        lines = save_server_paces(dag, progress.stats, home)
    except OSError as error:
        lines = [f"the servers' pace was not saved: {error}"]
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _save_learnt(calibration: RunCalibration | None, console: Console) -> None:
    """What a calibrated run measured goes to the local profile store (never fails the run)."""
    if calibration is None:
        return
    try:
        lines = calibration.save()
    except (OSError, UserError) as error:
        lines = [f"the learnt profile was not saved: {error}"]
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
