"""The plan as a Gantt chart: one row per device, time across, one colour per node
(its model named in the legend), the engine start of each bar drawn hatched.
PNG through Pillow; HTML as one self-contained file with an inline SVG. `chart_paths`
checks where they go before anything is planned, so a bad path costs no search."""

from __future__ import annotations

import html
import os
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from batchllm.core.errors import UserError
from batchllm.planner.plan_file import PlanReport

PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
           "#1f77b4", "#2ca02c"]
WIDTH, ROW_H, LEFT, TOP, LEGEND_ROW = 1400, 46, 120, 70, 30


def chart_paths(png: Path) -> tuple[Path, Path]:
    """The PNG path and the HTML path beside it, once it is sure both can be written: a
    `.png` name, not a folder, in a folder that exists or can be created."""
    where, hint = "--chart", "give a .png file path such as plans/my-dag.png (the .html is written beside it)"
    if png.suffix.lower() != ".png":
        got = f"extension {png.suffix!r}" if png.suffix else "no extension"
        raise UserError(f"chart path {str(png)!r} has {got}; the chart is a PNG", where=where, hint=hint)
    html_path = png.with_suffix(".html")
    for path in (png, html_path):
        if path.is_dir():
            raise UserError(f"chart path {str(path)!r} is a folder", where=where, hint=hint)
    folder = png.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"cannot create the chart's folder {str(png.parent)!r}: {str(folder)!r} is a file", where=where, hint=hint)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"cannot write the chart under {str(folder)!r}: no write permission", where=where, hint=hint)
    return png, html_path


@dataclass(frozen=True)
class Bar:
    device: int
    node: str
    start_s: float
    end_s: float
    loading_until_s: float  # engine start ends here (== start_s when none)


def merged_bars(spans: list[tuple[str, list[int], float, float, float]], join_gap_s: float) -> list[Bar]:
    """Bars from stage spans (node, devices, start, end, engine start paid), stage by stage.
    Per device, a node's consecutive spans with no new engine start (the next beginning
    within `join_gap_s` of the last end) merge into one bar."""
    merged: list[Bar] = []
    for name, devices, start_s, end_s, engine_start_s in spans:
        loading = start_s + min(engine_start_s, end_s - start_s)
        for device in devices:
            previous = next((b for b in reversed(merged) if b.device == device), None)
            if (previous is not None and previous.node == name and abs(previous.end_s - start_s) < join_gap_s
                    and engine_start_s == 0):
                merged[merged.index(previous)] = Bar(device, name, previous.start_s, end_s, previous.loading_until_s)
            else:
                merged.append(Bar(device, name, start_s, end_s, loading))
    return sorted(merged, key=lambda b: (b.device, b.start_s))


def bars(report: PlanReport) -> list[Bar]:
    """The chosen schedule's bars (its stages are contiguous)."""
    return merged_bars([(name, list(ids), stage.start_s, stage.end_s, stage.start_costs_s[name])
                        for stage in report.chosen.stages for name, ids in stage.placement.items()], join_gap_s=1e-6)


def _colours(report: PlanReport) -> dict[str, str]:
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(report.problem.nodes)}


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: one bitmap size
        return ImageFont.load_default()


