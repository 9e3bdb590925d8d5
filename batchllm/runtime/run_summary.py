"""The end-of-run summary: a few short lines per node, readable in an 80-column terminal
and in a log file (the full figures are in `<out>/run.json` and `batchllm status --json`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from batchllm.runtime.progress import NodeStats, RunProgress

if TYPE_CHECKING:
    from batchllm.runtime.run_report import RunResult


def closing_lines(result: RunResult, progress: RunProgress, out: Path) -> list[str]:
    """What `batchllm run` (and `batchllm.run`) says at the end: the summary and the stages."""
    if result.engines_started == 0:
        reused = sum(s.reused for s in progress.stats.values())
        if reused:
            return [f"Nothing to compute: {reused:,} results taken from the result store (computed by earlier runs), "
                    f"the rest of {out} was complete; no engine was started."]
        return [f"Nothing to do: every node's results in {out} are complete; no engine was started."]
    lines = summary_lines(progress.stats, progress.clock())
    r = result.report
    if r is not None and r.stages:
        estimate = f", estimated {r.estimated_s:.1f} s" if r.estimated_s is not None else ""
        stages = f"{len(r.stages)} stage{'' if len(r.stages) == 1 else 's'}"
        lines.append(f"{stages} ({r.method}): {r.wall_s:.1f} s{estimate}, overhead {r.overhead_s:.1f} s "
                     f"({r.overhead_s / r.wall_s:.1%})")
        on_devices = {name for stage in r.stages for name, node in stage.nodes.items() if node.devices}
        if on_devices:
            lines.append(f"engines: {result.model_loads} model load{'' if result.model_loads == 1 else 's'} for "
                         f"{len(on_devices)} node{'' if len(on_devices) == 1 else 's'} on devices")
        if r.command_start_s is not None:
            lines.append(f"before them: {r.command_start_s:.1f} s, the command's start (imports, checks, planning)")
            if r.start is not None:
                lines.append(f"  {r.start.text(r.command_start_s)}")
        lines.append(f"details: {out / 'run.json'}")
    return lines


def summary_lines(stats: dict[str, NodeStats], now_s: float) -> list[str]:
    lines = ["batchllm run summary"]
    for s in stats.values():
        head = f"{s.node} ({Path(s.model).name}):"
        if s.units_total == 0:
            lines += [f"{head} 0 units, no row reached it", "  (its `where:` held nowhere, or an upstream node had no output)"]
            continue
        lines.append(f"{head} {s.units_done:,}/{s.units_total:,} units" + (f", {s.failed:,} failed" if s.failed else "")
                     + (f", {s.reused:,} taken from the result store" if s.reused else ""))
        if s.reused and s.units_done_now == 0:  # nothing of it computed here: no tokens, rates or times of its own
            continue
        elapsed_s = (s.finished_at or now_s) - s.started_at
        lines.append(f"  tokens: prompt {s.prompt_tokens:,}, output {s.output_tokens:,}, {s.rate_text(now_s, digits=1)}")
        hit_rate = f"{s.prefix_hits / s.prompt_tokens:.0%}" if s.prompt_tokens else "-"
        ideal = "" if s.ideal_cached_tokens is None else f", ideal {s.ideal_cached_tokens:,}"
        lines.append(f"  prefix cache: {s.prefix_hits:,} tok ({hit_rate}){ideal}")
        lines.append(f"  time: load {s.engine_load_s:.1f} s, engine {s.busy_s:.1f} s, total {elapsed_s:.1f} s")
        if s.price is not None:
            prompt, output = s.price.cost(s.prompt_tokens, 0), s.price.cost(0, s.output_tokens)
            lines.append(f"  cost: {prompt + output:,.4f} (prompt {prompt:,.4f} + output {output:,.4f}, at the DAG's prices)")
    return lines
