"""`batchllm serve`: OpenAI's Batch API (Files and Batches endpoints) on this machine's models."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from batchllm.cli.shell import fail
from batchllm.core.errors import UserError
from batchllm.models.registry import batchllm_home


def serve(
    data: Path = typer.Option(Path("serve-data"), "--data", help="Folder of the service's files, batches and run folders. "
                              "Start the server again on the same folder and batches in progress resume."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (127.0.0.1: this machine only)."),
    port: int = typer.Option(8000, help="Port to listen on."),
    model: list[str] = typer.Option(None, "--model", metavar="NAME=LOCAL", help="NAME=LOCAL: run body.model NAME on LOCAL (an "
                                    "embedded model such as smollm2-135m, a model directory or a hub id), as run-batch does. "
                                    "Repeat for more models."),
    models: Path = typer.Option(None, "--models", help="YAML file mapping body.model names to local models (NAME: LOCAL)."),
    devices: str = typer.Option("auto", help="Devices batches run on: auto, cpu:N, gpu:N, or ids such as cpu:0,1."),
    engine: list[str] = typer.Option(None, "--engine", metavar="KEY=VALUE", help="An engine setting for every batch, as "
                                     "run-batch's --engine (max_num_seqs, max_model_len, ...). Repeat for more."),
    api_key_env: str = typer.Option(None, "--api-key-env", metavar="VAR", help="Require `Authorization: Bearer KEY` on every "
                                    "request, KEY being this environment variable's value (the key is never written anywhere)."),
    max_file_size: str = typer.Option("200MB", "--max-file-size", help="Largest file an upload may be."),
    max_file_lines: int = typer.Option(50_000, "--max-file-lines", help="Most lines an uploaded file may have."),
    max_stored: str = typer.Option("10GB", "--max-stored", help="Most bytes of files kept at once (uploads past it are refused)."),
    reuse: bool = typer.Option(True, "--reuse/--no-reuse", help="Answer lines from the result store when it holds the same "
                               "request (as run-batch does); --no-reuse computes every line anew."),
    store: Path = typer.Option(None, "--store", help="The result store (a SQLite file). Default: $BATCHLLM_HOME/results.sqlite."),
) -> None:
    """Serve OpenAI's Batch API on local models: upload a batch file, create a batch, poll it, download its output.

    The same requests as run-batch (/v1/chat/completions, /v1/completions, /v1/embeddings, ...), each
    body.model mapped to a local model. Batches run one after another through run-batch's planner
    and runtime; their lines commit as they finish. Stop the server (Ctrl-C, SIGTERM, even kill -9)
    and start it again on the same --data folder: a batch in progress resumes, each request computed
    once. The page at / shows every batch's progress.

    Example: batchllm serve --model gpt-4o-mini=smollm2-135m --port 8000 --api-key-env BATCHLLM_API_KEY
    """
    from batchllm.cli.run_commands import _key_values
    from batchllm.cli.store_commands import parse_size
    from batchllm.io.result_store import default_store_path
    from batchllm.openai_batch import model_map
    from batchllm.serve.files import Limits
    from batchllm.serve.runner import RunSettings
    from batchllm.serve.server import serve as run_server

    try:
        api_key = None
        if api_key_env:
            api_key = os.environ.get(api_key_env)
            if not api_key:
                raise UserError(f"the environment variable {api_key_env} is not set or empty", where="--api-key-env",
                                hint=f"export {api_key_env}=<a secret> before starting the server")
        from batchllm.engines.devices import parse_devices

        parse_devices(devices)
        home = batchllm_home()
        mapping = model_map(model or [], models, home)
        limits = Limits(parse_size(max_file_size, "--max-file-size"), max_file_lines, parse_size(max_stored, "--max-stored"))
        settings = RunSettings(mapping, devices, _key_values(engine or [], "--engine"),
                               (store or default_store_path(home)) if reuse else None)
    except UserError as error:
        fail(error)
        return
    run_server(data, settings, host=host, port=port, limits=limits, api_key=api_key, say=typer.echo)
