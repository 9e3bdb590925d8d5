"""Progress of a run as it goes: bars on a terminal; one plain line per running node every
`line_interval_s` when the output is not a terminal (CI, nohup, a scheduler, a file); and
the status file that `batchllm status` reads, rewritten every `status_interval_s` and at
the end.

Invariant: the cost of progress does not grow with the number of results. A node's unit
counts are its ledger's, read when shown (`NodeStats.counts`); the executor calls `advance`
once per node per turn with the tokens of the results it committed (a batch, not one call
per result); each node keeps at most one rate sample per `SAMPLE_SPACING_S`; `tick` is
called every loop turn and does nothing until an interval is due; bars are redrawn by
rich at a bounded rate, never by `advance`. Every time comes from the injected `clock`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from batchllm.dag.model import Price
from batchllm.io.journal_records import JournalStats
from batchllm.runtime.ledger import UnitCounts
from batchllm.runtime.status import END_STATES, NodeStatus, RunStatus, earlier_status, eta_text, write_status

if TYPE_CHECKING:
    from batchllm.engines.protocol import StepRecord

RATE_WINDOW_S = 60.0  # the ETA uses the rate over this much recent time
SAMPLE_SPACING_S = 1.0  # at most one (time, units done) sample per node per this long
MAX_SAMPLES = 256  # > RATE_WINDOW_S / SAMPLE_SPACING_S, so the window is always covered
BAR_REFRESH_PER_S = 4.0
STEADY_UNITS = 1_024  # a pace stands beside the model's ETA once this many units were committed within the
STEADY_SPAN_S = RATE_WINDOW_S / 2  # window, over this long (requests that all run at once commit together near
# their end: there the pace says nothing until the end, and the model's ETA stands alone)
MAX_ESTIMATES = 4096  # calibrated re-estimates of the rest of the run kept (one per few seconds)


@dataclass
class NodeStats:
    node: str
    model: str
    counts: Callable[[], UnitCounts]  # the node's units now, from its ledger (the one record of them)
    units_done_before: int = 0  # committed by earlier invocations or stages: in the counts, not in the rates
    failed: int = 0  # results whose finish_reason starts with "error:" (this invocation's, as the tokens)
    prompt_tokens: int = 0
    output_tokens: int = 0
    earlier: JournalStats = JournalStats()  # what earlier invocations committed: in the status's counts, not in rates
    engine_load_s: float = 0.0
    started_at: float = 0.0  # on the progress clock; set by RunProgress.start_node
    busy_s: float = 0.0  # inside engine steps
    work_tokens: int = 0  # prompt tokens computed + tokens generated, over the engine steps
    engine_steps: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the engine's prefix cache
    prefix_hits: int = 0  # of those, served from it
    ideal_cached_tokens: int | None = None  # what a perfect order would serve from an unbounded cache
    price: Price | None = None  # the model's price per 1M tokens, when the DAG gives one
    finished_at: float | None = None
    first_commit: tuple[float, int, int, int] | None = None  # (clock s, units_done_now, failed, output_tokens) after the first commit here
    model_eta: tuple[float, float] | None = None  # (seconds left, at clock s) by the calibrated cost model
    recent: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))  # (clock s, units done) samples
    servers: tuple[str, ...] = ()  # a node on servers: per server, its latency guard's line (see EndpointEngine.note)
    pools: bool = False  # an embed or score node: it reads prompts and writes no tokens, so its pace is prompt tokens
    reused: int = 0  # units taken from the result store in this invocation (in the counts, in units_done_before and in earlier)
    failure: str | None = None  # why it stopped with work left, for the status file (its NodeRun's cause, told by node_failed)
    task: TaskID | None = None  # its bar (set by RunProgress.start_node)

    def reuse(self, taken: JournalStats) -> None:
        """More units were taken from the result store: done, with their tokens, but not at this run's pace."""
        self.reused += taken.committed
        self.units_done_before += taken.committed
        self.earlier = self.earlier.plus(taken)

    @property
    def units_total(self) -> int:
        return self.counts().total

    @property
    def units_done(self) -> int:
        return self.counts().committed

    @property
    def units_done_now(self) -> int:
        return self.units_done - self.units_done_before

    def elapsed_s(self, now_s: float) -> float:
        return (self.finished_at if self.finished_at is not None else now_s) - self.started_at

    def output_tokens_per_s(self, now_s: float) -> float:
        elapsed_s = self.elapsed_s(now_s)
        return self.output_tokens / elapsed_s if elapsed_s > 0 else 0.0

    def rate_text(self, now_s: float, digits: int = 0) -> str:
        """`20 output tok/s`; a pooling node's `850 prompt tok/s`."""
        elapsed_s = self.elapsed_s(now_s)
        tokens = self.prompt_tokens if self.pools else self.output_tokens
        return f"{tokens / elapsed_s if elapsed_s > 0 else 0.0:,.{digits}f} {'prompt' if self.pools else 'output'} tok/s"


