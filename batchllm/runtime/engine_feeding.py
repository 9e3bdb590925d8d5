"""Keeps each node's engines fed: windows of the node's ready units are prepared (rendered,
tokenized, split over its replicas in prefix order) off the main loop, queued in its backlog,
and handed to each engine up to what it runs at once (a server's: what its latency guard
allows now). A new prompt set's pilot goes first, alone."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from batchllm.engines.protocol import EngineConfig
from batchllm.runtime.engine_set import EngineSet
from batchllm.runtime.ledger import Ledger, node_units
from batchllm.runtime.length_learning import LengthSampler
from batchllm.runtime.node_run import NodeRun
from batchllm.runtime.prepare import PreparedWindow, RequestPreparer, split
from batchllm.runtime.reuse import RunReuse

FIRST_WINDOW_UNITS = 1_024  # a node's first window in a run (also a resumed one) is small: work at once
WINDOW_UNITS = 8_192  # later windows: large enough for the prefix order to find what is shared
DEFAULT_BLOCK_SIZE_TOKENS = 16  # until an engine on devices says its own


class EngineFeeding:
    def __init__(self, engines: EngineSet, ledger: Ledger, preparer: RequestPreparer, pilots_only: bool,
                 length_sampler: LengthSampler | None, reuse: RunReuse | None = None):
        """`reuse`: the result store's answers are taken before a window is prepared. How long each
        request of a node will answer (the prefix order and the split over replicas weigh requests
        by it) is the node's forecast (`NodeRun.forecast`)."""
        self.engines, self.ledger, self.preparer = engines, ledger, preparer
        self.pilots_only, self.length_sampler = pilots_only, length_sampler
        self.reuse = reuse
        self.block_size_tokens = DEFAULT_BLOCK_SIZE_TOKENS

    def feed(self, runs: Iterable[NodeRun]) -> int:
        """One turn's feeding of these nodes, producers first: admit, then submit. Returns how
        many requests were handed to engines."""
        submitted = 0
        for run in runs:
            reused_before, stats = run.reused, run.stats
            assert stats is not None, f"{run.name} has engines before it started"
            if (ideal_cached_tokens := self.admit(run)) is not None:
                stats.ideal_cached_tokens = (stats.ideal_cached_tokens or 0) + ideal_cached_tokens
            if run.reused.committed > reused_before.committed:  # taken from the result store: done, not by this run's engines
                stats.reuse(run.reused.minus(reused_before))
            submitted += self.submit(run)
        return submitted

    def admit(self, run: NodeRun) -> int | None:
        """Keep the node's backlog ahead of its engines: take a prepared window when it is ready,
        and start preparing the next when what waits runs low. Returns the prefix cache's ideal
        hits (tokens) of a window of fresh units taken now (None: none taken)."""
        configs, backlog, ideal_cached_tokens = run.replicas, run.backlog, None
        if run.preparing is not None:
            future, fresh = run.preparing
            if not future.done():
                return None
            run.preparing = None
            window: PreparedWindow = future.result()
            if len(window.replicas) != len(configs):  # the replicas changed while it was prepared
                window = split([p for part in window.replicas for p in part], len(configs), self.block_size_tokens,
                               self.preparer.prefix_order)
            backlog.add(window.replicas, [self._units_in(c) * window.mean_work for c in configs])
            ideal_cached_tokens = window.ideal_cached_tokens if fresh else None
        at_once = sum(self.engines.of(c).engine.ready.max_num_seqs for c in configs)
        if len(backlog) >= max(WINDOW_UNITS, at_once) or not run.feed.has_more():  # the next is prepared while one waits
            return ideal_cached_tokens
        fresh = not run.feed.retry
        units = self._take(run, at_once)
        if units is not None and len(units):
            requests = run.feed.render(units)
            if self.reuse is not None:
                units, requests = self.reuse.take_stored(run, units, requests)
            if not requests:
                return ideal_cached_tokens
            if self.length_sampler is not None:
                self.length_sampler.remember(run.name, requests)
            run.preparing = (self.preparer.submit(requests, configs[0].model or None, self.block_size_tokens, len(configs),
                                                  run.forecast()), fresh)
        return ideal_cached_tokens

    def _take(self, run: NodeRun, at_once: int) -> np.ndarray | None:
        """The next units to prepare: the pilot's rows first, alone; None: none may go now."""
        pilot = run.pilot
        if pilot is None:
            if self.pilots_only:
                return None
            size = WINDOW_UNITS if run.took_window else FIRST_WINDOW_UNITS  # the first of this run: small
            run.took_window = True
            return run.feed.take_ready(max(size, 2 * at_once))
        if not pilot.taken:
            pilot.taken = True
            return run.feed.take_rows(pilot.rows)
        # while the pilot runs, only its own units lost with an engine
        return run.feed.take_retried(len(pilot.rows)) if run.feed.retry else None

    def submit(self, run: NodeRun) -> int:
        """Hand each of the node's engines waiting requests up to what it runs at once. Returns
        how many were handed over."""
        backlog, submitted = run.backlog, 0
        if not len(backlog):
            return 0
        engines = [self.engines.of(c) for c in run.replicas]
        limits = [running.engine.in_flight_limit() for running in engines]  # a server's: what its latency guard allows now
        in_engine = [self.ledger.running_on[running.slot] for running in engines]  # on a server also calls held back or retried
        serving = [min(count, limit) for count, limit in zip(in_engine, limits)]
        for index, (config, running) in enumerate(zip(run.replicas, engines)):
            if not len(backlog):
                break
            batch = backlog.take(index, limits[index] - in_engine[index], serving)
            if batch:
                _, units = node_units(np.fromiter((r.request_id for r in batch), np.int64, len(batch)))
                self.ledger.send(run.name, units, running.slot)
                self.engines.submit(config, batch)
                submitted += len(batch)
                in_engine[index] += len(batch)
        return submitted

    def regroup(self, run: NodeRun) -> None:
        """Spread what waits for the node over its replicas as they are now."""
        run.backlog.regroup(len(run.replicas), lambda batch, parts: split(batch, parts, self.block_size_tokens,
                                                                            self.preparer.prefix_order).replicas)

    def note_block_size(self, configs: list[EngineConfig]) -> None:
        """The prefix order's block: what the engines on devices page their KV cache in."""
        for config in configs:
            running = self.engines.get(config)
            if config.endpoint is None and running is not None:
                self.block_size_tokens = running.engine.ready.block_size_tokens

    def _units_in(self, config: EngineConfig) -> int:
        """Units running in the engine (their work is estimated by the caller)."""
        return self.ledger.running_on[self.engines.of(config).slot]
