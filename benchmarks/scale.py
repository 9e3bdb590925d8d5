"""The driver at scale: 100,000 to 10,000,000 rows through the real driver, stand-in engine.

    .venv/bin/python benchmarks/scale.py [--sizes 100000,1000000,10000000] [--quick] [--keep]

Per size, a three-node DAG (`gen` answers every row; `tech`, a `where:` branch over gen's
output, takes the rows labelled code or data, 40 %; `judge` reads gen and tech: fan-in, on
tech's rows) runs over short real ShareGPT first turns, varied row by row (a lead-in on
two thirds of them, a row number, a topic label; rows built on one question share its
prefix). Data sets are cached in benchmarks/results/scale-data/. Everything is the real
driver (`benchmarks/scale_driver.py`: `run_dag_file` in a subprocess: ledger, journal,
tokenizer and prefix order, Parquet I/O) except the engines: `benchmarks/standin_engine.py`
behind the real worker-process boundary answers every request at once, so the times are
the driver's. Three runs per size:

  full         from scratch to the end
  interrupted  from scratch, `kill -9` once about half the units are committed on disk
  resumed      the same command again on the interrupted folder, to the end

Printed per size: driver peak RSS (VmHWM of the driver process, polled, and as it reads
its own at exit, never getrusage's: see peak_rss.py; GB = 10^9 bytes), the peak of its other child processes (not engines)
summed, requests/s through the driver ((node, row, step) units committed in the run /
time from engines ready to the run's end), units per CPU second of the driver (its cost,
which other work on a shared machine does not change) and per CPU second of its main thread
(the serial part: tokenizing and ordering run in other threads, and the tokenizer spreads over
every core, so on a machine with more cores the main loop is what limits), engines ready after the command started, the
time from engines ready to the first request sent (as the driver reports it in
`RunResult.first_request_s`, and as measured at the engine handles), resume (re-run start
-> first new unit committed on disk; and -> first result back from an engine), and
whether the resumed run's final data sets and node files equal the uninterrupted ones
(DuckDB, EXCEPT ALL both ways, so duplicates count). The last line sums up the worst size:
    worst: peak RSS <x> GB, growth <y> %, <z> requests/s, first request <w> s, resume <v> s, outputs equal: yes|no
(growth: peak RSS at the largest size against 1,000,000 rows, or the smallest size run).
`--quick` runs 20,000 and 100,000 rows for development. Each run files its results in a result
store and looks its requests up there, as `batchllm run` does (the full run in a store of its own,
the interrupted run and its resumption in another); `--no-store` runs without one (`--no-reuse`).

When a size cannot run three whole passes in the time there is, `--partial 10000000` skips
its uninterrupted pass: the interrupted one is killed at half the units (estimated) or after
`--interrupt-min` minutes, and the resumed one runs to the end or to `--deadline` (HH:MM
UTC; every pass still running then is killed and marked `timeout`). Its outputs are then
not compared, and the summary says so. `--record FILE` appends each size's summary as a
JSON line; `--summarize FILE...` prints the worst line over recorded sizes (so sizes run
by separate commands are summed up together).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROMPTS = ROOT / "profiles" / "prompts" / "first_turns.parquet"  # 1,000 real ShareGPT first turns
DATA = HERE / "results" / "scale-data"
RUNS = HERE / "results" / "scale-runs"
DATA_VERSION = 1
BATCH_ROWS = 500_000  # rows generated at a time
ROW_GROUP_ROWS = 100_000
LEADS = ["", "In short: ", "Please explain: ", "For a beginner: ", "Step by step: ", ""]  # two thirds get one
TOPICS = ["code", "data", "math", "food", "travel"]  # tech takes code and data
SIZES = (100_000, 1_000_000, 10_000_000)
QUICK_SIZES = (20_000, 100_000)
POLL_S = 0.1
GB = 1e9
UNITS_PER_ROW = 1.8  # gen every row, tech and judge 40 %: the estimate a partial size is killed at half of

DAG = """\
name: scale-{rows}
inputs:
  questions: {{path: {data}, id_column: id}}
