"""`batchllm run-batch` without the command line: request file in, results file out.

The request file is converted once into the run folder (`batch_input`), run as a DAG of one
node per group of lines (`batch_dag`) as `batchllm run` runs a DAG, and the results file is
written from the lines and the node files (`results`). Invariant: the run is `batchllm run`'s,
so its results are committed as they finish and re-running the same command after a crash
resumes, computing each request exactly once; the results file is written only at the end,
whole, also when a node failed (its lines say `not_completed`; exit 1, a re-run resumes).
A bad request file or mapping is a UserError before anything runs, and a run folder this
call created is removed again then.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from batchllm.core.errors import RunIncomplete, UserError
from batchllm.dag.loader import load_dag_mapping
from batchllm.engines.devices import DeviceSet, parse_devices
from batchllm.engines.engine import EngineFactory
from batchllm.openai_batch.batch_dag import BatchMember, batches_dag
from batchllm.openai_batch.batch_input import BatchInput, prepare_batch
from batchllm.openai_batch.results import ResultCounts, write_results
from batchllm.planner.plan_file import PROFILES_ROOT
from batchllm.runtime.console import run_console
from batchllm.runtime.launch import run_dag
from batchllm.runtime.run_dir import RunDir
from batchllm.runtime.run_spec import RunSpec
from batchllm.runtime.run_summary import closing_lines

BATCH_DAG_NAME = "dag"  # the DAG a request file becomes, as its errors name it


@dataclass(frozen=True)
class BatchRun:
    output: Path  # the results file
    run_dir: Path
    batch: BatchInput  # the converted request file and its groups (one node each)
    counts: ResultCounts
    summary: tuple[str, ...]  # the run's summary lines (empty when no line could run)


@dataclass(frozen=True)
class BatchFile:
    """A request file and its results file in a run of several (`run_batches`); `prefix` names its
    nodes apart from the others' (a word and "_", the same on every run of the same folder)."""
    requests: Path
    output: Path
    prefix: str = ""


def run_batch(requests_file: Path, output: Path, models: Mapping[str, str], *, run_dir: Path,
              devices: str | DeviceSet = "auto", fresh: bool = False, schedule: str = "plan", prefix_order: bool = True,
              engine_factory: EngineFactory | None = None, console: Console | None = None,
              profiles_root: Path = PROFILES_ROOT, engine: Mapping[str, Any] | None = None, store: Path | None = None) -> BatchRun:
    """`models`: body.model -> local model, as `model_map` checked it; `engine`: engine
    settings as a DAG's `engine:` section takes them (max_num_seqs, max_model_len, ...);
    `store`: the result store lines are answered from and filed in (None: none).
    Raises RunIncomplete (after writing the results file) when a node failed."""
    return run_batches([BatchFile(Path(requests_file), Path(output))], models, run_dir=run_dir, devices=devices, fresh=fresh,
                       schedule=schedule, prefix_order=prefix_order, engine_factory=engine_factory, console=console,
                       profiles_root=profiles_root, engine=engine, store=store)[0]


def run_batches(files: list[BatchFile], models: Mapping[str, str], *, run_dir: Path,
                devices: str | DeviceSet = "auto", fresh: bool = False, schedule: str = "plan", prefix_order: bool = True,
                engine_factory: EngineFactory | None = None, console: Console | None = None,
                profiles_root: Path = PROFILES_ROOT, engine: Mapping[str, Any] | None = None,
                store: Path | None = None) -> list[BatchRun]:
    """Several request files in one run, one results file each: their nodes in one DAG, which the
    planner runs side by side. `run_batch` is this with one file. Raises RunIncomplete (after
    writing every results file) when a node failed."""
    if len({f.prefix for f in files}) != len(files):
        raise ValueError(f"the files' prefixes must differ, got {[f.prefix for f in files]}")
    run_dir = Path(run_dir)
    for file in files:
        _check_paths(file.requests, file.output)
    state = RunDir(run_dir).state / "batch"
    new_run_dir = not run_dir.exists()
    try:
        if fresh:
            shutil.rmtree(state, ignore_errors=True)
        batches = [prepare_batch(file.requests, models, state) for file in files]
        members = [BatchMember(file.prefix, str(batch.requests_path.absolute()), batch.groups) for file, batch in zip(files, batches)]
        summary: tuple[str, ...]
        incomplete, summary = None, ()
        if any(batch.groups for batch in batches):
            try:
                dag_mapping = batches_dag([m for m in members if m.groups])
                if engine:
                    dag_mapping["engine"] = dict(engine)
                dag = load_dag_mapping(dag_mapping, Path.cwd(), BATCH_DAG_NAME)
                device_set = devices if isinstance(devices, DeviceSet) else parse_devices(devices)
                result, progress = run_dag(dag, RunSpec(run_dir, device_set, fresh=fresh, schedule=schedule, prefix_order=prefix_order,
                                                        profiles_root=profiles_root, store=store),
                                           console=console or run_console(), engine_factory=engine_factory)
                summary = tuple(closing_lines(result, progress, run_dir))
            except RunIncomplete as stopped:
                incomplete = str(stopped)
        runs = []
        for file, batch, member in zip(files, batches, members):
            node_files = {g.node: RunDir(run_dir).node_path(member.node(g)) for g in batch.groups}
            counts = write_results(batch, node_files, file.output, created=int(time.time()), incomplete=incomplete)
            runs.append(BatchRun(file.output, run_dir, batch, counts, summary))
    except UserError:
        if new_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    if incomplete is not None:
        missing = "; ".join(f"{run.counts.failed.get('not_completed', 0):,} lines have no result yet in {run.output}" for run in runs)
        raise RunIncomplete(f"{incomplete}; {missing}")
    return runs


def _check_paths(requests_file: Path, output: Path) -> None:
    if output.is_dir():
        raise UserError(f"the results file {str(output)!r} is a folder", where="-o/--output", hint="name a file, e.g. results.jsonl")
    if output.exists() and requests_file.exists() and output.resolve() == requests_file.resolve():
        raise UserError("the results file is the request file", where="-o/--output", hint="write the results to another file")