class RecentPace(NamedTuple):
    """A node's pace over the last RATE_WINDOW_S: the time its units left take at it."""

    eta_s: float
    units: int  # committed within the window
    span_s: float  # from the window's oldest sample to now

    @property
    def steady(self) -> bool:
        return self.units >= STEADY_UNITS and self.span_s >= STEADY_SPAN_S


def eta_s(stats: NodeStats, now_s: float) -> float | None:
    """Time left for the node. The calibrated cost model's estimate when the run has one
    (counted down since it was estimated), unless the node's recent pace is steady and
    slower: the model knows only the engines, and a run can be held back by anything else
    (the driver, its input, a producer). Without a model, the recent pace (from the oldest
    sample in the window to now, so a stalled node's ETA grows); None while it is unknown."""
    counts = stats.counts()
    if counts.total - counts.committed <= 0:
        return 0.0
    left = max(counts.expected - counts.committed, 1)
    pace = recent_pace(stats, now_s, left)
    if stats.model_eta is None:
        return None if pace is None else pace.eta_s
    by_model = max(stats.model_eta[0] - (now_s - stats.model_eta[1]), 0.0)
    return max(by_model, pace.eta_s) if pace is not None and pace.steady else by_model


def recent_pace(stats: NodeStats, now_s: float, left: int) -> RecentPace | None:
    since_s = now_s - RATE_WINDOW_S
    start = next(((t, done) for t, done in stats.recent if t >= since_s), None)
    if start is None or now_s <= start[0] or stats.units_done <= start[1]:
        return None
    units, span_s = stats.units_done - start[1], now_s - start[0]
    return RecentPace(left * span_s / units, units, span_s)


def progress_line(stats: NodeStats, now_s: float, wall_now: datetime | None = None) -> str:
    """`gen: 400/1,000 units (40%), 20 output tok/s, ETA 1m00s (ends 2026-11-25 18:02 UTC)`
    (ETA `?` when unknown; the end when `wall_now`, the wall clock at `now_s`, is given)."""
    share = f"{stats.units_done / stats.units_total:.0%}" if stats.units_total else "-"
    return (f"{stats.node}: {stats.units_done:,}/{stats.units_total:,} units ({share}), "
            f"{stats.rate_text(now_s)}, {eta_text(eta_s(stats, now_s), wall_now)}")


def _wall_clock() -> datetime:
    return datetime.now(UTC)


def _wall_time() -> str:
    return _wall_clock().isoformat(timespec="seconds")


