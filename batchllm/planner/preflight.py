"""`batchllm plan` as a pre-flight check: per node, what it will read and produce, how
long it holds its devices and what it costs, before anything runs.

From the node's data summary (`io.node_data`: rows, prompt tokens of a sample, rows over
the context), its predicted output lengths (`length_sources`), the chosen schedule (the
seconds the node holds devices, and how many) and the DAG's `prices:` (the run summary's
own `Price.cost`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchllm.dag.model import DagSpec, Price
from batchllm.planner.length_sources import output_caps, output_quantiles
from batchllm.planner.problem import NodeWorkload
from batchllm.planner.schedule import Schedule


@dataclass(frozen=True)
class NodePreflight:
    node: str
    model: str
    rows: int  # units before `n` (an iterating node: its input rows)
    requests: int  # sequences: every round, `n` included
    sample_rows: int
    prompt_tokens: dict[str, int]  # p50, p90, max over the sample
    rows_over_context: int
    over_context_estimated: bool  # from a sample, or of estimated prompt tokens
    max_model_len: int | None
    output_p50: float
    output_p90: float
    output_source: str
    prompt_tokens_total: float  # expected, over the node's units (a unit's prompt counts once, whatever its `n`)
    output_tokens_total: float  # expected, over its requests
    price: Price | None

    def cost(self) -> float | None:
        if self.price is None:
            return None
        return self.price.cost(round(self.prompt_tokens_total), round(self.output_tokens_total))

    def over_context_note(self) -> str | None:
        count = self.rows_over_context
        if count <= 0 or self.max_model_len is None:
            return None
        rows = f"{count:,} row{'s' if count != 1 else ''}"
        how = f"about {rows} (estimated on a sample of {self.sample_rows:,})" if self.over_context_estimated else rows
        return (f"{self.node}: {how} would not fit max_model_len {self.max_model_len:,} (a prompt of "
                f"{self.max_model_len:,} tokens or more leaves no room for an output token) and would get `error:` results; "
                "raise max_model_len in `engine:` or shorten the template")


def node_preflight(item: NodeWorkload, dag: DagSpec) -> NodePreflight:
    """A node's pre-flight figures (before the schedule's time and devices)."""
    summary, lengths = item.summary, item.output_lengths
    if summary is None or lengths is None:
        raise ValueError(f"node {item.name!r} was not planned from a DAG's data (no summary)")
    node = dag.nodes[item.name]
    caps = output_caps(summary, node.sampling.max_tokens)
    p50, p90 = output_quantiles(lengths, caps, (0.5, 0.9))
    requests = summary.requests
    units = requests / summary.requests_per_unit
    sample = len(summary.prompt_tokens)
    mean_prompt = float(np.mean(summary.prompt_tokens)) if sample else 0.0
    mean_output = float(np.mean(lengths.expected(caps))) if sample else 0.0
    return NodePreflight(item.name, node.model, int(round(summary.rows)), requests, sample, summary.prompt_token_stats(),
                         summary.rows_over_context, summary.over_context_estimated, summary.max_model_len, p50, p90,
                         lengths.source, mean_prompt * units, mean_output * requests, dag.prices.get(node.model))


def node_times(schedule: Schedule) -> dict[str, tuple[float, float]]:
    """Per node: (seconds it holds devices, device-seconds), over the schedule's stages."""
    times: dict[str, tuple[float, float]] = {}
    for stage in schedule.stages:
        for name in stage.plans:
            held_s, device_s = times.get(name, (0.0, 0.0))
            times[name] = (held_s + stage.duration_s, device_s + stage.duration_s * len(stage.placement[name]))
    return times
