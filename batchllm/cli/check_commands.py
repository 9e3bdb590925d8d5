"""`batchllm status` (how far a run is) and `batchllm validate` (a DAG checked, nothing run)."""

from __future__ import annotations

from pathlib import Path

import typer

from batchllm.cli.shell import DAG_ARGUMENT, fail
from batchllm.core.errors import UserError
from batchllm.engines.devices import parse_devices
from batchllm.models.registry import batchllm_home


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
        fail(error)
    if as_json:
        typer.echo(json.dumps(status_json(current), indent=2))
        return
    for line in status_lines(out, current):
        typer.echo(line)


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
    from batchllm.io.result_store import default_store_path
    from batchllm.runtime.reuse_census import stored_census

    try:
        spec = with_endpoint_options(load_dag(dag), endpoint or [])
        sources = check_dag(spec, batchllm_home())
        check_endpoints(spec)
        kind = parse_devices("auto").kind
        check_engine_settings(spec, batchllm_home(), kind)
        census = stored_census(spec, sources, default_store_path(batchllm_home()), kind, batchllm_home())
    except UserError as error:
        fail(error)
    for warning in dag_warnings(spec):
        typer.echo(f"warning: {warning}", err=True)
    typer.echo(f"{dag}: ok ({len(spec.nodes)} nodes: {', '.join(spec.topological_order())})")
    if any(node.stored for node in census):
        typer.echo(f"the result store ({default_store_path(batchllm_home())}) answers, of each node's requests:")
        for node in census:
            typer.echo(f"  {node.line()}")
