"""What the result store already holds of a DAG, before it runs: `plan` and `validate` show it.

The census is a run's own first step (`RunReuse.take_before_start`) in a scratch folder that is
removed after: each node's ready requests rendered and looked up, producers first, the stored
answers committed there so the nodes below them render their prompts from them. So a node
below an edited one is counted where its prompts come out as before, exactly as a run counts
it. Nothing is written to the store.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from batchllm.dag.model import DagSpec
from batchllm.io.dag_checks import node_vector_dimensions
from batchllm.io.input_source import InputSource
from batchllm.io.result_store import ResultStore
from batchllm.runtime.node_run import open_node_runs
from batchllm.runtime.request_keys import NodeKeys
from batchllm.runtime.reuse import RunReuse
from batchllm.runtime.run_dir import RunDir


@dataclass(frozen=True)
class NodeCensus:
    node: str
    stored: int  # units the store answers now
    units: int  # the node's units (those of rows its producers may still skip included)
    answered_whole: bool = False  # every unit it will have is answered (the others are of rows it skips)

    def line(self, estimated_s: float | None = None) -> str:
        """`judge: 12 of 24 requests stored (saves about 8 s)`."""
        saves = f" (saves about {estimated_s * self.stored / self.units:,.0f} s)" if estimated_s and self.units else ""
        return f"{self.node}: {self.stored:,} of {self.units:,} requests stored{saves}"


def stored_census(dag: DagSpec, sources: dict[str, InputSource], store_path: Path, device_kind: str, home: Path,
                  whole: bool = True) -> list[NodeCensus]:
    """Per node on devices, in topological order: how many of its units the store at `store_path`
    answers (a store that is not there yet answers none, and is not made). `whole`: count every
    unit (else a node's count stops at its first window the store answers less than half of, as
    a run's first step does: enough to say whether it is answered whole)."""
    on_devices = [name for name in dag.topological_order() if not dag.on_endpoints(name)]
    if not store_path.is_file():
        return []
    with tempfile.TemporaryDirectory(prefix="batchllm-census-") as scratch:
        run_dir = RunDir(Path(scratch) / "run")
        run_dir.open(fresh=True)
        nodes, _, _ = open_node_runs(dag, sources, run_dir, lambda _: None, node_vector_dimensions(dag, home))
        try:
            for run in nodes:
                run.keys = NodeKeys.of(dag, run.spec, device_kind, home) if run.name in on_devices else None
            reuse = RunReuse(ResultStore(store_path), "census", lambda _: None)
            try:
                taken = reuse.take_before_start(nodes, whole=whole)
            finally:
                reuse.store.close()
            return [NodeCensus(name, taken.get(name, 0), nodes[name].ledger.units, nodes[name].ledger.is_settled())
                    for name in on_devices]
        finally:
            for run in nodes:
                run.feed.close()
                run.journal.close()
            run_dir.close()


def answered_whole(dag: DagSpec, sources: dict[str, InputSource], store_path: Path, device_kind: str, home: Path) -> bool:
    """The store answers every request of the DAG: a run of it computes nothing (so it needs no
    length model's fit and no plan)."""
    if any(dag.on_endpoints(name) for name in dag.nodes):
        return False
    census = stored_census(dag, sources, store_path, device_kind, home, whole=False)
    return bool(census) and all(node.answered_whole for node in census)
