"""What a run measured of the servers it sent nodes to: per model on servers, the pace of its
nodes that answered in this invocation and finished (their answers from their first commit to
their end, counted together), filed in the local store for the plans after it (see
`costmodel.server_pace`)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from pathlib import Path

from batchllm.costmodel.server_pace import ServerPace, ServerPaceStore
from batchllm.dag.model import DagSpec
from batchllm.runtime.progress import NodeStats


def server_paces(dag: DagSpec, stats: Mapping[str, NodeStats], source: str, today: datetime.date) -> list[ServerPace]:
    """One pace per model on servers whose nodes all answered and finished here, when enough
    was measured: the answers after each node's first commit, over the time from the first of
    those commits to the last node's end."""
    paces = []
    for model, endpoint in dag.endpoints.items():
        names = [name for name, node in dag.nodes.items() if node.model == model]
        ran = [stats[name] for name in names if name in stats]
        if not ran or len(ran) < len(names) or any(s.finished_at is None or s.first_commit is None for s in ran):
            continue  # no node of it, or one did not run, or not to its end, in this invocation
        answers = tokens = 0
        for s in ran:
            assert s.first_commit is not None
            _, units, failed, output_tokens = s.first_commit
            answers += (s.units_done_now - units - (s.failed - failed)) * dag.nodes[s.node].sampling.n
            tokens += s.output_tokens - output_tokens
        start_s = min(s.first_commit[0] for s in ran if s.first_commit is not None)
        end_s = max(s.finished_at for s in ran if s.finished_at is not None)
        pace = ServerPace(model, endpoint.urls, answers, tokens, end_s - start_s, today.isoformat(), source)
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
