"""The Python API: `batchllm.run` and `batchllm.plan`, the CLI's semantics without a shell.

A DAG is a YAML file or a dict of the same schema (relative paths in a dict start at the
current folder). `inputs=` replaces the DAG's inputs by name with a path, a pyarrow Table
or a pandas DataFrame (pandas is imported only if the caller already did).

Invariant: a table is written to `<out>/.batchllm/inputs/<name>.parquet` deterministically
and replaced only when its bytes change, so its fingerprint is stable and calling `run`
again with the same data resumes, computing each (node, row, step) exactly once, as
`batchllm run` does. Errors are the CLI's: `UserError` (exit 2) before anything runs, and
then nothing of this call stays written; `RunIncomplete` (exit 1) when a node failed.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq
from rich.console import Console

from batchllm.cluster.session import open_cluster
from batchllm.core.errors import UserError
from batchllm.core.files import replacing
from batchllm.dag.loader import load_dag, load_dag_mapping
from batchllm.dag.model import DagSpec
from batchllm.engines.devices import DeviceSet, hardware_name, parse_devices
from batchllm.engines.engine import EngineFactory
from batchllm.io.input_source import open_inputs
from batchllm.io.result_store import default_store_path
from batchllm.models.registry import batchllm_home
from batchllm.planner.plan_file import PROFILES_ROOT, PlanReport, plan_dag
from batchllm.runtime.console import run_console
from batchllm.runtime.launch import run_dag
from batchllm.runtime.run_dir import RunDir
from batchllm.runtime.run_report import RunReport, RunResult
from batchllm.runtime.run_spec import RunSpec
from batchllm.runtime.run_summary import closing_lines

DICT_DAG_NAME = "dag"  # stands for the file in a dict DAG's error messages, and names it unless it has `name:`


class FileTables(Mapping):
    """Data sets by name, each read from its file when asked (Parquet or JSON lines)."""

    def __init__(self, files: Mapping[str, Path]):
        self._files = dict(files)

    def __getitem__(self, name: str) -> pa.Table:
        path = self._files[name]
        return pa_json.read_json(path) if path.suffix == ".jsonl" else pq.read_table(path)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


@dataclass(frozen=True)
class RunOutput:
    out: Path  # the run folder
    outputs: dict[str, Path]  # output data set -> its file
    nodes: dict[str, Path]  # node -> its node file (every result: row_id, step, text, tokens, finish_reason)
    result: RunResult
    summary: tuple[str, ...]  # the lines `batchllm run` prints at the end

    @property
    def tables(self) -> FileTables:
        """The output data sets as pyarrow tables, read from the written files."""
        return FileTables(self.outputs)

    @property
    def node_tables(self) -> FileTables:
        return FileTables(self.nodes)

    @property
    def report(self) -> RunReport:
        """Stages as run (plans, devices, times, estimates): what `<out>/run.json` holds."""
        return self.result.report

    @property
    def engines_started(self) -> int:
        return self.result.engines_started


def run(dag: str | os.PathLike | Mapping, inputs: Mapping[str, Any] | None = None, out: str | os.PathLike | None = None,
        devices: str | DeviceSet = "auto", schedule: str = "plan", fresh: bool = False, prefix_order: bool = True,
        engine_factory: EngineFactory | None = None, *, cluster: str | None = None, console: Console | None = None,
        profiles_root: Path = PROFILES_ROOT, reuse: bool | None = None, store: str | os.PathLike | None = None) -> RunOutput:
    """Run every node of `dag` and return its outputs; `batchllm run` with the same meaning
    of every option (`out` default: `runs/<DAG file stem or dict name>`; `cluster`: `--cluster`,
    e.g. "ray" or "host:port", engines then run as Ray actors on the cluster's devices).

    `reuse`: answer requests from the result store (`store`, default the home's
    results.sqlite) and file what is computed there, as `batchllm run` does. None: on with
    vLLM's engines, off with an `engine_factory` of the caller's (whose answers are its own)."""
    out_dir = Path(out) if out is not None else Path("runs") / _default_run_name(dag)
    spec, tables = _load(dag, inputs, lambda name: _input_folder(out_dir) / f"{name}.parquet")
    session = None if isinstance(devices, DeviceSet) else open_cluster(cluster, devices)
    written = _write_tables(tables)
    try:
        device_set = devices if isinstance(devices, DeviceSet) else session.devices() if session else parse_devices(devices)
        reused = engine_factory is None if reuse is None else reuse
        store_path = (Path(store) if store is not None else default_store_path(batchllm_home())) if reused else None
        result, progress = run_dag(spec, RunSpec(out_dir, device_set, fresh=fresh, schedule=schedule, prefix_order=prefix_order,
                                                 profiles_root=profiles_root, store=store_path),
                                   console=console or run_console(), engine_factory=engine_factory, cluster=session)
    except UserError:
        written.undo()
        raise
    finally:
        if session is not None:
            session.close()
    run_dir = RunDir(out_dir)
    return RunOutput(out_dir, dict(result.outputs), {n: run_dir.node_path(n) for n in spec.topological_order()}, result,
                     tuple(closing_lines(result, progress, out_dir)))


def plan(dag: str | os.PathLike | Mapping, inputs: Mapping[str, Any] | None = None, devices: str = "auto",
         compare: bool = False, *, profiles_root: Path = PROFILES_ROOT) -> PlanReport:
    """`batchllm plan`: the schedule for `dag` on `devices` (`8xA100-80G`, `cpu:2`, `auto`:
    this machine), estimated without running anything; tables are written to a temporary
    folder only while it plans."""
    if devices == "auto":
        local = parse_devices("auto")
        devices = f"{len(local.ids)}x{hardware_name('gpu')}" if local.kind == "gpu" else f"cpu:{len(local.ids)}"
    with tempfile.TemporaryDirectory(prefix="batchllm-plan-") as folder:
        spec, tables = _load(dag, inputs, lambda name: Path(folder) / f"{name}.parquet")
        _write_tables(tables)
        return plan_dag(spec, devices, profiles_root=profiles_root, compare=compare)


def with_first_rows(dag: DagSpec, rows: int, out: Path) -> tuple[DagSpec, Callable[[], None]]:
    """The DAG over the first `rows` rows of each of its inputs (a try-out on a sample), written to
    `<out>/.batchllm/inputs/<name>.parquet` as `inputs=` tables are; also what undoes the writes
    (for an error before the run). Its results go to the result store like any run's, so the
    whole run after it computes only the rest."""
    if rows < 1:
        raise UserError(f"--rows {rows} is not a number of rows", where="--rows", hint="give a positive count, e.g. --rows 20")
    tables = {}
    for name, source in open_inputs(dag.inputs).items():
        try:
            tables[_input_folder(out) / f"{name}.parquet"] = source.head(rows)
        finally:
            source.close()
    written = _write_tables(tables)
    folder = _input_folder(out).absolute()
    return replace(dag, inputs={name: replace(item, path=folder / f"{name}.parquet", format="parquet", uri=None)
                                for name, item in dag.inputs.items()}), written.undo


# -- DAG and inputs --------------------------------------------------------------------------------
def _input_folder(out: Path) -> Path:
    return RunDir(out).state / "inputs"


def _default_run_name(dag: object) -> str:
    if isinstance(dag, Mapping):
        name = dag.get("name")
        return name if isinstance(name, str) and name and "/" not in name else DICT_DAG_NAME
    return Path(cast("str | os.PathLike[str]", dag)).stem  # not a mapping: a path


def _load(dag: object, inputs: Mapping[str, Any] | None,
          table_path: Callable[[str], Path]) -> tuple[DagSpec, dict[Path, pa.Table]]:
    """The DAG with `inputs=` in place of its own, and the tables to write (by their path)."""
    inputs = dict(inputs or {})
    given: dict[str, tuple[Path, str | None, pa.Table | None]] = {}  # name -> (path, format, table to write there)
    for name, value in inputs.items():
        table = _as_table(name, value)
        if table is not None:
            given[name] = (Path(table_path(name)).absolute(), "parquet", table)
        else:
            given[name] = (Path(value).absolute(), None, None)
    if isinstance(dag, Mapping):
        spec = load_dag_mapping(_fill_input_paths(dag, given), Path.cwd(), DICT_DAG_NAME)
    elif isinstance(dag, (str, os.PathLike)):
        spec = load_dag(Path(dag))
    else:
        raise UserError(f"dag must be a path to a YAML file or a dict, got {type(dag).__name__}", where="batchllm.run(dag=...)")
    unknown = sorted(set(given) - set(spec.inputs))
    if unknown:
        raise UserError(f"inputs= names {unknown[0]!r}, which the DAG does not declare", where="inputs=",
                        hint=f"the DAG's inputs: {', '.join(spec.inputs)}")
    spec = replace(spec, inputs={name: replace(item, path=given[name][0], format=given[name][1]) if name in given else item
                                 for name, item in spec.inputs.items()})
    return spec, {path: table for path, _, table in given.values() if table is not None}


def _fill_input_paths(dag: Mapping, given: Mapping[str, tuple]) -> dict:
    """A dict DAG may leave out an input's `path:` (or its whole `inputs:`) when `inputs=`
    gives it."""
    filled = dict(dag)
    declared = filled.get("inputs")
    if declared is None:
        filled["inputs"] = {name: {"path": str(path)} for name, (path, _, _) in given.items()}
    elif isinstance(declared, Mapping):
        filled["inputs"] = {name: {**body, "path": str(given[name][0])} if name in given and isinstance(body, Mapping) else body
                            for name, body in declared.items()}
    return filled


def _as_table(name: str, value: object) -> pa.Table | None:
    """A pyarrow Table or pandas DataFrame as a table; None for a path."""
    if isinstance(value, pa.Table):
        return value
    pandas = sys.modules.get("pandas")  # imported by the caller if it made a DataFrame
    if pandas is not None and isinstance(value, pandas.DataFrame):
        try:
            table = pa.Table.from_pandas(value)  # a named or non-default index becomes a column
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise UserError(f"inputs[{name!r}]: the DataFrame cannot be converted to Arrow: {exc}", where="inputs=",
                            hint="give each column one type (e.g. strings for prompt columns)") from None
        return table.cast(pa.schema([_small_offsets(field) for field in table.schema]))
    if isinstance(value, (str, os.PathLike)):
        return None
    raise UserError(f"inputs[{name!r}] must be a path, a pyarrow Table or a pandas DataFrame, got {type(value).__name__}",
                    where="inputs=")


def _small_offsets(field: pa.Field) -> pa.Field:
    """pandas' pyarrow-backed strings arrive as large_string; as string, a frame's columns
    have the types the same data read from a Parquet or JSONL file has."""
    if pa.types.is_large_string(field.type):
        return field.with_type(pa.string())
    if pa.types.is_large_list(field.type):
        return field.with_type(pa.list_(_small_offsets(field.type.value_field).type))
    return field


class _Written:
    """Files and folders one call created, removed again if the run is refused."""

    def __init__(self) -> None:
        self.files: list[Path] = []
        self.folders: list[Path] = []

    def undo(self) -> None:
        for path in self.files:
            path.unlink(missing_ok=True)
        for folder in reversed(self.folders):
            try:
                folder.rmdir()
            except OSError:
                break


def _write_tables(tables: Mapping[Path, pa.Table]) -> _Written:
    """Write each table as Parquet, the same bytes for the same table (no pandas or other
    schema metadata); an existing file with those bytes is left as it is."""
    written = _Written()
    for path, table in tables.items():
        missing = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
        path.parent.mkdir(parents=True, exist_ok=True)
        written.folders += reversed(missing)
        existed = path.exists()
        try:
            with replacing(path) as new:
                pq.write_table(table.replace_schema_metadata(None), new.path)
                new.keep_old = path.is_file() and _sha256(path) == _sha256(new.path)
        except BaseException:
            written.undo()
            raise
        if not existed:
            written.files.append(path)
    return written


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
