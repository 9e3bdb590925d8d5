"""`batchllm run` without the command line: validate, plan, execute, report."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from batchllm.engines.devices import DeviceSet
from batchllm.engines.process_engine import EngineFactory, start_vllm_engine
from batchllm.errors import UserError
from batchllm.io.input_source import InputSource
from batchllm.io.inputs import load_inputs
from batchllm.models.registry import batchllm_home
from batchllm.planner.cluster import local_cluster
from batchllm.planner.from_dag import dag_workloads
from batchllm.planner.plan_file import PROFILES_ROOT
from batchllm.planner.problem import build_problem
from batchllm.runtime.progress import RunProgress
from batchllm.runtime.request_ordering import PrefixOrdering
from batchllm.runtime.run_dir import RunDir
from batchllm.runtime.sequential import RunResult, SequentialRunner
from batchllm.runtime.stage_planner import SCHEDULE_METHODS, StagePlanner
from batchllm.runtime.staged import StagedRunner
from batchllm.dag.checks import check_dag
from batchllm.dag.loader import load_dag
from batchllm.dag.model import DagSpec

SCHEDULES = (*SCHEDULE_METHODS, "sequential")


def run_dag_file(dag_path: Path, out: Path, devices: DeviceSet, *, fresh: bool = False, console: Console,
                 engine_factory: EngineFactory | None = None, home: Path | None = None,
                 prefix_order: bool = True, schedule: str = "plan",
                 profiles_root: Path = PROFILES_ROOT) -> tuple[RunResult, RunProgress]:
    """Validate everything first (nothing is written on bad input), then run.

    `schedule`: `plan` (batchllm's stages, re-planned at every stage boundary), `max` or
    `min` (the heuristics, for comparison), or `sequential` (node by node on all devices;
    also what `plan` falls back to when a model has no profile for these devices)."""
    if schedule not in SCHEDULES:
        raise UserError(f"unknown schedule {schedule!r}", where="--schedule", hint=f"use one of {', '.join(SCHEDULES)}")
    home = home or batchllm_home()
    dag = load_dag(dag_path)
    sources = check_dag(dag, home)
    planner = None
    if schedule != "sequential":
        planner, why_not = _stage_planner(dag, sources, devices, schedule, profiles_root)
        if planner is None:
            console.print(f"[yellow]no plan:[/yellow] {why_not}; running node by node on all devices")
    # TEMPORARY adapter (issue 13): the old runners still take whole in-memory tables; this
    # line goes when the new executor, which reads `sources` in windows, replaces them.
    tables = load_inputs(dag.inputs)
    run_dir = RunDir(out)
    run_dir.open(fresh=fresh)
    try:
        with RunProgress(console) as progress:
            factory, ordering = engine_factory or start_vllm_engine, PrefixOrdering() if prefix_order else None
            if planner is None:
                runner = SequentialRunner(dag, tables, run_dir, devices, factory, progress, home, ordering)
            else:
                runner = StagedRunner(dag, tables, run_dir, devices, factory, progress, home, planner, ordering)
            result = runner.run()
        return result, progress
    finally:
        run_dir.close()


def _stage_planner(dag: DagSpec, sources: dict[str, InputSource], devices: DeviceSet, method: str,
                   profiles_root: Path) -> tuple[StagePlanner | None, str | None]:
    cluster = local_cluster(devices.kind, len(devices.ids))
    try:
        workloads = dag_workloads(dag, sources, cluster, profiles_root)
    except UserError as missing:
        return None, missing.paragraph()
    return StagePlanner(build_problem(cluster, workloads.nodes, workloads.notes), method), None
