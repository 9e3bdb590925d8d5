"""A pilot: a node whose prompt set is new starts with a random sample of its rows, at
full concurrency, so the rest of the run is planned on this prompt set's own answer
lengths instead of another's (the profile's prior).

The pilot is real work: its results are committed like any other and never run again
(a resumed run finds them committed). When every pilot unit has its result, the stage
ends and the stage chooser plans the rest on the calibration, which now holds the
pilot's lengths (censoring-aware: those cut at max_tokens).

A node gets a pilot when the run is planned (`schedule: plan`, `max`, `min`), it reads no
upstream node (its rows are all known before it runs: a consumer's rows come as its
producers commit, and its lengths are learnt as they end), its prompt set is new (no
earlier output of it in the local store, nothing committed in this run folder), and it has
more than twice its pilot's rows (a smaller node is hardly more than its pilot).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np

from batchllm.core.errors import UserError
from batchllm.dag.model import NodeSpec
from batchllm.runtime.ledger import FinalState, NodeLedger


@dataclass(frozen=True)
class PilotSize:
    share: float = 0.005  # of the node's rows
    min_rows: int = 64
    max_rows: int = 2_000

    def rows_for(self, total_rows: int) -> int:
        return int(min(total_rows, max(self.min_rows, min(self.max_rows, round(total_rows * self.share)))))

    @classmethod
    def parse(cls, text: str) -> PilotSize:
        """`1%` (a share of the rows, within the default bounds) or `500` (rows)."""
        text = text.strip()
        if match := re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", text):
            share = float(match.group(1)) / 100
            if 0 < share <= 0.5:
                return cls(share=share)
        elif text.isdigit() and int(text) > 0:
            return cls(share=0.0, min_rows=int(text), max_rows=int(text))
        raise UserError(f"--pilot {text!r} is not a size", where="--pilot",
                        hint="give a share of each node's rows (e.g. --pilot 1%, at most 50%) or a number of rows (--pilot 500)")


def pilot_rows(total_rows: int, size: PilotSize, seed: int) -> np.ndarray:
    """The sampled rows (sorted), the same for the same node and data (so a resumed run
    samples the rows it sampled before)."""
    count = size.rows_for(total_rows)
    return np.sort(np.random.default_rng(seed).choice(total_rows, size=count, replace=False)).astype(np.int64)


def wants_pilot(total_rows: int, size: PilotSize) -> bool:
    return total_rows > 2 * size.rows_for(total_rows)


def seed_of(fingerprint: str) -> int:
    return int(hashlib.sha256(fingerprint.encode()).hexdigest()[:8], 16)


@dataclass
class NodePilot:
    """A node's pilot while it runs (`NodeRun.pilot`): its rows, and whether they were handed out yet."""

    node: str
    rows: np.ndarray
    total_rows: int
    taken: bool = False

    def note(self) -> str:
        return (f"pilot: {len(self.rows):,} random rows of {self.node} first ({len(self.rows) / self.total_rows:.1%} of "
                f"{self.total_rows:,}), to learn its answer lengths; then the rest is planned on them")

    def ended(self, ledger: NodeLedger) -> bool:
        """Every row of it was handed out and has its result (the node's ledger says)."""
        return self.taken and not (ledger.final_state_of(self.rows) == FinalState.PENDING).any()


class Pilots:
    """Which nodes of a run get a pilot (`begin`, as the run opens). The pilot that runs is the
    node's own (`NodeRun.pilot`), and the ledger says which of its rows are done."""

    def __init__(self, size: PilotSize | None, known_prompt_sets: frozenset[str]):
        self.size, self.known_prompt_sets = size, known_prompt_sets

    def begin(self, node: NodeSpec, ledger: NodeLedger, fingerprint: str) -> NodePilot | None:
        """The node's pilot when it gets one: its sampled rows, none of them run yet, or some
        committed by an interrupted pilot (those are not run again). A pooling node gets none:
        each of its answers is one prefill step, there is no length to learn."""
        rows = self._rows(node, ledger, fingerprint)
        if rows is None or fingerprint in self.known_prompt_sets:
            return None
        committed = int((ledger.final_state_of(rows) == FinalState.COMMITTED).sum())
        if committed == len(rows) or ledger.committed_units > committed:  # done, or the run went past it
            return None
        return NodePilot(node.name, rows, ledger.rows)

    def ended_earlier(self, node: NodeSpec, ledger: NodeLedger, fingerprint: str) -> np.ndarray | None:
        """The node's pilot rows when an earlier command in this run folder committed every one
        of them (`plan --pilot`, or a run that went past its pilot): a random sample of its
        prompt set whose answers all ended, which the run's lengths learn from as the pilot's
        own end would teach them. None when the node would get no pilot, or its pilot is not done."""
        rows = self._rows(node, ledger, fingerprint)
        return rows if rows is not None and (ledger.final_state_of(rows) == FinalState.COMMITTED).all() else None

    def _rows(self, node: NodeSpec, ledger: NodeLedger, fingerprint: str) -> np.ndarray | None:
        """The node's pilot rows, where the node is one pilots are for (see the module); else None."""
        if self.size is None or node.reads or node.iterate or node.task.pools or not wants_pilot(ledger.rows, self.size):
            return None
        return pilot_rows(ledger.rows, self.size, seed_of(fingerprint))
