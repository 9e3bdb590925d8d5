"""A plan for people (a table) and for programs (JSON)."""

from __future__ import annotations

from rich.console import Console, JustifyMethod
from rich.table import Table

from batchllm.planner.plan_file import PlanReport
from batchllm.planner.preflight import node_times
from batchllm.planner.schedule import Schedule


def _devices_text(ids: tuple[int, ...], node_sizes: tuple[int, ...] = ()) -> str:
    """`0-3`; on several nodes each node's own device numbers: `n1:0-7 n2:0-3` (nodes from 1)."""
    if len(node_sizes) > 1:
        parts, start = [], 0
        for number, size in enumerate(node_sizes, 1):
            local = tuple(i - start for i in ids if start <= i < start + size)
            if local:
                parts.append(f"n{number}:{_devices_text(local)}")
            start += size
        return " ".join(parts)
    if len(ids) > 1 and list(ids) == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def stage_rows(schedule: Schedule, report: PlanReport) -> list[dict]:
    rows = []
    for stage in schedule.stages:
        for name, plan in stage.plans.items():
            rows.append({
                "stage": stage.index + 1, "node": name, "model": report.problem.nodes[name].model, "plan": str(plan),
                "devices": list(stage.placement[name]), "start_s": round(stage.start_s, 3), "end_s": round(stage.end_s, 3),
                "engine_start_s": round(stage.start_costs_s[name], 3), "requests_left": round(stage.requests_left[name], 1),
                "finished": name in stage.finished,
            })
    return rows


def preflight_rows(report: PlanReport) -> dict[str, dict]:
    """Per node, the pre-flight figures (`plan --json`'s `nodes`, beside the planner's)."""
    times = node_times(report.chosen)
    rows = {}
    for name, p in report.preflight.items():
        held_s, device_s = times.get(name, (0.0, 0.0))
        cost = p.cost()
        rows[name] = {
            "rows": p.rows, "rows_over_context": p.rows_over_context, "rows_over_context_estimated": p.over_context_estimated,
            "max_model_len": p.max_model_len, "sample_rows": p.sample_rows, "prompt_tokens": dict(p.prompt_tokens),
            "predicted_output_tokens": {"p50": round(p.output_p50, 1), "p90": round(p.output_p90, 1), "source": p.output_source},
            "estimated_s": round(held_s, 3), "device_hours": round(device_s / 3600, 6),
            "cost": None if cost is None else round(cost, 6),
        }
    return rows


def print_preflight(report: PlanReport, console: Console) -> None:
    """The pre-flight table: per node, its data, predicted outputs, time, device-hours (and cost)."""
    if not report.preflight:
        return
    table = Table(title=f"pre-flight: {report.dag_name} on {report.cluster}", title_justify="left")
    columns: list[tuple[str, JustifyMethod]] = [
        ("node", "left"), ("model", "left"), ("rows", "right"), ("prompt p50/p90/max", "right"), ("over ctx", "right"),
        ("output p50/p90", "right"), ("source", "left"), ("est. s", "right"), ("device-h", "right")]
    if report.priced:
        columns.append(("cost", "right"))
    for column, justify in columns:
        table.add_column(column, justify=justify)
    for name, row in preflight_rows(report).items():
        p = report.preflight[name]
        prompt, output = row["prompt_tokens"], row["predicted_output_tokens"]
        over = f"~{p.rows_over_context:,}" if p.rows_over_context and p.over_context_estimated else f"{p.rows_over_context:,}"
        cells = [name, p.model, f"{p.rows:,}", f"{prompt['p50']:,}/{prompt['p90']:,}/{prompt['max']:,}", over,
                 f"{output['p50']:,.0f}/{output['p90']:,.0f}", output["source"], f"{row['estimated_s']:.1f}",
                 f"{row['device_hours']:.3f}"]
        if report.priced:
            cells.append("-" if row["cost"] is None else f"{row['cost']:,.4f}")
        table.add_row(*cells)
    console.print(table)
    console.print("tokens: prompts of a sample of the rows, outputs predicted (capped by max_tokens and the context); "
                  "est. s: time the node holds devices" + ("; cost at the DAG's prices" if report.priced else ""))
    for p in report.preflight.values():
        if (note := p.over_context_note()) is not None:
            console.print(f"note: {note}")


