"""A run of batches in a process of its own: `python -m batchllm.serve.child SPEC.json`.

The spec (`runner.ChildRunner`) names the batches' request and results files and their node
prefixes; they run as one DAG (`openai_batch.run_batches`). The worker starts it and stops it
with SIGINT (SIGTERM works too): the run is then interrupted as Ctrl-C interrupts `batchllm
run-batch`, what finished stays committed in the run folder, and the next run of the same
batches resumes it. It dies with the server (a
`kill -9` of the server leaves no run holding the cores). With `partial` in the spec it
computes nothing: every engine it would start refuses, so the run ends at once and the
results files are written from what is committed, the other lines saying `partial`'s reason.

Exit codes, as `batchllm run-batch`'s: 0 done, 1 incomplete (results file written),
2 bad input (the message on stderr), 130 interrupted.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import NoReturn

from rich.console import Console

from batchllm.core.errors import RunIncomplete, UserError
from batchllm.engines.engine import Engine, EngineFactory, EngineFailed
from batchllm.engines.protocol import EngineConfig
from batchllm.openai_batch import BatchFile, run_batches
from batchllm.runtime.memory import limit_malloc_arenas

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _interrupt(signum: int, frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt


def refusing_engines(reason: str) -> EngineFactory:
    def factory(config: EngineConfig) -> Engine:
        raise EngineFailed(f"engine for {config.model}", reason)

    return factory


def main(spec_path: str) -> int:
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the server ended before the line above
        return 130
    signal.signal(signal.SIGTERM, _interrupt)
    spec = json.loads(Path(spec_path).read_text())
    console = Console(file=sys.stdout, width=100, no_color=True, force_terminal=False, highlight=False)
    limit_malloc_arenas()
    partial = spec.get("partial")
    try:
        files = [BatchFile(Path(b["requests"]), Path(b["results"]), b["prefix"]) for b in spec["batches"]]
        run_batches(files, spec["models"], run_dir=Path(spec["run_dir"]),
                    devices=spec.get("devices", "auto"), schedule="sequential" if partial else spec.get("schedule", "plan"),
                    console=console, engine=spec.get("engine") or None, store=None if partial or not spec.get("store") else Path(spec["store"]),
                    engine_factory=refusing_engines(partial) if partial else None)
    except UserError as error:
        print(f"error: {error.paragraph()}", file=sys.stderr, flush=True)
        return 2
    except RunIncomplete as incomplete:
        print(f"run incomplete: {incomplete}", flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted: finished results are kept", flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
