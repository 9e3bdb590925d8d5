"""`batchllm plan`: the schedule of a DAG, from the profiles or from pilots run here, and what a
`run` of it takes on this machine beyond its stages."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from batchllm.cli.shell import DAG_ARGUMENT, fail, run_exits
from batchllm.core.errors import UserError
from batchllm.core.process_clock import process_age_s
from batchllm.engines.devices import parse_devices
from batchllm.models.registry import batchllm_home
from batchllm.runtime.console import run_console

if TYPE_CHECKING:
    from batchllm.costmodel.command_times import CommandTimes
    from batchllm.dag.model import DagSpec
    from batchllm.planner.plan_file import PlanReport
    from batchllm.planner.timeline import LoadingEngine
    from batchllm.runtime.reuse_census import NodeCensus


def plan(
    dag: Path = DAG_ARGUMENT,
    devices: str = typer.Option("auto", help="Hardware to plan for: 8xA100-80G, 2xH100-80G, cpu:2. auto: this machine."),
    compare: bool = typer.Option(False, "--compare", help="Also estimate greedy, no-preemption, Max, Min, exact (small DAGs) and the lower bound."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON instead of tables."),
    chart: Path = typer.Option(None, help="Gantt chart PNG path (an HTML file is written beside it). Default: plans/<DAG>-<devices>.png."),
    profiles: Path = typer.Option(None, help="Profiles folder. Default: the profiles/ shipped with batchllm."),
    pilot: bool = typer.Option(False, "--pilot", help="Run each new prompt set's pilot on this machine's real engines first "
                               "(into --out, where `run` finds it done) and estimate the rest from the answers it measured."),
    out: Path = typer.Option(None, "--out", "-o", help="With --pilot: the run folder. Default: runs/<DAG file name>, as `run`."),
    endpoint: list[str] = typer.Option(None, "--endpoint", metavar="MODEL=URL", help="As for `batchllm run`: MODEL is on this "
                                       "server (its nodes get no devices; their time comes from the pace a run measured there)."),
) -> None:
    """Find a fast schedule for DAG: stages of (node, dp x tp plan) on the devices.

    Estimates come from the model profiles (measured, or analytic for GPUs this machine
    lacks): output lengths sampled from each model's distribution, the engine's batching
    simulated step by step. The search grows each stage greedily by throughput per
    device (SamuLLM's Algorithm 1), ends a stage when its first node finishes, and
    re-plans the devices then; rollouts try nearby stages. Nothing is run. Planned for
    this machine, the models and engine settings are checked as `validate` checks them.

    With --pilot, the answer lengths come from the data itself: a random sample of each
    new prompt set's rows runs first (as `run` would start it; its results are kept), and
    the estimate is made from what it measured, pilot time included.

    First comes a pre-flight table, per node: rows, prompt tokens (p50/p90/max of a sample),
    rows whose prompt does not fit the context (they would get `error:` results), predicted
    output tokens and where the prediction comes from, the time the node holds devices,
    device-hours, and the cost when the DAG has `prices:`.

    Example: batchllm plan dags/ensemble_judge.yaml --devices 8xA100-80G --compare
    """
    import json

    from batchllm.planner.report import print_report, report_json

    if pilot:
        _plan_with_pilots(dag, devices, out or Path("runs") / dag.stem, profiles, as_json, endpoint or [], chart)
        return
    try:
        census = _census(dag, devices, endpoint or [])
        report, chart, html_path = _planned(dag, devices, chart, profiles, compare, endpoint or [],
                                            {node.node: node.stored / node.units for node in census if node.units})
    except UserError as error:
        fail(error)
    if as_json:
        stored = {"stored": {node.node: {"stored": node.stored, "units": node.units} for node in census}} if census else {}
        typer.echo(json.dumps({**report_json(report), "chart_png": str(chart), "chart_html": str(html_path), **stored}, indent=2))
        return
    console = Console(highlight=False, width=max(Console().width, 120))
    print_report(report, console)
    console.print(f"gantt chart: {chart} and {html_path}")
    if any(node.stored for node in census):
        from batchllm.io.result_store import default_store_path

        console.print(f"the result store ({default_store_path(batchllm_home())}) answers, of each node's requests (`run` takes "
                      f"them from the store; the estimate above computes the rest only, {(report.all_computed_s or 0.0) - report.chosen.total_s:,.0f} s "
                      "less than computing every request):", soft_wrap=True)
        for node in census:
            console.print(f"  {node.line()}", markup=False)


def _census(dag: Path, devices: str, endpoint: list[str]) -> list[NodeCensus]:
    """What the result store answers of the DAG's requests, for a plan of this machine (else none)."""
    if devices not in ("auto", _this_machine_devices()):
        return []
    from batchllm.dag.endpoints_section import with_endpoint_options
    from batchllm.dag.loader import load_dag
    from batchllm.io.input_source import open_inputs
    from batchllm.io.result_store import default_store_path
    from batchllm.runtime.reuse_census import stored_census

    spec = with_endpoint_options(load_dag(dag), endpoint)
    sources = open_inputs(spec.inputs)
    try:
        census = stored_census(spec, sources, default_store_path(batchllm_home()), parse_devices("auto").kind, batchllm_home())
    except UserError as error:
        fail(error)
        raise
    finally:
        for source in sources.values():
            source.close()
    return census


def _planned(dag: Path, devices: str, chart: Path | None, profiles: Path | None, compare: bool,
             endpoint: list[str], answered_share: dict[str, float] | None = None) -> tuple[PlanReport, Path, Path]:
    """The plan report of DAG on `devices` (this machine's: its models and settings checked as
    `run` checks them), its Gantt chart written: (report, chart PNG, chart HTML). `answered_share`:
    by node, the share of its requests the result store answers (the chosen schedule is of the rest)."""
    from dataclasses import replace

    from batchllm.costmodel.command_times import CommandTimes
    from batchllm.dag.endpoints_section import with_endpoint_options
    from batchllm.dag.loader import load_dag
    from batchllm.engines.settings_check import check_engine_settings
    from batchllm.io.dag_checks import check_dag
    from batchllm.planner.gantt import chart_paths, write_html, write_png
    from batchllm.planner.length_sources import LengthModels
    from batchllm.planner.plan_file import PROFILES_ROOT, plan_dag

    this_machine = _this_machine_devices()
    spec = with_endpoint_options(load_dag(dag), endpoint)
    set_aside_s = 0.0  # of this command's own start: what a `run` after it does not do (vLLM's check, its verdict kept)
    if devices in ("auto", this_machine):  # a plan for this machine: its models and settings are checked as `run` does
        devices = this_machine
        check_dag(spec, batchllm_home())
        checked_at = time.monotonic()
        check_engine_settings(spec, batchllm_home(), parse_devices("auto").kind)  # its verdict is kept for the run
        set_aside_s = time.monotonic() - checked_at
    chart, html_path = chart_paths(chart or Path("plans") / f"{dag.stem}-{devices.replace(':', '').replace('/', '_')}.png")
    models = [node.model for node in spec.nodes.values()]
    lengths = LengthModels.at_home(batchllm_home(), models)
    loading = _early_loading(spec) if devices == this_machine else None
    report = plan_dag(spec, devices, profiles_root=profiles or PROFILES_ROOT, compare=compare,
                      lengths=lengths.planned(spec), answered_share=answered_share, loading=loading)
    if devices == this_machine:  # what `run` itself takes here, before and after its stages
        command, source = _run_command_times(spec, fallback="plan --pilot",
                                             this_plan=CommandTimes(max(0.0, process_age_s() - set_aside_s), 0.0))
        if unprepared := _unprepared_embedded_models(spec):
            source += f"; not counted: the conversion of {', '.join(unprepared)}, once per home, at the run's start"
        report = replace(report, command=command, command_source=source)
    try:
        write_png(report, chart)
        write_html(report, html_path)
    except OSError as error:
        raise UserError(f"cannot write the chart {str(chart)!r}: {error.strerror or error}", where="--chart") from error
    return report, chart, html_path


def _plan_with_pilots(dag: Path, devices: str, out: Path, profiles: Path | None, as_json: bool, endpoint: list[str],
                      chart: Path | None) -> None:
    import json

    from batchllm.dag.endpoints_section import with_endpoint_options
    from batchllm.dag.loader import load_dag
    from batchllm.planner.plan_file import PROFILES_ROOT
    from batchllm.planner.report import report_json, with_pilot
    from batchllm.runtime.launch import run_dag
    from batchllm.runtime.memory import limit_malloc_arenas
    from batchllm.runtime.run_spec import RunSpec

    limit_malloc_arenas()
    console = run_console()
    with run_exits():
        if devices not in ("auto", _this_machine_devices()):
            raise UserError(f"--pilot runs on this machine's engines, not on {devices!r}", where="--devices",
                            hint=f"leave --devices out (this machine: {_this_machine_devices()}), or plan without --pilot")
        spec = with_endpoint_options(load_dag(dag), endpoint)
        result, _ = run_dag(spec, RunSpec(out, parse_devices("auto"), pilots_only=True, profiles_root=profiles or PROFILES_ROOT,
                                          command="plan --pilot"), console=Console(quiet=True) if as_json else console)
        run_command, source = _run_command_times(spec, fallback="plan --pilot")
        rest_s = (result.rest_estimate_s or 0.0) + (run_command.total_s if run_command is not None else 0.0)
        if as_json:  # the plan's own schema, on the answer lengths the pilots measured, with the pilots' figures
            report, chart, html_path = _planned(dag, devices, chart, profiles, False, endpoint)
            plan = {**report_json(report), "chart_png": str(chart), "chart_html": str(html_path)}
            typer.echo(json.dumps(with_pilot(plan, process_age_s(), rest_s, str(out)), indent=2))
            return
    pilot_s = process_age_s()  # this command's, from its process's start: the pilots, their engine starts and the checks
    parts = f"`run`'s own start and end {run_command.total_s:.1f} s included, {source}" if run_command is not None else \
        "`run`'s own start and end not measured on this machine yet"
    console.print(f"pilots run in {pilot_s:.1f} s (this command from its start), kept in {out}; the rest estimated at "
                  f"{rest_s:.1f} s on their answer lengths ({parts}): {pilot_s + rest_s:.1f} s in all. "
                  f"`batchllm run {dag} --out {out}` goes on from them.", highlight=False, soft_wrap=True)


def _run_command_times(spec: DagSpec, fallback: str | None = None,
                       this_plan: CommandTimes | None = None) -> tuple[CommandTimes | None, str]:
    """The start and end a `run` of this DAG's models will have on this machine, after this
    command: as kept here for `run`, else (`fallback`) for another command that does the same
    imports and checks, else `this_plan`'s own start; always less vLLM's settings check, whose
    verdict this command keeps for the run. With where they come from; (None, "") when none."""
    from batchllm.costmodel.command_times import CommandTimesStore, command_key
    from batchllm.engines.hardware import this_machine

    store, identity = CommandTimesStore.at_home(batchllm_home()), this_machine(parse_devices("auto").kind)
    models = [node.model for node in spec.nodes.values()]
    if (times := store.load(identity, command_key("run", models))) is not None:
        runs = f"{times.commands} `run` command{'s' if times.commands != 1 else ''}"
        return times.with_checks_kept(), f"measured on this machine over {runs}, with the settings check's verdict kept"
    if fallback and (times := store.load(identity, command_key(fallback, models))) is not None:
        return times.with_checks_kept(), f"a `{fallback}`'s start and end, less the settings check `run` finds kept"
    if this_plan is not None:
        return this_plan, "no `run` measured here yet: this plan's own start, less the settings check and the models' preparation"
    return None, ""


def _early_loading(spec: DagSpec) -> dict[str, LoadingEngine]:
    """The engines a `run` of this DAG on this machine will start as it begins (those an earlier
    command of it kept), as loading for the run's start when its first stage is planned: the
    start kept for `run` here, else this command's own so far."""
    from batchllm.engines.version import installed_engine_version
    from batchllm.planner.timeline import LoadingEngine
    from batchllm.runtime.early_engines import early_plans, first_engines_key, kept_first_engines

    devices = parse_devices("auto")
    configs = kept_first_engines(batchllm_home(), first_engines_key(spec, devices, "plan", installed_engine_version()))
    if not configs:
        return {}
    kept, _ = _run_command_times(spec, fallback="plan --pilot")
    loading_for_s = kept.start_s if kept is not None else process_age_s()
    return {name: LoadingEngine(p.plan, p.devices, p.loading_for_s or 0.0)
            for name, p in early_plans(configs, spec, devices, batchllm_home(), loading_for_s).items()}


def _unprepared_embedded_models(spec: DagSpec) -> list[str]:
    """The DAG's embedded models this home has not converted yet (a `run` converts them first,
    about half a minute each on a CPU)."""
    from batchllm.models.embedded import EMBEDDED_MODELS

    models = {node.model for node in spec.nodes.values()} - set(spec.endpoints)
    return sorted(m for m in models if m in EMBEDDED_MODELS and not EMBEDDED_MODELS[m].is_prepared(batchllm_home()))


def _this_machine_devices() -> str:
    from batchllm.engines.devices import hardware_name

    local = parse_devices("auto")
    return f"{len(local.ids)}x{hardware_name('gpu')}" if local.kind == "gpu" else f"cpu:{len(local.ids)}"
