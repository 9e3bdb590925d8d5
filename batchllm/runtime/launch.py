"""`batchllm run` without the command line: validate, then execute, then report."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from batchllm.engines.devices import DeviceSet
from batchllm.engines.process_engine import EngineFactory, start_vllm_engine
from batchllm.models.registry import batchllm_home
from batchllm.runtime.progress import RunProgress
from batchllm.runtime.request_ordering import PrefixOrdering
from batchllm.runtime.run_dir import RunDir
from batchllm.runtime.sequential import RunResult, SequentialRunner
from batchllm.spec.checks import check_dag
from batchllm.spec.loader import load_dag


def run_dag_file(dag_path: Path, out: Path, devices: DeviceSet, *, fresh: bool = False, console: Console,
                 engine_factory: EngineFactory | None = None, home: Path | None = None,
                 prefix_order: bool = True) -> tuple[RunResult, RunProgress]:
    """Validate everything first (nothing is written on bad input), then run."""
    home = home or batchllm_home()
    dag = load_dag(dag_path)
    tables = check_dag(dag, home)
    run_dir = RunDir(out)
    run_dir.open(fresh=fresh)
    try:
        with RunProgress(console) as progress:
            runner = SequentialRunner(dag, tables, run_dir, devices, engine_factory or start_vllm_engine, progress, home,
                                      PrefixOrdering() if prefix_order else None)
            result = runner.run()
        return result, progress
    finally:
        run_dir.close()