engine:
  max_model_len: 2048
nodes:
  gen:
    model: smollm2-135m
    system: Answer in one sentence.
    prompt: "{{{{ question }}}}\\nLabel: {{{{ topic }}}}"
    sampling: {{max_tokens: 48}}
  tech:
    model: smollm2-135m
    where: "gen LIKE '%Label: code' OR gen LIKE '%Label: data'"
    system: You are a senior software engineer. Answer precisely.
    prompt: "{{{{ question }}}}\\nDraft answer: {{{{ gen }}}}"
    sampling: {{max_tokens: 48}}
  judge:
    model: smollm2-135m
    prompt: "Question: {{{{ question }}}}\\nAnswer A: {{{{ gen }}}}\\nAnswer B: {{{{ tech }}}}\\nWhich is better? {{{{ row_id }}}}"
    sampling: {{max_tokens: 8}}
outputs:
  judged:
    columns: {{question: question, topic: topic, answer: gen, expert: tech, verdict: judge, verdict_tokens: judge.num_output_tokens}}
"""


# -- data ----------------------------------------------------------------------------------
def _mix(rows: np.ndarray) -> np.ndarray:
    """splitmix64 of the row numbers: a fixed pseudo-random 64-bit value per row."""
    with np.errstate(over="ignore"):
        x = rows.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _questions() -> pa.Array:
    """The real first turns of 80-200 characters, on one line each, in a fixed order."""
    table = pq.read_table(PROMPTS).sort_by("id")
    prompts = pc.replace_substring_regex(table["prompt"], r"\s+", " ").combine_chunks()
    length = pc.utf8_length(prompts)
    return prompts.filter(pc.and_(pc.greater_equal(length, 80), pc.less_equal(length, 200)))


def data_file(rows: int) -> Path:
    """Columns id, question, topic; built once per size, in batches (never a Python object a row)."""
    path = DATA / f"questions-{rows}-v{DATA_VERSION}.parquet"
    if path.is_file():
        return path
    DATA.mkdir(parents=True, exist_ok=True)
    bases, leads, topics = _questions(), pa.array(LEADS), pa.array(TOPICS)
    schema = pa.schema([("id", pa.string()), ("question", pa.string()), ("topic", pa.string())])
    temporary = path.with_suffix(".tmp")
    with pq.ParquetWriter(temporary, schema, compression="zstd") as writer:
        for start in range(0, rows, BATCH_ROWS):
            numbers = np.arange(start, min(rows, start + BATCH_ROWS), dtype=np.int64)
            mixed = _mix(numbers)
            number_text = pc.cast(pa.array(numbers), pa.string())
            question = pc.binary_join_element_wise(
                leads.take(pa.array((mixed % np.uint64(len(LEADS))).astype(np.int64))),
                bases.take(pa.array(((mixed >> np.uint64(8)) % np.uint64(len(bases))).astype(np.int64))),
                " (#", number_text, ")", "")
            topic = topics.take(pa.array(((mixed >> np.uint64(32)) % np.uint64(len(TOPICS))).astype(np.int64)))
            ids = pc.binary_join_element_wise("q", number_text, "")
            writer.write_table(pa.table([ids, question, topic], schema=schema), row_group_size=ROW_GROUP_ROWS)
    os.replace(temporary, path)
    return path


def dag_file(rows: int) -> Path:
    data = data_file(rows)
    path = DATA / f"scale-{rows}.yaml"
    path.write_text(DAG.format(rows=rows, data=data.name))
    return path


# -- watching a driver from outside -----------------------------------------------------------
class CommittedCounter:
    """Units committed on disk in a run folder, read incrementally: lines of the journals'
    JSONL files (a header line holding the fingerprint not counted) plus rows of their
    Parquet segments. Works for either journal layout; a file that shrank is read again."""

    def __init__(self, out: Path):
        self.journal = out / ".batchllm" / "journal"
        self._lines: dict[Path, tuple[int, int]] = {}  # path -> (bytes read, lines counted)
        self._segments: dict[tuple[Path, int], int] = {}  # (path, size) -> rows

    def count(self) -> int:
        if not self.journal.is_dir():
            return 0
        total = 0
        for path in self.journal.rglob("*.jsonl"):
            total += self._count_lines(path)
        for path in self.journal.rglob("*.parquet"):
            try:
                key = (path, path.stat().st_size)
                if key not in self._segments:
                    self._segments[key] = pq.read_metadata(path).num_rows
                total += self._segments[key]
            except (OSError, pa.ArrowInvalid):
                continue  # replaced or half written right now
        return total

    def _count_lines(self, path: Path) -> int:
        try:
            with open(path, "rb") as handle:
                done, lines = self._lines.get(path, (0, 0))
                if handle.seek(0, os.SEEK_END) < done:
                    done, lines = 0, 0
                handle.seek(done)
                while chunk := handle.read(1 << 22):
                    lines += chunk.count(b"\n")
                    done += len(chunk)
                handle.seek(0)
                header = handle.readline(4096)
        except OSError:
            return 0
        self._lines[path] = (done, lines)
        return lines - (1 if b'"fingerprint"' in header and header.endswith(b"\n") else 0)


def _status_kb(pid: int, field_name: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of the process so far (all its threads; not its children)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


@dataclass
class DriverRun:
    label: str
    started: float  # epoch s, just before the command
    exit_code: int | None = None  # None: killed here
    ended: float = 0.0
    events: dict[str, dict] = field(default_factory=dict)  # the first of each kind
    engine_pids: set[int] = field(default_factory=set)
    peak_rss_kb: int = 0  # the driver process
    helpers_peak_rss_kb: int = 0  # its other children, summed, at the sampled peak
    units_at_start: int = 0
    units_at_end: int = 0  # on disk when it ended
    first_commit: float | None = None  # epoch s of the first unit beyond units_at_start
    killed_at: float | None = None
    timed_out: bool = False
    cpu_s: float = 0.0  # the driver's CPU seconds (all threads), last sampled

    def since_start(self, moment: float | None) -> float | None:
        return None if moment is None else moment - self.started

    @property
    def ready_time(self) -> float | None:
        return self.events.get("first_submit", {}).get("ready_time")

    @property
    def first_request_outside_s(self) -> float | None:
        submit = self.events.get("first_submit")
        return None if submit is None or submit.get("ready_time") is None else submit["time"] - submit["ready_time"]

    @property
    def first_request_driver_s(self) -> float | None:
        return self.events.get("done", {}).get("first_request_s")

    @property
    def first_request_s(self) -> float | None:
        own = self.first_request_driver_s
        return own if own is not None else self.first_request_outside_s

    @property
    def requests_per_s(self) -> float | None:
        end = self.killed_at or self.events.get("done", {}).get("time")
        if self.ready_time is None or end is None or end <= self.ready_time:
            return None
        return (self.units_at_end - self.units_at_start) / (end - self.ready_time)

    @property
    def units_per_cpu_s(self) -> float | None:
        """Units committed per CPU second of the driver: its cost, whatever else runs on the machine."""
        return (self.units_at_end - self.units_at_start) / self.cpu_s if self.cpu_s > 0 else None

    @property
    def units_per_main_thread_cpu_s(self) -> float | None:
        """Units per CPU second of the driver's main loop: the part that does not spread over
        cores (tokenizing and ordering run in other threads; the tokenizer uses every core)."""
        main_s = self.events.get("done", {}).get("main_thread_cpu_s")
        return (self.units_at_end - self.units_at_start) / main_s if main_s else None

    @property
    def peak_rss_gb(self) -> float:
        own = self.events.get("done", {}).get("max_rss_kb", 0)
        return max(self.peak_rss_kb, own) * 1024 / GB


def run_driver(label: str, dag: Path, out: Path, log: Path, timeout_s: float, kill_at_units: int | None = None,
               kill_after_s: float | None = None, ends_at: float | None = None, store: Path | None = None) -> DriverRun:
    """One `scale_driver.py` run, watched: RSS, committed units, events; `kill -9` once
    `kill_at_units` are committed on disk or `kill_after_s` have passed (a planned
    interruption), or at the timeout or `ends_at` (epoch s; marked timed out)."""
    counter = CommittedCounter(out)
    run = DriverRun(label, time.time(), units_at_start=counter.count())
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, str(HERE / "scale_driver.py"), str(dag), str(out),
                                    *(["--store", str(store)] if store is not None else [])],
                                   stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT)

    def read_events() -> None:
        for line in process.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            run.events.setdefault(event["event"], event)
            if event["event"] == "engine":
                run.engine_pids.add(event["pid"])

    reader = threading.Thread(target=read_events, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s if ends_at is None else min(time.monotonic() + timeout_s,
                                                                         time.monotonic() + ends_at - time.time())
    while process.poll() is None:
        run.peak_rss_kb = max(run.peak_rss_kb, _status_kb(process.pid, "VmHWM"))
        helpers = sum(_status_kb(c, "VmRSS") for c in _children(process.pid) if c not in run.engine_pids)
        run.helpers_peak_rss_kb = max(run.helpers_peak_rss_kb, helpers)
        run.cpu_s = _cpu_s(process.pid) or run.cpu_s
        units = counter.count()
        if run.first_commit is None and units > run.units_at_start:
            run.first_commit = time.time()
        planned = (kill_at_units is not None and units >= kill_at_units) or \
            (kill_after_s is not None and time.time() - run.started > kill_after_s)
        if planned or time.monotonic() > deadline:
            run.timed_out = not planned
            process.send_signal(signal.SIGKILL)
            run.killed_at = time.time()
            break
        time.sleep(POLL_S)
    process.wait()
    run.ended = time.time()
    reader.join(timeout=10)
    run.exit_code = None if run.killed_at else process.returncode
    _reap(run.engine_pids)
    run.units_at_end = counter.count()
    return run


def _reap(pids: set[int]) -> None:
    """Engine workers die with their driver; make sure, by pid, within a few seconds."""
    deadline = time.monotonic() + 5
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if Path(f"/proc/{pid}").exists():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- comparing -------------------------------------------------------------------------------
def result_files(out: Path) -> list[Path]:
    return sorted(p.relative_to(out) for p in [*out.glob("*.parquet"), *(out / "nodes").glob("*.parquet")])


def outputs_equal(first: Path, second: Path) -> tuple[bool, str]:
    """Every final data set and node file holds the same rows (as multisets), in DuckDB."""
    files = result_files(first)
    if not files or files != result_files(second):
        return False, f"files differ: {[str(f) for f in files]} vs {[str(f) for f in result_files(second)]}"
    spill = RUNS / "duckdb-spill"
    spill.mkdir(parents=True, exist_ok=True)
    db = duckdb.connect(config={"memory_limit": "2GB", "temp_directory": str(spill), "threads": 2})
    try:
        for name in files:
            a, b = str(first / name), str(second / name)
            rows_a, rows_b = (db.execute(f"SELECT count(*) FROM read_parquet('{p}')").fetchone()[0] for p in (a, b))
            differ = db.execute(f"SELECT count(*) FROM ((SELECT * FROM read_parquet('{a}') EXCEPT ALL SELECT * FROM read_parquet('{b}')) "
                                f"UNION ALL (SELECT * FROM read_parquet('{b}') EXCEPT ALL SELECT * FROM read_parquet('{a}')))").fetchone()[0]
            if rows_a != rows_b or differ:
                return False, f"{name}: {rows_a:,} vs {rows_b:,} rows, {differ:,} differ"
    finally:
        db.close()
    return True, f"{len(files)} files equal"


def units_by_node(out: Path) -> dict[str, int]:
    db = duckdb.connect(config={"memory_limit": "1GB", "threads": 2})
    try:
        return {p.stem: db.execute(f"SELECT count(*) FROM read_parquet('{p}')").fetchone()[0]
                for p in sorted((out / "nodes").glob("*.parquet"))}
    finally:
        db.close()


# -- one size -------------------------------------------------------------------------------
@dataclass
class SizeResult:
    rows: int
    runs: dict[str, DriverRun]
    units: int
    equal: bool | None  # None: not compared (a partial size)
    why: str

    @property
    def peak_rss_gb(self) -> float:
        return max(r.peak_rss_gb for r in self.runs.values())

    @property
    def resume_s(self) -> float | None:
        resumed = self.runs.get("resumed")
        if resumed is None:
            return None
        return resumed.since_start(resumed.first_commit or resumed.events.get("first_result", {}).get("time"))


def run_partial(rows: int, timeout_s: float, interrupt_s: float | None, folder: Path, dag: Path,
                ends_at: float | None, store: Path | None = None) -> SizeResult:
    """No uninterrupted pass: interrupted at about half the units (or after `interrupt_s`),
    then resumed; nothing to compare the outputs with."""
    half = int(rows * UNITS_PER_ROW) // 2
    runs = {"interrupted": run_driver("interrupted", dag, folder / "resumed", folder / "interrupted.log", timeout_s,
                                      kill_at_units=half, kill_after_s=interrupt_s, ends_at=ends_at, store=store)}
    runs["resumed"] = resumed = run_driver("resumed", dag, folder / "resumed", folder / "resumed.log", timeout_s, ends_at=ends_at,
                                           store=store)
    done = "to the end" if resumed.exit_code == 0 else f"not to the end (exit {resumed.exit_code}, {'timeout' if resumed.timed_out else 'see log'})"
    why = (f"no uninterrupted pass at this size; interrupted at {runs['interrupted'].units_at_end:,} units "
           f"(half is ~{half:,}), resumed {done}")
    return SizeResult(rows, runs, resumed.units_at_end, None, why)


def run_size(rows: int, timeout_s: float, keep: bool, partial: bool = False, interrupt_s: float | None = None,
             ends_at: float | None = None, with_store: bool = True) -> SizeResult:
    """`with_store`: each run files its results in a result store and looks its requests up there, as
    `batchllm run` does (the full run in a store of its own, the interrupted run and its resumption in
    another: neither answers the other's requests)."""
    dag = dag_file(rows)
    folder = RUNS / str(rows)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    stores = {name: folder / f"store-{name}.sqlite" if with_store else None for name in ("full", "resumed")}
    if partial:
        result = run_partial(rows, timeout_s, interrupt_s, folder, dag, ends_at, stores["resumed"])
        if not keep:
            shutil.rmtree(folder / "resumed", ignore_errors=True)
        return result
    full = run_driver("full", dag, folder / "full", folder / "full.log", timeout_s, ends_at=ends_at, store=stores["full"])
    runs = {"full": full}
    units = sum(units_by_node(folder / "full").values()) if full.exit_code == 0 else full.units_at_end
    if full.exit_code != 0:
        return SizeResult(rows, runs, units, False, f"full run did not finish (exit {full.exit_code}, see {folder / 'full.log'})")
    runs["interrupted"] = run_driver("interrupted", dag, folder / "resumed", folder / "interrupted.log", timeout_s,
                                     kill_at_units=units // 2, ends_at=ends_at, store=stores["resumed"])
    runs["resumed"] = resumed = run_driver("resumed", dag, folder / "resumed", folder / "resumed.log", timeout_s, ends_at=ends_at,
                                           store=stores["resumed"])
    if resumed.exit_code != 0:
        equal, why = False, f"resumed run did not finish (exit {resumed.exit_code}, see {folder / 'resumed.log'})"
    else:
        equal, why = outputs_equal(folder / "full", folder / "resumed")
    if not keep:
        for name in ("full", "resumed"):
            shutil.rmtree(folder / name, ignore_errors=True)
    return SizeResult(rows, runs, units, equal, why)


def _s(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def print_size(result: SizeResult, by_node: str) -> None:
    full = next(iter(result.runs.values()))
    print(f"\n{result.rows:,} rows: {result.units:,} units ({by_node}); schedule {full.events.get('start', {}).get('schedule', '?')}"
          f" ({full.events.get('start', {}).get('why', '')})")
    labels = list(result.runs)
    print(f"{'':34}" + "".join(f"{label:>14}" for label in labels))
    lines = [
        ("exit code", lambda r: "killed" if r.killed_at and not r.timed_out else ("timeout" if r.timed_out else str(r.exit_code))),
        ("wall s (command)", lambda r: _s(r.ended - r.started)),
        ("engines ready s (after start)", lambda r: _s(r.since_start(r.ready_time))),
        ("first request s (driver's own)", lambda r: _s(r.first_request_driver_s)),
        ("first request s (at the engines)", lambda r: _s(r.first_request_outside_s)),
        ("units committed in the run", lambda r: f"{r.units_at_end - r.units_at_start:,}"),
        ("requests/s (after ready)", lambda r: _s(r.requests_per_s, 0)),
        ("driver CPU s (all threads)", lambda r: _s(r.cpu_s, 1)),
        ("units per driver CPU s", lambda r: _s(r.units_per_cpu_s, 0)),
        ("main thread CPU s (serial part)", lambda r: _s(r.events.get("done", {}).get("main_thread_cpu_s"), 1)),
        ("units per main-thread CPU s", lambda r: _s(r.units_per_main_thread_cpu_s, 0)),
        ("driver peak RSS GB", lambda r: _s(r.peak_rss_gb)),
        ("other children peak RSS GB", lambda r: _s(r.helpers_peak_rss_kb * 1024 / GB)),
        ("first result s (after start)", lambda r: _s(r.since_start(r.events.get("first_result", {}).get("time")))),
        ("first commit on disk s", lambda r: _s(r.since_start(r.first_commit))),
    ]
    for name, value in lines:
        print(f"{name:34}" + "".join(f"{value(result.runs[label]):>14}" for label in labels))
    equal = "not compared" if result.equal is None else "yes" if result.equal else "no"
    print(f"resume (re-run start -> first new unit committed): {_s(result.resume_s)} s; outputs equal: {equal} ({result.why})")


def summary(result: SizeResult) -> dict:
    """What the worst line needs of a size. Requests/s: of the uninterrupted pass, else of the
    interrupted one (from scratch too); first request: every pass that logged one."""
    rate_run = result.runs.get("full") or result.runs.get("interrupted")
    firsts = [run.first_request_s for key, run in result.runs.items() if key != "interrupted" or "full" not in result.runs]
    return {"rows": result.rows, "peak_rss_gb": result.peak_rss_gb, "requests_per_s": rate_run.requests_per_s,
            "first_request_s": max([f for f in firsts if f is not None], default=None), "resume_s": result.resume_s,
            "equal": result.equal, "complete": all(r.exit_code == 0 for k, r in result.runs.items() if k != "interrupted")}


def worst_line(sizes: list[dict]) -> str:
    """The worst over sizes' summaries (see `summary`)."""
    def worst(key, pick):
        values = [size[key] for size in sizes if size[key] is not None]
        return pick(values) if values else None

    by_size = {size["rows"]: size["peak_rss_gb"] for size in sizes}
    largest = max(by_size)
    base = 1_000_000 if 1_000_000 in by_size and largest > 1_000_000 else min(by_size)
    growth = None if base == largest else (by_size[largest] / by_size[base] - 1) * 100
    print(f"growth: peak RSS at {largest:,} rows against {base:,} rows")
    compared = [size["rows"] for size in sizes if size["equal"] is not None]
    skipped = [size["rows"] for size in sizes if size["equal"] is None]
    incomplete = [size["rows"] for size in sizes if not size["complete"]]
    if skipped or incomplete:
        print(f"outputs compared at {', '.join(f'{r:,}' for r in compared) or 'no size'} rows; not at "
              f"{', '.join(f'{r:,}' for r in skipped) or '-'}; runs that did not reach the end: "
              f"{', '.join(f'{r:,}' for r in incomplete) or 'none'}")
    equal = "yes" if compared and all(size["equal"] for size in sizes if size["equal"] is not None) else "no"
    rate = worst("requests_per_s", min)
    return (f"worst: peak RSS {_s(worst('peak_rss_gb', max))} GB, growth {_s(growth, 1)} %, "
            f"{_s(rate, 0).replace(',', '')} requests/s, first request {_s(worst('first_request_s', max))} s, "
            f"resume {_s(worst('resume_s', max))} s, outputs equal: {equal}")


def _deadline_at(text: str | None) -> float | None:
    """HH:MM UTC today as epoch s (None: no deadline)."""
    if not text:
        return None
    hour, minute = map(int, text.split(":"))
    return datetime.datetime.now(datetime.UTC).replace(hour=hour, minute=minute, second=0, microsecond=0).timestamp()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", help="comma-separated row counts (default: 100000,1000000,10000000)")
    parser.add_argument("--quick", action="store_true", help="20,000 and 100,000 rows")
    parser.add_argument("--timeout-min", type=float, default=120.0, help="per driver run; then it is killed")
    parser.add_argument("--deadline", help="HH:MM UTC: any driver run still going then is killed")
    parser.add_argument("--partial", default="", help="sizes run without the uninterrupted pass (comma-separated)")
    parser.add_argument("--interrupt-min", type=float, help="a partial size's interrupted pass is killed after this long at most")
    parser.add_argument("--keep", action="store_true", help="keep the run folders (benchmarks/results/scale-runs/)")
    parser.add_argument("--no-store", action="store_true", help="no result store (batchllm run --no-reuse); by default each run "
                        "files its results in one and looks its requests up there, as `batchllm run` does")
    parser.add_argument("--record", type=Path, help="append each size's summary to this JSON-lines file")
    parser.add_argument("--summarize", type=Path, nargs="+", help="only print the worst line over these record files")
    args = parser.parse_args()
    if args.summarize:
        print(worst_line([json.loads(line) for path in args.summarize for line in path.read_text().splitlines() if line]))
        return 0
    sizes = QUICK_SIZES if args.quick else tuple(int(s.replace("_", "")) for s in args.sizes.split(",")) if args.sizes else SIZES
    partial = {int(s.replace("_", "")) for s in args.partial.split(",") if s}
    results = []
    for rows in sizes:
        started = time.perf_counter()
        data_file(rows)
        print(f"data: {rows:,} rows ready in {time.perf_counter() - started:.1f} s", flush=True)
        interrupt_s = args.interrupt_min * 60 if args.interrupt_min else None
        result = run_size(rows, args.timeout_min * 60, args.keep, rows in partial, interrupt_s, _deadline_at(args.deadline),
                          with_store=not args.no_store)
        full = RUNS / str(rows) / "full"
        by_node = ", ".join(f"{n} {c:,}" for n, c in units_by_node(full).items()) if full.is_dir() else "by node: see --keep"
        print_size(result, by_node)
        results.append(summary(result))
        if args.record:
            with open(args.record, "a") as record:
                record.write(json.dumps(results[-1]) + "\n")
    print()
    print(worst_line(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