def write_png(report: PlanReport, path: Path) -> Path:
    devices, total = report.cluster.devices, max(report.chosen.total_s, 1e-9)
    names = list(report.problem.nodes)
    legend_rows = (len(names) + 3) // 4
    height = TOP + devices * ROW_H + 72 + legend_rows * LEGEND_ROW
    image = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(image)
    font, small = _font(18), _font(15)
    colours = _colours(report)
    scale = (WIDTH - LEFT - 30) / total
    draw.text((LEFT, 18), f"{report.dag_name} on {report.cluster}: {total:.1f} s estimated, {len(report.chosen.stages)} stages",
              fill="black", font=font)
    for device in range(devices):
        y = TOP + device * ROW_H
        draw.text((10, y + 12), f"device {device}", fill="black", font=small)
        draw.line([(LEFT, y + ROW_H), (WIDTH - 30, y + ROW_H)], fill="#dddddd")
    for bar in bars(report):
        y = TOP + bar.device * ROW_H
        x0, x1, xl = LEFT + bar.start_s * scale, LEFT + bar.end_s * scale, LEFT + bar.loading_until_s * scale
        draw.rectangle([x0, y + 5, max(x1, x0 + 1), y + ROW_H - 5], fill=colours[bar.node], outline="white")
        for x in range(int(x0), int(xl), 6):  # hatch the engine start
            draw.line([(x, y + ROW_H - 6), (min(x + 10, xl), y + 6)], fill="white")
        label = bar.node
        if draw.textlength(label, font=small) < x1 - x0 - 8:
            draw.text((max(x0, xl) + 4 if xl - x0 < (x1 - x0) / 2 else x0 + 4, y + 13), label, fill="white", font=small)
    axis_y = TOP + devices * ROW_H + 8
    step = _tick_step(total)
    tick = 0.0
    while tick <= total + 1e-9:
        tick_x = LEFT + tick * scale
        draw.line([(tick_x, axis_y), (tick_x, axis_y + 6)], fill="black")
        draw.text((tick_x - 10, axis_y + 8), f"{tick:g}", fill="black", font=small)
        tick += step
    draw.text((LEFT, axis_y + 26), "time (seconds)", fill="black", font=small)
    legend_y = axis_y + 52
    for i, name in enumerate(names):
        x, y = LEFT + (i % 4) * 300, legend_y + (i // 4) * LEGEND_ROW
        draw.rectangle([x, y + 3, x + 18, y + 19], fill=colours[name])
        draw.text((x + 26, y + 2), f"{name} ({report.problem.nodes[name].model})", fill="black", font=small)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def _tick_step(total: float) -> float:
    for step in (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200):
        if total / step <= 12:
            return float(step)
    return 3600.0 * 4


def bars_svg(bar_list: list[Bar], devices: int, total_s: float, colours: dict[str, str], models: dict[str, str],
             width: int = 1200) -> str:
    """An inline SVG: one row per device, a bar per (node, device) span, engine starts hatched."""
    total = max(total_s, 1e-9)
    left = 100
    scale = (width - left - 20) / total
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{TOP + devices * ROW_H + 40}" font-family="sans-serif" font-size="13">',
             '<defs><pattern id="load" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
             '<rect width="3" height="6" fill="white" fill-opacity="0.5"/></pattern></defs>']
    for device in range(devices):
        parts.append(f'<text x="8" y="{TOP + device * ROW_H + 27}">device {device}</text>')
    for bar in bar_list:
        y = TOP + bar.device * ROW_H + 5
        x0, w = left + bar.start_s * scale, max((bar.end_s - bar.start_s) * scale, 1)
        title = html.escape(f"{bar.node} ({models[bar.node]}): {bar.start_s:.1f}-{bar.end_s:.1f} s, "
                            f"engine start until {bar.loading_until_s:.1f} s")
        parts.append(f'<rect x="{x0:.1f}" y="{y}" width="{w:.1f}" height="{ROW_H - 10}" fill="{colours[bar.node]}" stroke="white"><title>{title}</title></rect>')
        if bar.loading_until_s > bar.start_s:
            parts.append(f'<rect x="{x0:.1f}" y="{y}" width="{(bar.loading_until_s - bar.start_s) * scale:.1f}" height="{ROW_H - 10}" fill="url(#load)"/>')
        if w > 8 * len(bar.node):
            parts.append(f'<text x="{x0 + 4:.1f}" y="{y + 22}" fill="white">{html.escape(bar.node)}</text>')
    axis_y = TOP + devices * ROW_H + 15
    step, tick = _tick_step(total), 0.0
    while tick <= total + 1e-9:
        parts.append(f'<text x="{left + tick * scale - 8:.1f}" y="{axis_y + 10}">{tick:g}</text>')
        tick += step
    parts.append("</svg>")
    return "".join(parts)


def write_html(report: PlanReport, path: Path) -> Path:
    devices, total = report.cluster.devices, max(report.chosen.total_s, 1e-9)
    colours = _colours(report)
    svg = bars_svg(bars(report), devices, total, colours, {n: node.model for n, node in report.problem.nodes.items()})
    legend = "".join(f'<li><span style="background:{colours[n]}"></span>{html.escape(n)} ({html.escape(node.model)}): '
                     f'{node.requests} requests</li>' for n, node in report.problem.nodes.items())
    rows = "".join(f"<tr><td>{s.index + 1}</td><td>{s.start_s:.1f}</td><td>{s.end_s:.1f}</td><td>"
                   + html.escape(", ".join(f"{n} {p}" for n, p in s.plans.items())) + "</td></tr>" for s in report.chosen.stages)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>batchllm plan: {html.escape(report.dag_name)}</title>
<style>body{{font-family:sans-serif;margin:24px}} ul{{list-style:none;padding:0}} li{{display:inline-block;margin-right:18px}}
li span{{display:inline-block;width:14px;height:14px;margin-right:6px;vertical-align:middle}} td,th{{padding:2px 10px;text-align:left}}</style>
</head><body>
<h2>{html.escape(report.dag_name)} on {html.escape(str(report.cluster))}</h2>
<p>Estimated total {total:.1f} s over {len(report.chosen.stages)} stages (lower bound {report.lower_bound_s:.1f} s).
Hatched: engine start. Seconds on the axis.</p>
{svg}
<ul>{legend}</ul>
<table><tr><th>stage</th><th>start s</th><th>end s</th><th>node and plan</th></tr>{rows}</table>
</body></html>
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path
