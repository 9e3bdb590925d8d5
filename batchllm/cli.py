"""The `batchllm` command line. Thin: parse options, call the library, map errors to exit codes.

Exit codes: 0 done; 1 the run is incomplete (a node failed, its cause is printed);
2 bad input (nothing was run or written); 130 interrupted (resumable).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from batchllm.core.errors import USAGE_EXIT_CODE, RunIncomplete, UserError
from batchllm.core.process_clock import process_age_s
from batchllm.engines.devices import parse_devices
from batchllm.models.embedded import EMBEDDED_MODELS
from batchllm.models.registry import batchllm_home
from batchllm.runtime.console import run_console

app = typer.Typer(
    help="Offline batch inference for multi-LLM pipelines: a YAML DAG of LLM stages over Parquet, run on vLLM.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="Embedded models that need no network.", no_args_is_help=True)
app.add_typer(models_app, name="models")

DAG_ARGUMENT = typer.Argument(..., help="The DAG file (YAML): inputs, nodes, outputs.", show_default=False)


def _fail(error: UserError) -> None:
    Console(stderr=True, highlight=False).print(f"[red]error:[/red] {error.paragraph()}", markup=True, soft_wrap=True)
    raise typer.Exit(USAGE_EXIT_CODE)


@contextmanager
def _run_exits() -> Iterator[None]:
    """How a run ends for the shell: 2 bad input (nothing ran), 1 incomplete, 130 interrupted."""
    try:
        yield
    except UserError as error:
        _fail(error)
    except RunIncomplete as incomplete:
        console = run_console()
        console.print(f"[red]run incomplete:[/red] {escape(str(incomplete))}. Fix the cause and run the same command again to "
                      "resume.", soft_wrap=True)
        for name, path in incomplete.outputs.items():
            console.print(f"{name}: {path} (incomplete: the results so far; the run that completes replaces it)", markup=False,
                          highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        run_console().print("interrupted: finished results are kept; run the same command again to resume.")
        raise typer.Exit(130)


@app.command()
def run(
    dag: Path = DAG_ARGUMENT,
    out: Path = typer.Option(None, "--out", "-o", help="Output folder. Default: runs/<DAG file name>."),
    devices: str = typer.Option("auto", help="Devices to use: auto, cpu:N, gpu:N, or ids such as cpu:0,1; ray: every "
                                "node's GPUs (or CPU cores) of the Ray cluster."),
    cluster: str = typer.Option(None, help="Where engines run: local (processes here; the default), ray (RAY_ADDRESS, or "
                                "this machine's Ray cluster), ray://host:port or host:port. RAY_ADDRESS set means ray."),
    fresh: bool = typer.Option(False, "--fresh", help="Discard results of an earlier run in --out instead of resuming."),
    prefix_order: bool = typer.Option(True, "--prefix-order/--no-prefix-order",
                                      help="Send each node's requests so shared prompt prefixes run together (prefix cache hits)."),
    schedule: str = typer.Option("plan", help="plan: batchllm's stages of models side by side, re-planned at every stage end "
                                 "(needs a profile per model, else sequential); max: each node alone on all devices; min: "
                                 "every ready node on its smallest plan; sequential: node by node, one engine on all devices."),
    pilot: str = typer.Option("0.5%", help="A node whose prompt set is new starts with this random sample of its rows "
                              "(a share, kept within 64-2,000 rows, or a number of rows); the rest is planned on its answer lengths."),
    no_pilot: bool = typer.Option(False, "--no-pilot", help="Start every node on the profile's answer lengths, without a pilot."),
    endpoint: list[str] = typer.Option(None, "--endpoint", metavar="MODEL=URL", help="Send MODEL's requests to this running "
                                       "OpenAI-compatible server (vLLM, SGLang; e.g. http://gpu-box:8000/v1) beside its online "
                                       "traffic, instead of to engines on --devices. Repeat for several servers; replaces the "
                                       "DAG's `endpoints:` URLs of MODEL."),
) -> None:
    """Run every node of DAG and write Parquet results.

    Results are committed as each request finishes: run the same command again after a
    crash or Ctrl-C and it resumes, computing each (node, row, step) exactly once. A run
    that is already complete starts no engine.

    Example: batchllm run dags/ensemble_judge.yaml --out runs/demo --devices cpu:2
    """
    from batchllm.cluster.session import open_cluster
    from batchllm.dag.endpoints_section import with_endpoint_options
    from batchllm.dag.loader import load_dag
    from batchllm.runtime.launch import run_dag
    from batchllm.runtime.memory import limit_malloc_arenas
    from batchllm.runtime.pilot import PilotSize
    from batchllm.runtime.run_spec import RunSpec

    limit_malloc_arenas()  # this process is the driver, from here on (runtime/memory.py says why)
    console = run_console()
    out = out or Path("runs") / dag.stem
    session = None
    try:
        with _run_exits():
            session = open_cluster(cluster, devices)
            device_set = session.devices() if session else parse_devices(devices)
            if session:
                console.print(f"Ray cluster {session.address}: {device_set}", highlight=False)
            pilot_size = None if no_pilot else PilotSize.parse(pilot)
            spec = with_endpoint_options(load_dag(dag), endpoint or [])
            result, progress = run_dag(spec, RunSpec(out, device_set, fresh=fresh, schedule=schedule, prefix_order=prefix_order,
                                                     pilot=pilot_size, command="run"), console=console, cluster=session)
    finally:
        if session:
            session.close()
    from batchllm.runtime.run_summary import closing_lines

    for line in closing_lines(result, progress, out):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    for name, path in result.outputs.items():
        typer.echo(f"{name}: {path}")


@app.command("run-batch")
def run_batch(
    input_file: Path = typer.Option(..., "--input", "-i", help="OpenAI batch request file (JSONL lines: custom_id, method, url, "
                                    "body) for /v1/chat/completions, /v1/completions, /v1/embeddings, /score and /rerank.", show_default=False),
    output: Path = typer.Option(..., "--output", "-o", help="Results file: one OpenAI batch output line per request, in order.",
                                show_default=False),
    model: list[str] = typer.Option(None, "--model", metavar="NAME=LOCAL", help="NAME=LOCAL: run body.model NAME on LOCAL (an embedded model such as "
                                    "smollm2-135m, a model directory or a hub id). Repeat for more models."),
    models: Path = typer.Option(None, "--models", help="YAML file mapping body.model names to local models (NAME: LOCAL)."),
    run_dir: Path = typer.Option(None, "--run-dir", help="Run folder (results as they commit, node files, logs). "
                                 "Default: runs/<results file name without extension>."),
    devices: str = typer.Option("auto", help="Devices to use: auto, cpu:N, gpu:N, or ids such as cpu:0,1."),
    fresh: bool = typer.Option(False, "--fresh", help="Discard results of an earlier run in the run folder instead of resuming."),
    schedule: str = typer.Option("plan", help="plan, max, min or sequential, as for `batchllm run`."),
    engine: list[str] = typer.Option(None, "--engine", metavar="KEY=VALUE", help="An engine setting, as a DAG's `engine:` "
                                     "takes it: max_model_len, max_num_seqs, kv_cache_memory_bytes, enforce_eager. Repeat for more."),
) -> None:
    """Run an OpenAI batch file on local models and write OpenAI batch output lines.

    Each line's body.model runs on the local model it is mapped to (an embedded model's own
    name needs no mapping); lines of different models or sampling become nodes the planner
    runs side by side. A bad line gets its own error and the others still run. Results are
    committed as they finish: after a crash or Ctrl-C run the same command again and it
    resumes, each request computed once. The results file is written at the end.

    Example: batchllm run-batch -i requests.jsonl -o results.jsonl --model gpt-4o-mini=smollm2-135m
    """
    from batchllm.openai_batch import model_map
    from batchllm.openai_batch import run_batch as run_batch_file
    from batchllm.runtime.memory import limit_malloc_arenas

    limit_malloc_arenas()  # this process is the driver, from here on (runtime/memory.py says why)
    console = run_console()
    with _run_exits():
        mapping = model_map(model or [], models, batchllm_home())
        done = run_batch_file(input_file, output, mapping, run_dir=run_dir or Path("runs") / output.stem,
                              devices=parse_devices(devices), fresh=fresh, schedule=schedule, console=console,
                              engine=_key_values(engine or [], "--engine"))
    for line in done.summary:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    failed = ", ".join(f"{count:,} {code}" for code, count in done.counts.failed.items())
    typer.echo(f"{done.output}: {done.counts.lines:,} lines, {done.counts.succeeded:,} succeeded"
               + (f", {sum(done.counts.failed.values()):,} failed ({failed})" if failed else ""))


def _key_values(items: list[str], option: str) -> dict[str, object]:
    """KEY=VALUE options, each value read as YAML reads a scalar (1 -> 1, true -> True)."""
    import yaml

    values: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"{option} {item!r} is not KEY=VALUE", where=option, hint=f"e.g. {option} max_num_seqs=64")
        values[key] = yaml.safe_load(value)
    return values


@app.command()
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
        report, chart, html_path = _planned(dag, devices, chart, profiles, compare, endpoint or [])
    except UserError as error:
        _fail(error)
    if as_json:
        typer.echo(json.dumps({**report_json(report), "chart_png": str(chart), "chart_html": str(html_path)}, indent=2))
        return
    console = Console(highlight=False, width=max(Console().width, 120))
    print_report(report, console)
    console.print(f"gantt chart: {chart} and {html_path}")


def _planned(dag: Path, devices: str, chart: Path | None, profiles: Path | None, compare: bool, endpoint: list[str]):
    """The plan report of DAG on `devices` (this machine's: its models and settings checked as
    `run` checks them), its Gantt chart written: (report, chart PNG, chart HTML)."""
    from dataclasses import replace

    from batchllm.dag.endpoints_section import with_endpoint_options
    from batchllm.dag.loader import load_dag
    from batchllm.engines.settings_check import check_engine_settings
    from batchllm.io.dag_checks import check_dag
    from batchllm.planner.gantt import chart_paths, write_html, write_png
    from batchllm.planner.length_sources import LengthModels
    from batchllm.planner.plan_file import PROFILES_ROOT, plan_dag

    this_machine = _this_machine_devices()
    spec = with_endpoint_options(load_dag(dag), endpoint)
    if devices in ("auto", this_machine):  # a plan for this machine: its models and settings are checked as `run` does
        devices = this_machine
        check_dag(spec, batchllm_home())
        check_engine_settings(spec, batchllm_home(), parse_devices("auto").kind)
    chart, html_path = chart_paths(chart or Path("plans") / f"{dag.stem}-{devices.replace(':', '').replace('/', '_')}.png")
    models = [node.model for node in spec.nodes.values()]
    lengths = LengthModels.at_home(batchllm_home(), models)
    report = plan_dag(spec, devices, profiles_root=profiles or PROFILES_ROOT, compare=compare,
                      lengths_for=lengths.lengths_for if lengths.models else None)
    if devices == this_machine:  # what `run` itself takes here, before and after its stages
        command, source = _run_command_times(spec, fallback="plan --pilot")
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
    with _run_exits():
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


def _run_command_times(spec, fallback: str | None = None):
    """A `run` of this DAG's models on this machine: its own start and end as kept here, else
    (`fallback`) another command's that does the same imports and checks, less vLLM's settings
    check (whose verdict that command kept for the run); with where they come from. (None, "")
    when none was measured."""
    from batchllm.costmodel.command_times import CommandTimesStore, command_key
    from batchllm.engines.hardware import this_machine

    store, identity = CommandTimesStore.at_home(batchllm_home()), this_machine(parse_devices("auto").kind)
    models = [node.model for node in spec.nodes.values()]
    if (times := store.load(identity, command_key("run", models))) is not None:
        return times, f"measured on this machine over {times.commands} `run` command{'s' if times.commands != 1 else ''}"
    if fallback and (times := store.load(identity, command_key(fallback, models))) is not None:
        return times.with_checks_kept(), f"a `{fallback}`'s start and end, less the settings check `run` finds kept"
    return None, ""


def _this_machine_devices() -> str:
    from batchllm.engines.devices import hardware_name

    local = parse_devices("auto")
    return f"{len(local.ids)}x{hardware_name('gpu')}" if local.kind == "gpu" else f"cpu:{len(local.ids)}"


@app.command()
def status(
    out: Path = typer.Argument(..., help="The --out folder of a run (going, interrupted or finished).", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
) -> None:
    """Show how far a run is: per node, results committed / total, failed, tokens, time left.

    Works while the run goes (it rewrites its status every few seconds), after it was
    interrupted (run the same command again to resume), and after it finished.

    Example: batchllm status runs/demo --json
    """
    import json

    from batchllm.runtime.status import read_status, status_json, status_lines

    try:
        current = read_status(out)
    except UserError as error:
        _fail(error)
    if as_json:
        typer.echo(json.dumps(status_json(current), indent=2))
        return
    for line in status_lines(out, current):
        typer.echo(line)


@app.command()
def validate(
    dag: Path = DAG_ARGUMENT,
    endpoint: list[str] = typer.Option(None, "--endpoint", metavar="MODEL=URL", help="As for `batchllm run`: check this server too."),
) -> None:
    """Check DAG, its input files, its models and the engine settings without running anything.

    Models must be on this machine (an embedded name, a complete model directory, or a hub
    id in the local Hugging Face cache); vLLM's own configuration checks judge the engine
    settings against each model (the first check of a model and settings takes a few seconds).
    A model on servers (`endpoints:`) needs no files here: each server must answer, serve it
    and take the API key.
    """
    from batchllm.dag.endpoints_section import with_endpoint_options
    from batchllm.dag.loader import load_dag
    from batchllm.dag.warnings import dag_warnings
    from batchllm.engines.endpoint.server_check import check_endpoints
    from batchllm.engines.settings_check import check_engine_settings
    from batchllm.io.dag_checks import check_dag

    try:
        spec = with_endpoint_options(load_dag(dag), endpoint or [])
        check_dag(spec, batchllm_home())
        check_endpoints(spec)
        check_engine_settings(spec, batchllm_home(), parse_devices("auto").kind)
    except UserError as error:
        _fail(error)
    for warning in dag_warnings(spec):
        typer.echo(f"warning: {warning}", err=True)
    typer.echo(f"{dag}: ok ({len(spec.nodes)} nodes: {', '.join(spec.topological_order())})")


@app.command()
def profile(
    model: str = typer.Option("smollm2-135m", help="Model to profile: an embedded name or a model directory."),
    devices: str = typer.Option("auto", help="Devices: every replica shape that fits on them is profiled."),
    out: Path = typer.Option(Path("profiles"), help="Profiles folder; writes <out>/<hardware>/<model>/."),
    quick: bool = typer.Option(False, "--quick", help="About two minutes: a short mix of prompts per replica shape calibrates "
                               "the model's prior (output lengths kept) into the local profile store under $BATCHLLM_HOME, "
                               "which the next plan and run on this machine start from. --out is not used."),
) -> None:
    """Measure MODEL on the real engine: load time, KV capacity and step latency per
    replica shape, and its output-length distribution. The planner reads the result.

    A pooling model (an embedding model such as minilm-l6, or a classifier) is measured
    on its prefill steps alone, in about a minute.

    Runs calibrate themselves as they go and keep what they learn; --quick does it before
    the first run."""
    from batchllm.costmodel.profile import profile_dir
    from batchllm.engines.devices import hardware_name
    from batchllm.engines.process_engine import start_vllm_engine
    from batchllm.models.registry import resolve_model
    from batchllm.profiling.pooling import pooling_task, profile_pooling_model
    from batchllm.profiling.profiler import ProfileSettings, profile_model

    console = run_console()
    try:
        device_set = parse_devices(devices)
        ref = resolve_model(model, dag_dir=Path.cwd(), home=batchllm_home(), where="--model")
        hardware = hardware_name(device_set.kind)
        target = profile_dir(out, hardware, ref.name.replace("/", "_"))
        model_dir = Path(ref.materialise(batchllm_home()))
        task = pooling_task(model_dir)
        if quick and task is not None:
            raise UserError(f"model {model!r} is a pooling model ({task.value}): its profile is quick already", where="--quick",
                            hint=f"run `batchllm profile --model {model}` without --quick")
    except UserError as error:
        _fail(error)
    if quick:
        _profile_quick(model, devices)
        return
    logs = target / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if task is not None:
        result, tables = profile_pooling_model(ref.name, model_dir, task, device_set, hardware, start_vllm_engine, logs, console.print)
    else:
        result, tables = profile_model(ref.name, model_dir, device_set, hardware, start_vllm_engine, ProfileSettings(), logs,
                                       console.print)
    result.save(target, tables)
    typer.echo(f"profile: {target}")


def _profile_quick(model: str, devices: str) -> None:
    from batchllm.costmodel.calibration.store import ProfileStore
    from batchllm.engines.process_engine import start_vllm_engine
    from batchllm.models.registry import resolve_model
    from batchllm.planner.plan_file import PROFILES_ROOT
    from batchllm.profiling.quick import quick_profile

    console = run_console()
    try:
        device_set = parse_devices(devices)
        ref = resolve_model(model, dag_dir=Path.cwd(), home=batchllm_home(), where="--model")
        model_dir = Path(ref.materialise(batchllm_home()))
        _, folder = quick_profile(ref.name.replace("/", "_"), model_dir, device_set, start_vllm_engine, PROFILES_ROOT,
                                  ProfileStore.at_home(batchllm_home()), lambda line: console.print(line, markup=False, highlight=False))
    except UserError as error:
        _fail(error)
    typer.echo(f"learnt profile: {folder}")


@models_app.command("list")
def models_list() -> None:
    """List embedded models and whether they are prepared."""
    home = batchllm_home()
    for name, model in EMBEDDED_MODELS.items():
        state = "prepared" if model.is_prepared(home) else "not prepared yet"
        typer.echo(f"{name}\t{state}\t{model.description}")


@models_app.command("prepare")
def models_prepare(name: str = typer.Argument("smollm2-135m", help="Embedded model name (`batchllm models list`).")) -> None:
    """Convert or unpack an embedded model once into $BATCHLLM_HOME (default ~/.cache/batchllm)."""
    if name not in EMBEDDED_MODELS:
        _fail(UserError(f"unknown embedded model {name!r}", hint=f"choose one of: {', '.join(EMBEDDED_MODELS)}"))
    try:
        path = EMBEDDED_MODELS[name].prepare(batchllm_home())
    except UserError as error:
        _fail(error)
    typer.echo(str(path))


def main() -> None:
    app()
