"""What a run measured of the servers it sent nodes to: per model on servers, the pace of its
nodes that finished in this invocation (their answers over the time from their start to their
end, counted together), filed in the local store for the plans after it (see
`costmodel.server_pace`)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from pathlib import Path

from batchllm.costmodel.server_pace import ServerPace, ServerPaceStore
from batchllm.dag.model import DagSpec
from batchllm.runtime.progress import NodeStats


def server_paces(dag: DagSpec, stats: Mapping[str, NodeStats], source: str, today: datetime.date) -> list[ServerPace]:
    """One pace per model on servers whose nodes all finished here, when enough was measured."""
    paces = []
    for model, endpoint in dag.endpoints.items():
        names = [name for name, node in dag.nodes.items() if node.model == model]
        ran = [stats[name] for name in names if name in stats]
        if not ran or len(ran) < len(names) or any(s.finished_at is None for s in ran):
            continue
        start_s, end_s = min(s.started_at for s in ran), max(s.finished_at or 0.0 for s in ran)
        requests = sum(s.units_done_now * dag.nodes[s.node].sampling.n for s in ran)
        pace = ServerPace(model, endpoint.urls, requests, sum(s.output_tokens for s in ran), end_s - start_s,
                          today.isoformat(), source)
        if pace.enough():
            paces.append(pace)
    return paces


def save_server_paces(dag: DagSpec, stats: Mapping[str, NodeStats], home: Path) -> list[str]:
    """File the run's server paces; one line per pace filed."""
    store = ServerPaceStore(home)
    lines = []
    for pace in server_paces(dag, stats, f"a run of {dag.name}", datetime.date.today()):
        store.save(pace)
        lines.append(f"pace of {pace.model}'s servers filed for later plans: {pace.describe()}")
    return lines
