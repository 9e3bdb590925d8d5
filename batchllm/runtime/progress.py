"""Progress display and end-of-run summary (rich, on stderr)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


@dataclass
class NodeStats:
    node: str
    model: str
    units_total: int
    units_done_before: int
    units_done_now: int = 0
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

    @property
    def elapsed_s(self) -> float:
        return (self.finished_at or time.monotonic()) - self.started_at

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


class RunProgress:
    def __init__(self, console: Console, status_path=None):
        self.console = console
        self._bars = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=console, transient=False,
        )
        self._tasks: dict[str, int] = {}
        self.stats: dict[str, NodeStats] = {}

    def __enter__(self) -> "RunProgress":
        self._bars.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._bars.__exit__(*exc)

    def note(self, message: str) -> None:
        self._bars.console.print(message)

    def start_node(self, stats: NodeStats) -> None:
        self.stats[stats.node] = stats
        self._tasks[stats.node] = self._bars.add_task(stats.node, total=stats.units_total, completed=stats.units_done_before, rate="")

    def set_total(self, node: str, units_total: int) -> None:
        """A pipelined node learns its total as its producers finish rows."""
        if self.stats[node].units_total != units_total:
            self.stats[node].units_total = units_total
            self._bars.update(self._tasks[node], total=units_total)

    def tick(self) -> None:
        """Called every loop turn of the executor (interim: nothing periodic yet)."""

    def close(self, state: str) -> None:
        """The run ended: finished, incomplete or interrupted (interim: nothing to write yet)."""

    def advance(self, node: str, prompt_tokens: int, output_tokens: int, *, units: int = 1, failed: int = 0) -> None:
        stats = self.stats[node]
        stats.units_done_now += units
        stats.prompt_tokens += prompt_tokens
        stats.output_tokens += output_tokens
        self._bars.update(self._tasks[node], advance=units, rate=f"{stats.output_tokens_per_s:,.0f} tok/s")

    def count_steps(self, node: str, steps) -> None:
        stats = self.stats[node]
        for step in steps:
            stats.engine_steps += 1
            stats.busy_s += step.wall_s
            stats.prefix_queries += step.prefix_queries
            stats.prefix_hits += step.prefix_hits

    def finish_node(self, node: str) -> None:
        self.stats[node].finished_at = time.monotonic()

    def summary_table(self) -> Table:
        table = Table(title="batchllm run summary")
        columns = ("node", "model", "requests", "prompt tok", "cached tok", "ideal cached", "hit rate", "output tok", "load s",
                   "engine s", "time s", "output tok/s")
        for column in columns:
            table.add_column(column, justify="left" if column in ("node", "model") else "right")
        for s in self.stats.values():
            ideal = "-" if s.ideal_cached_tokens is None else f"{s.ideal_cached_tokens:,}"
            hit_rate = f"{s.prefix_hits / s.prompt_tokens:.0%}" if s.prompt_tokens else "-"
            table.add_row(s.node, s.model, f"{s.units_done_before + s.units_done_now}/{s.units_total}", f"{s.prompt_tokens:,}",
                          f"{s.prefix_hits:,}", ideal, hit_rate, f"{s.output_tokens:,}", f"{s.engine_load_s:.1f}",
                          f"{s.busy_s:.1f}", f"{s.elapsed_s:.1f}", f"{s.output_tokens_per_s:,.1f}")
        return table
