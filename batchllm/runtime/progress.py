"""Progress of a run as it goes: bars on a terminal; one plain line per node every
`line_interval_s` when the output is a file (CI, nohup, a scheduler); and the status file
that `batchllm status` reads, rewritten every `status_interval_s` and at the end.

The executor calls `advance` once per node per poll of the engines (not per result) and
`tick` every loop turn; `tick` does nothing until an interval is due, so it costs nothing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from batchllm.runtime.status import NodeStatus, RunStatus, format_duration, write_status

RATE_WINDOW_S = 60.0  # the ETA uses the rate over this much recent time


@dataclass
class NodeStats:
    node: str
    model: str
    units_total: int
    units_done_before: int
    units_done_now: int = 0
    failed: int = 0  # results whose finish_reason is "error: ..."
    prompt_tokens: int = 0
    output_tokens: int = 0
    engine_load_s: float = 0.0
    started_at: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0  # inside engine steps
    engine_steps: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the engine's prefix cache
    prefix_hits: int = 0  # of those, served from it
    ideal_cached_tokens: int | None = None  # what a perfect order would serve from an unbounded cache
    finished_at: float | None = None
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # (clock, units done) samples

    @property
    def units_done(self) -> int:
        return self.units_done_before + self.units_done_now

    @property
    def elapsed_s(self) -> float:
        return (self.finished_at or time.monotonic()) - self.started_at

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def eta_s(stats: NodeStats, now_s: float) -> float | None:
    """Units left over the rate of the last RATE_WINDOW_S; None before a rate is known."""
    left = stats.units_total - stats.units_done
    if left <= 0:
        return 0.0
    samples = [(t, done) for t, done in stats.recent if t >= now_s - RATE_WINDOW_S]
    if len(samples) < 2 or samples[-1][0] <= samples[0][0] or samples[-1][1] <= samples[0][1]:
        return None
    rate = (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0])
    return left / rate


class RunProgress:
    def __init__(self, console: Console, status_path: Path | None = None, *, line_interval_s: float = 30.0,
                 status_interval_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.console, self.status_path, self.clock = console, status_path, clock
        self.line_interval_s, self.status_interval_s = line_interval_s, status_interval_s
        self.bars_shown = console.is_terminal
        self._bars = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=console, transient=False,
            disable=not self.bars_shown,
        )
        self._tasks: dict[str, int] = {}
        self.stats: dict[str, NodeStats] = {}
        self.state = "running"
        self._started_at = clock()
        self._next_line_s = self._started_at + line_interval_s
        self._next_status_s = self._started_at

    def __enter__(self) -> "RunProgress":
        self._bars.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._bars.__exit__(*exc)

    def note(self, message: str) -> None:
        self.console.print(message)

    def start_node(self, stats: NodeStats) -> None:
        stats.started_at = self.clock()
        self.stats[stats.node] = stats
        self._tasks[stats.node] = self._bars.add_task(stats.node, total=stats.units_total, completed=stats.units_done_before, rate="")

    def set_total(self, node: str, units_total: int) -> None:
        """A node learns its total as its producers finish rows."""
        if self.stats[node].units_total != units_total:
            self.stats[node].units_total = units_total
            self._bars.update(self._tasks[node], total=units_total)

    def advance(self, node: str, prompt_tokens: int, output_tokens: int, *, units: int = 1, failed: int = 0) -> None:
        stats = self.stats[node]
        stats.units_done_now += units
        stats.failed += failed
        stats.prompt_tokens += prompt_tokens
        stats.output_tokens += output_tokens
        stats.recent.append((self.clock(), stats.units_done))
        if self.bars_shown:
            self._bars.update(self._tasks[node], advance=units, rate=f"{stats.output_tokens_per_s:,.0f} tok/s")

    def count_steps(self, node: str, steps) -> None:
        stats = self.stats[node]
        for step in steps:
            stats.engine_steps += 1
            stats.busy_s += step.wall_s
            stats.prefix_queries += step.prefix_queries
            stats.prefix_hits += step.prefix_hits

    def finish_node(self, node: str) -> None:
        self.stats[node].finished_at = self.clock()

    # -- periodic output -------------------------------------------------------------------
    def tick(self) -> None:
        now_s = self.clock()
        if not self.bars_shown and now_s >= self._next_line_s:
            self._next_line_s = now_s + self.line_interval_s
            for line in self.progress_lines(now_s, running_only=True):
                self.console.print(line, highlight=False, markup=False, soft_wrap=True)
        if self.status_path is not None and now_s >= self._next_status_s:
            self._next_status_s = now_s + self.status_interval_s
            write_status(self.status_path, self.status(now_s))

    def close(self, state: str) -> None:
        """The run ended: `finished`, `incomplete` or `interrupted`."""
        self.state = state
        now_s = self.clock()
        if not self.bars_shown:
            for line in self.progress_lines(now_s, running_only=False):
                self.console.print(line, highlight=False, markup=False, soft_wrap=True)
        if self.status_path is not None:
            write_status(self.status_path, self.status(now_s))

    def progress_lines(self, now_s: float, running_only: bool) -> list[str]:
        lines = []
        for s in self.stats.values():
            if running_only and s.finished_at is not None:
                continue
            share = f"{s.units_done / s.units_total:.0%}" if s.units_total else "-"
            elapsed_s = (s.finished_at or now_s) - s.started_at
            rate = s.output_tokens / elapsed_s if elapsed_s > 0 else 0.0
            eta = eta_s(s, now_s)
            lines.append(f"{s.node}: {s.units_done:,}/{s.units_total:,} units ({share}), {rate:,.0f} output tok/s, "
                         f"ETA {'?' if eta is None else format_duration(eta)}")
        return lines

    def status(self, now_s: float) -> RunStatus:
        nodes = {}
        for s in self.stats.values():
            elapsed_s = (s.finished_at or now_s) - s.started_at
            nodes[s.node] = NodeStatus(
                model=s.model, committed=s.units_done, total=s.units_total, failed=s.failed, prompt_tokens=s.prompt_tokens,
                output_tokens=s.output_tokens, output_tokens_per_s=s.output_tokens / elapsed_s if elapsed_s > 0 else 0.0,
                eta_s=eta_s(s, now_s))
        return RunStatus(state=self.state, elapsed_s=now_s - self._started_at, nodes=nodes)
