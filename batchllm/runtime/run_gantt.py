"""`<out>/run.html`: the plan made at the start above what actually ran, as two Gantt
charts on one time axis (one row per device, engine starts hatched)."""

from __future__ import annotations

import html
from pathlib import Path

from batchllm.planner.gantt import PALETTE, Bar, bars_svg, merged_bars
from batchllm.runtime.run_report import RunReport


def _bars(stages: list[dict], device_ids: tuple[int, ...]) -> list[Bar]:
    """Run stages follow each other within milliseconds (planning between them)."""
    return merged_bars([(name, [device_ids.index(d) for d in node["devices"]], stage["start_s"], stage["end_s"],
                         node["engine_start_s"]) for stage in stages for name, node in stage["nodes"].items()], join_gap_s=1.0)


def write_run_html(report: RunReport, device_ids: tuple[int, ...], path: Path) -> Path:
    actual = report.to_dict()["stages"]
    total = max([report.wall_s] + [s["end_s"] for s in report.planned])
    colours = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(report.models)}
    planned_svg = bars_svg(_bars(report.planned, device_ids), len(device_ids), total, colours, report.models)
    actual_svg = bars_svg(_bars(actual, device_ids), len(device_ids), total, colours, report.models)
    legend = "".join(f'<li><span style="background:{colours[n]}"></span>{html.escape(n)} ({html.escape(m)})</li>'
                     for n, m in report.models.items())
    estimated = f"{report.estimated_s:.1f} s" if report.estimated_s is not None else "-"
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>batchllm run: {html.escape(report.dag)}</title>
<style>body{{font-family:sans-serif;margin:24px}} ul{{list-style:none;padding:0}} li{{display:inline-block;margin-right:18px}}
li span{{display:inline-block;width:14px;height:14px;margin-right:6px;vertical-align:middle}}</style>
</head><body>
<h2>{html.escape(report.dag)} on {html.escape(report.devices)} ({html.escape(report.method)})</h2>
<p>Estimated {estimated}, actual {report.wall_s:.1f} s; orchestration overhead {report.overhead_s:.1f} s.
Hatched: engine start. Seconds on the axis.</p>
<h3>Planned at the start</h3>
{planned_svg}
<h3>As run (re-planned at every stage end)</h3>
{actual_svg}
<ul>{legend}</ul>
</body></html>
"""
    path.write_text(page)
    return path