def print_report(report: PlanReport, console: Console) -> None:
    print_preflight(report, console)
    schedule = report.chosen
    table = Table(title=f"{report.dag_name} on {report.cluster}: {len(schedule.stages)} stage{'s' if len(schedule.stages) != 1 else ''}", title_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("stage", "right"), ("node", "left"), ("model", "left"), ("plan", "left"), ("devices", "left"),
        ("start s", "right"), ("end s", "right"), ("load s", "right"), ("left", "right"))
    for column, justify in columns:
        table.add_column(column, justify=justify)
    for row in stage_rows(schedule, report):
        left = "done" if row["finished"] else f"{row['requests_left']:.0f}"
        table.add_row(str(row["stage"]), row["node"], row["model"], row["plan"], _devices_text(tuple(row["devices"]), report.cluster.node_sizes),
                      f"{row['start_s']:.1f}", f"{row['end_s']:.1f}", f"{row['engine_start_s']:.1f}", left)
    console.print(table)
    console.print("load s: engine start paid in the stage; left: requests still to do after it")
    console.print(f"estimated total {schedule.total_s:.1f} s (lower bound {report.lower_bound_s:.1f} s); "
                  f"search {report.search_s:.2f} s ({report.fit_s:.2f} s fitting node speeds)")
    if report.command is not None:
        console.print(f"what `run` takes: about {report.estimated_s:.1f} s: its start {report.command.start_s:.1f} s + the stages "
                      f"{schedule.total_s:.1f} s + its end {report.command.end_s:.1f} s ({report.command_source})")
    for note in report.problem.notes:
        console.print(f"note: {note}")
    if report.compared:
        compare = Table(title="methods on the same cost model", title_justify="left")
        compared: tuple[tuple[str, JustifyMethod], ...] = (
            ("method", "left"), ("estimated s", "right"), ("vs chosen", "right"), ("search s", "right"))
        for column, justify in compared:
            compare.add_column(column, justify=justify)
        for other in (schedule, *report.compared):
            label = f"chosen ({other.method})" if other is schedule else other.method
            suffix = " (budget hit)" if other.optimal is False else ""
            compare.add_row(label + suffix, f"{other.total_s:.1f}", f"{other.total_s / schedule.total_s:.2f}x", f"{other.search_s:.3f}")
        for skipped in report.not_run:
            compare.add_row(f"{skipped.method}: not run ({skipped.reason})", "", "", "")
        compare.add_row("lower bound", f"{report.lower_bound_s:.1f}", f"{report.lower_bound_s / schedule.total_s:.2f}x", "")
        console.print(compare)


def report_json(report: PlanReport) -> dict:
    def summary(schedule: Schedule) -> dict:
        return {"method": schedule.method, "total_s": round(schedule.total_s, 3), "search_s": round(schedule.search_s, 4),
                **({"optimal": schedule.optimal} if schedule.optimal is not None else {})}

    preflight = preflight_rows(report)
    return {
        "dag": report.dag_name, "devices": str(report.cluster), "hardware": report.cluster.hardware,
        "device_count": report.cluster.devices, **summary(report.chosen), "estimated_s": round(report.estimated_s, 3),
        **({"command_start_s": round(report.command.start_s, 3), "command_end_s": round(report.command.end_s, 3),
            "command_from": report.command_source} if report.command is not None else {}),
        **({"all_computed_s": round(report.all_computed_s, 3)} if report.all_computed_s is not None else {}),
        "fit_s": round(report.fit_s, 4), "lower_bound_s": round(report.lower_bound_s, 3), "notes": list(report.problem.notes),
        "nodes": {n: {"model": node.model, "requests": node.requests, "rounds": len(node.rounds), "producers": list(node.producers),
                      **preflight.get(n, {})}
                  for n, node in report.problem.nodes.items()},
        "stages": stage_rows(report.chosen, report),
        "compared": [summary(s) for s in report.compared],
        "not_run": [{"method": s.method, "reason": s.reason} for s in report.not_run],
    }


def with_pilot(plan: dict, pilot_s: float, rest_estimated_s: float, out: str) -> dict:
    """`plan --pilot --json`: the plan's JSON (`report_json`, planned on the lengths the pilots
    measured) with the pilots' figures; `estimated_s` is then the pilots' time (this command's,
    from its start) plus the rest's estimate (the `run` command's own start and end included),
    and the schedule's own total stays in `total_s`."""
    return {**plan, "estimated_s": round(pilot_s + rest_estimated_s, 3), "pilot_s": round(pilot_s, 3),
            "rest_estimated_s": round(rest_estimated_s, 3), "out": out}
