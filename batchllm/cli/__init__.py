"""The `batchllm` command line. Thin: parse options, call the library, map errors to exit codes
(`shell.py` says which). One module per family of commands; they are registered here, in the
order `--help` lists them.
"""

from __future__ import annotations

import typer

from batchllm.cli.check_commands import status, validate
from batchllm.cli.model_commands import models_list, models_prepare, profile
from batchllm.cli.plan_command import plan
from batchllm.cli.run_commands import run, run_batch
from batchllm.cli.serve_command import serve
from batchllm.cli.store_commands import STORE_HELP, store_info, store_prune

app = typer.Typer(
    help="Offline batch inference for multi-LLM pipelines: a YAML DAG of LLM stages over Parquet, run on vLLM.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="Embedded models that need no network.", no_args_is_help=True)
app.add_typer(models_app, name="models")
store_app = typer.Typer(help=STORE_HELP, no_args_is_help=True)
app.add_typer(store_app, name="store")
app.command()(run)
app.command("run-batch")(run_batch)
app.command()(serve)
app.command()(plan)
app.command()(status)
app.command()(validate)
app.command()(profile)
models_app.command("list")(models_list)
models_app.command("prepare")(models_prepare)
store_app.command("info")(store_info)
store_app.command("prune")(store_prune)


def main() -> None:
    app()