class RunProgress:
    def __init__(self, console: Console, status_path: Path | None = None, *, line_interval_s: float = 30.0,
                 status_interval_s: float = 2.0, clock: Callable[[], float] = time.monotonic,
                 wall_time: Callable[[], str] = _wall_time, wall_clock: Callable[[], datetime] = _wall_clock):
        self.console, self.status_path, self.clock, self.wall_time = console, status_path, clock, wall_time
        self._earlier = earlier_status(status_path) if status_path is not None else None  # the folder's last run's figures
        self.wall_clock = wall_clock  # when a node's ETA ends, in the lines
        self.line_interval_s, self.status_interval_s = line_interval_s, status_interval_s
        self.bars_shown = console.is_terminal
        self._bars = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=console, transient=False,
            disable=not self.bars_shown, auto_refresh=True, refresh_per_second=BAR_REFRESH_PER_S,
        )
        self._started: list[NodeStats] = []  # each started node's counters (its NodeRun's `stats`), in the order they started
        self.rest: tuple[float, float] | None = None  # (seconds to the run's end, at clock s), calibrated estimate
        self.end_s = 0.0  # the command's own end after its last result (engines stopped, outputs written), in the time left
        # (s into the run, rest s estimated then, work tokens done, units committed in this run)
        self.estimates: deque = deque(maxlen=MAX_ESTIMATES)
        self.state = "running"
        self._started_s = clock()
        self.started_at = wall_time()
        self._next_line_s = self._started_s + line_interval_s
        self._next_status_s = self._started_s + status_interval_s

    def __enter__(self) -> RunProgress:
        self._bars.__enter__()
        self._write_status(self.clock())  # `batchllm status` sees the run before its engines are up
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bars.__exit__(*exc)

    @property
    def stats(self) -> dict[str, NodeStats]:
        """The started nodes' counters by name, in the order they started (a view: the counters are
        the nodes' own)."""
        return {stats.node: stats for stats in self._started}

    def node_failed(self, node: str, cause: str) -> None:
        """The node stopped with work left: the cause goes to the status file."""
        self.stats[node].failure = cause
        self.note(f"[red]node {node} failed:[/red] {escape(cause)}")

    def note(self, message: str) -> None:
        self.console.print(message, soft_wrap=True)

    def start_node(self, stats: NodeStats) -> None:
        stats.started_at = self.clock()
        self._started = [s for s in self._started if s.node != stats.node] + [stats]
        stats.task = self._bars.add_task(stats.node, total=stats.units_total, completed=stats.units_done_before, rate="")
        self._write_status(self.clock())  # before its engines start (tens of seconds): a resume shows what is done

    def advance(self, node: str, prompt_tokens: int = 0, output_tokens: int = 0, *, failed: int = 0) -> None:
        """Results of `node` were committed (one call per node per turn; the ledger counts them),
        with these tokens, `failed` of them errors."""
        stats = self.stats[node]
        stats.failed += failed
        stats.prompt_tokens += prompt_tokens
        stats.output_tokens += output_tokens
        now_s = self.clock()
        if stats.first_commit is None:
            stats.first_commit = (now_s, stats.units_done_now, stats.failed, stats.output_tokens)
        if not stats.recent or now_s - stats.recent[-1][0] >= SAMPLE_SPACING_S:
            stats.recent.append((now_s, stats.units_done))
        if self.bars_shown:  # rich redraws at BAR_REFRESH_PER_S; this only sets the numbers
            counts = stats.counts()
            assert stats.task is not None
            self._bars.update(stats.task, total=counts.total, completed=counts.committed,
                              rate=f"{stats.output_tokens_per_s(now_s):,.0f} tok/s")

    def count_steps(self, node: str, steps: Iterable[StepRecord]) -> None:
        stats = self.stats[node]
        for step in steps:
            stats.engine_steps += 1
            stats.busy_s += step.wall_s
            stats.work_tokens += step.prefill_tokens + step.decode_seqs
            stats.prefix_queries += step.prefix_queries
            stats.prefix_hits += step.prefix_hits

    def set_estimates(self, finish_s: dict[str, float], rest_s: float, run_s: float) -> None:
        """The calibrated cost model's estimate, from now (`run_s` into the run): when each
        node finishes, and the run."""
        now_s = self.clock()
        for node, seconds in finish_s.items():
            if node in self.stats:
                self.stats[node].model_eta = (seconds, now_s)
        self.rest = (rest_s, now_s)
        self.estimates.append((run_s, rest_s, sum(s.work_tokens for s in self.stats.values()),
                               sum(s.units_done_now for s in self.stats.values())))

    def keep_counts(self) -> None:
        """The run's ledger is about to be freed: each node keeps the counts it has now."""
        for stats in self.stats.values():
            stats.counts = (lambda last: lambda: last)(stats.counts())

    def finish_node(self, node: str) -> None:
        self.stats[node].finished_at = self.clock()

    # -- periodic output -------------------------------------------------------------------
    def tick(self) -> None:
        """Call every loop turn: prints the log lines and rewrites the status file when due."""
        now_s = self.clock()
        if now_s >= self._next_line_s:
            self._next_line_s = now_s + self.line_interval_s
            if not self.bars_shown:
                self._print_lines(now_s, running_only=True)
        if now_s >= self._next_status_s:
            self._next_status_s = now_s + self.status_interval_s
            self._write_status(now_s)

    def close(self, state: str) -> None:
        """The run ended: `finished`, `incomplete` or `interrupted`. Prints every node's last
        line (without a terminal) and writes the final status."""
        if state not in END_STATES:
            raise ValueError(f"a run ends {', '.join(END_STATES)}, not {state!r}")
        self.state = state
        now_s = self.clock()
        if not self.bars_shown:
            self._print_lines(now_s, running_only=False)
        self._write_status(now_s)

    def progress_lines(self, now_s: float, running_only: bool) -> list[str]:
        wall_now = self.wall_clock()
        return [line for s in self.stats.values() if not (running_only and s.finished_at is not None)
                for line in (progress_line(s, now_s, wall_now), *(f"  server {n}" for n in (s.servers if s.finished_at is None else ())))]

    def status(self, now_s: float) -> RunStatus:
        """The run as it stands. A node that computed nothing in this invocation (its results were
        all there, or taken from the result store) keeps the pace the folder's earlier status gave
        it, and a run that computed nothing keeps its elapsed time: a no-op run does not zero the
        figures of the work it found done."""
        before = self._earlier.nodes if self._earlier is not None else {}
        nodes = {s.node: NodeStatus(
            model=s.model, committed=s.units_done, total=s.units_total, failed=s.earlier.failed + s.failed,
            prompt_tokens=s.earlier.prompt_tokens + s.prompt_tokens, output_tokens=s.earlier.output_tokens + s.output_tokens,
            output_tokens_per_s=before[s.node].output_tokens_per_s if s.units_done_now == 0 and s.node in before
            else s.output_tokens_per_s(now_s), eta_s=eta_s(s, now_s), failure=s.failure,
            servers=s.servers if s.finished_at is None else (), reused=s.reused)
            for s in self.stats.values()}
        rest_s = None if self.rest is None or self.state != "running" else max(
            self.rest[0] - (now_s - self.rest[1]), *(n.eta_s for n in nodes.values() if n.eta_s is not None), 0.0) + self.end_s
        computed_nothing = self._earlier is not None and all(s.units_done_now == 0 for s in self.stats.values())
        elapsed_s = self._earlier.elapsed_s if computed_nothing and self._earlier is not None else now_s - self._started_s
        return RunStatus(state=self.state, elapsed_s=elapsed_s, nodes=nodes, started_at=self.started_at,
                         updated_at=self.wall_time(), rest_s=rest_s)

    def _print_lines(self, now_s: float, running_only: bool) -> None:
        for line in self.progress_lines(now_s, running_only):
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def _write_status(self, now_s: float) -> None:
        if self.status_path is not None:
            write_status(self.status_path, self.status(now_s))
