"""How a command ends for the shell, and the argument every DAG command takes.

Exit codes: 0 done; 1 the run is incomplete (a node failed, its cause is printed);
2 bad input (nothing was run or written); 130 interrupted (resumable).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.markup import escape

from batchllm.core.errors import USAGE_EXIT_CODE, RunIncomplete, UserError
from batchllm.runtime.console import run_console

DAG_ARGUMENT = typer.Argument(..., help="The DAG file (YAML): inputs, nodes, outputs.", show_default=False)


def fail(error: UserError) -> None:
    Console(stderr=True, highlight=False).print(f"[red]error:[/red] {error.paragraph()}", markup=True, soft_wrap=True)
    raise typer.Exit(USAGE_EXIT_CODE)


@contextmanager
def run_exits() -> Iterator[None]:
    """How a run ends for the shell: 2 bad input (nothing ran), 1 incomplete, 130 interrupted."""
    try:
        yield
    except UserError as error:
        fail(error)
    except RunIncomplete as incomplete:
        console = run_console()
        console.print(f"[red]run incomplete:[/red] {escape(str(incomplete))}. Fix the cause and run the same command again to "
                      "resume.", soft_wrap=True)
        for name, path in incomplete.outputs.items():
            console.print(f"{name}: {path} (incomplete: the results so far; the run that completes replaces it)", markup=False,
                          highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        run_console().print("interrupted: finished results are kept; run the same command again to resume.")
        raise typer.Exit(130) from None
