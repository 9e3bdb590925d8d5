"""`batchllm run` (a DAG) and `batchllm run-batch` (an OpenAI batch file): the commands that run engines."""

from __future__ import annotations

from pathlib import Path

import typer

from batchllm.cli.shell import DAG_ARGUMENT, run_exits
from batchllm.core.errors import UserError
from batchllm.engines.devices import parse_devices
from batchllm.models.registry import batchllm_home
from batchllm.runtime.console import run_console


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
    rows: int = typer.Option(None, "--rows", metavar="N", help="A try-out: run on the first N rows of each input (the "
                             "first, not a random sample: the same rows every time). Default --out: runs/<DAG file name>-first<N>. "
                             "Its answers go to the result store, so the whole run after it computes only the rest."),
    reuse: bool = typer.Option(True, "--reuse/--no-reuse", help="Take each request's answer from the result store when it "
                               "holds the same request (same model files, settings, rendered prompt and sampling keys, seed "
                               "included), from any earlier run, DAG or batch file; file what is computed there. --no-reuse "
                               "computes every request anew (and files nothing)."),
    store: Path = typer.Option(None, "--store", help="The result store: a SQLite file, which several runs and machines may "
                               "share (on one machine). Default: $BATCHLLM_STORE, else $BATCHLLM_HOME/results.sqlite."),
    endpoint: list[str] = typer.Option(None, "--endpoint", metavar="MODEL=URL", help="Send MODEL's requests to this running "
                                       "OpenAI-compatible server (vLLM, SGLang; e.g. http://gpu-box:8000/v1) beside its online "
                                       "traffic, instead of to engines on --devices. Repeat for several servers; replaces the "
                                       "DAG's `endpoints:` URLs of MODEL."),
) -> None:
    """Run every node of DAG and write Parquet results.

    Results are committed as each request finishes: run the same command again after a
    crash or Ctrl-C and it resumes, computing each (node, row, step) exactly once. A run
    that is already complete starts no engine.

    Requests answered before (by any run on this machine, see --store) are taken from the
    result store: after an edit only what changed is computed, and a run whose every
    request is stored starts no engine. To draw new samples, change the seed or use --no-reuse.

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
    out = out or Path("runs") / (dag.stem if rows is None else f"{dag.stem}-first{rows}")
    session, undo_sample = None, None
    try:
        with run_exits():
            session = open_cluster(cluster, devices)
            device_set = session.devices() if session else parse_devices(devices)
            if session:
                console.print(f"Ray cluster {session.address}: {device_set}", highlight=False)
            pilot_size = None if no_pilot else PilotSize.parse(pilot)
            spec = with_endpoint_options(load_dag(dag), endpoint or [])
            if rows is not None:
                from batchllm.api import with_first_rows

                spec, undo_sample = with_first_rows(spec, rows, out)
            try:
                result, progress = run_dag(spec, RunSpec(out, device_set, fresh=fresh, schedule=schedule, prefix_order=prefix_order,
                                                         pilot=pilot_size, command="run", store=_store_path(reuse, store)),
                                           console=console, cluster=session)
            except UserError:
                if undo_sample is not None:  # bad input: nothing of this command stays written
                    undo_sample()
                raise
    finally:
        if session:
            session.close()
    from batchllm.runtime.run_summary import closing_lines

    for line in closing_lines(result, progress, out):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    for name, path in result.outputs.items():
        typer.echo(f"{name}: {path}")


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
    reuse: bool = typer.Option(True, "--reuse/--no-reuse", help="Answer lines from the result store when it holds the same "
                               "request (as `batchllm run` does); --no-reuse computes every line anew."),
    store: Path = typer.Option(None, "--store", help="The result store (a SQLite file). Default: $BATCHLLM_STORE, else $BATCHLLM_HOME/results.sqlite."),
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
    with run_exits():
        mapping = model_map(model or [], models, batchllm_home())
        done = run_batch_file(input_file, output, mapping, run_dir=run_dir or Path("runs") / output.stem,
                              devices=parse_devices(devices), fresh=fresh, schedule=schedule, console=console,
                              engine=_key_values(engine or [], "--engine"), store=_store_path(reuse, store))
    for line in done.summary:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    failed = ", ".join(f"{count:,} {code}" for code, count in done.counts.failed.items())
    typer.echo(f"{done.output}: {done.counts.lines:,} lines, {done.counts.succeeded:,} succeeded"
               + (f", {sum(done.counts.failed.values()):,} failed ({failed})" if failed else ""))


def _store_path(reuse: bool, store: Path | None) -> Path | None:
    """The result store a command uses (None: --no-reuse)."""
    from batchllm.io.result_store import default_store_path

    return (store or default_store_path(batchllm_home())) if reuse else None


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
