"""A run's engines, kept at what the current stage assigns its nodes (`NodeRun.replicas`).

`poll()` collects what they finished. `reconcile()` starts, hands over and stops engines replica by replica (`EngineSet`) and gives the
units of stopped engines back to their node's feed. `count_losses()` weighs engines that failed
to start or died against their node: a node on several servers that loses one goes on with the
others (the lost one is tried again at the next stage); any other loss is a restart of its
node, which fails past MAX_ENGINE_RESTARTS.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent import futures

from batchllm.engines.protocol import EngineConfig
from batchllm.runtime.engine_feeding import EngineFeeding
from batchllm.runtime.engine_set import EngineLoss, EngineSet, EngineStart, Polled
from batchllm.runtime.ledger import Ledger
from batchllm.runtime.node_run import NodeRun, NodeRuns

MAX_ENGINE_RESTARTS = 2
POLL_S = 0.05
IDLE_S = 0.002  # nothing in an engine and nothing being prepared: the stage is about to end
SERVER_NOTES_EVERY_S = 1.0  # a server's note walks its guard's window


class StageEngines:
    def __init__(self, engines: EngineSet, nodes: NodeRuns, ledger: Ledger, feeding: EngineFeeding, note: Callable[[str], None]):
        self.engines, self.nodes, self.ledger, self.feeding, self.note = engines, nodes, ledger, feeding, note
        self._servers_noted_at = 0.0

    def reconcile(self) -> tuple[list[EngineStart], list[EngineLoss]]:
        """Bring the engines to the nodes' replicas. Returns the engines started, and those that
        failed to start."""
        starts_before = len(self.engines.starts)
        wanted = [c for run in self.nodes.with_engines() for c in run.replicas]
        stopped, failed = self.engines.reconcile(wanted)
        self.release(stopped)
        self.feeding.note_block_size(wanted)
        return self.engines.starts[starts_before:], failed

    def poll(self) -> Polled:
        """What the engines finished and measured. With nothing in an engine, wait for a window
        being prepared instead (spinning here would starve the preparing thread)."""
        if not any(self.ledger.running_on.values()):
            pending = [run.preparing[0] for run in self.nodes if run.preparing is not None]
            if pending:
                futures.wait(pending, timeout=POLL_S, return_when=futures.FIRST_COMPLETED)
            else:  # work waiting while nothing runs: the servers' guards allow none now
                time.sleep(POLL_S if any(len(run.backlog) for run in self.nodes.with_engines()) else IDLE_S)
        return self.engines.poll(POLL_S, busy=lambda slot: self.ledger.running_on[slot] > 0)

    def release(self, losses: Iterable[EngineLoss]) -> None:
        """Units on stopped or lost engines are READY again."""
        for loss in losses:
            for node, units in self.ledger.release(loss.slot).items():
                self.nodes[node].feed.requeue(units)

    def count_losses(self, losses: Iterable[EngineLoss]) -> list[tuple[NodeRun, str]]:
        """The nodes these lost engines fail, with the cause (their engines are dropped)."""
        failing = []
        for loss in losses:
            run = self.nodes.owner_of(loss.config)
            if run is None:
                continue
            if loss.config.endpoint is not None and self._server_left(run, loss.config):
                run.replicas = [c for c in run.replicas if c != loss.config]
                self.feeding.regroup(run)
                self.note(f"[yellow]server {loss.config.endpoint.url} of {run.name} lost ({loss.cause}); the other servers "
                          f"take its requests, and it is tried again at the next stage[/yellow]")
                continue
            run.restarts += 1
            if run.restarts > MAX_ENGINE_RESTARTS:
                run.replicas = []
                failing.append((run, loss.cause or "engine lost"))
            else:
                self.note(f"[yellow]engine for {run.name} lost; restarting ({run.restarts}/{MAX_ENGINE_RESTARTS})[/yellow]")
        return failing

    def note_servers(self) -> None:
        """What each server's latency guard allows and reads, for the progress and `status` (at
        most every SERVER_NOTES_EVERY_S)."""
        if time.monotonic() < self._servers_noted_at + SERVER_NOTES_EVERY_S:
            return
        self._servers_noted_at = time.monotonic()
        for run in self.nodes.with_engines():
            if run.on_servers:
                running = [self.engines.get(c) for c in run.replicas]
                assert run.stats is not None, f"{run.name} has servers before it started"
                run.stats.servers = tuple(note for r in running if r is not None and (note := r.engine.note()))

    def _server_left(self, run: NodeRun, lost: EngineConfig) -> bool:
        """Whether another server of the node runs (one server's loss then does not fail the node)."""
        return any(c != lost and c.endpoint is not None and self.engines.get(c) is not None for c in run.replicas)
