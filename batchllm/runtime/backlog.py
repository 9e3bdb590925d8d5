"""A node's requests that are ready but not yet handed to an engine: one queue per
data-parallel replica, each in prefix order, each request with its predicted work.

An engine is given no more requests than it runs at once (its max_num_seqs); the rest
wait here. Requests inside an engine stay there until they finish, so when a stage
gives the node more (or fewer) replicas, only what waits here can move: it is split
again over the new replicas. Without this, a node that grows keeps all its work queued
in its old engines and the added replicas idle.

A replica whose queue runs dry takes the back half of the queue with the most work waiting
(what that queue's replica would run last), but never so much that fewer wait there than its
engine runs: replicas that run slower than predicted (a server busy with its own traffic, a
slower machine, one the latency guard holds to a few requests) hand work to the faster ones,
so they end together. What waits behind a full engine goes in as its running requests end,
about as soon as another replica would start it; taken away, it made the taker end last.
(Twin engines whose answers all run to max_tokens end their batches a step apart: the first
to end took 10 of the other's last 11 requests, and ended up to 3.5 s after it in an 18 s
stage.)

Invariant: what waits here are the payloads (rendered, tokenized requests) of units the
ledger has QUEUED, each once; the ledger, not this queue, says where a unit is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from batchllm.core.requests import EngineRequest
from batchllm.ordering.balance import balance
from batchllm.runtime.prepare import Planned

Splitter = Callable[[list[Planned], int], list[list[Planned]]]  # requests, parts -> one list per part


class Backlog:
    def __init__(self) -> None:
        self._queues: list[deque[Planned]] = []
        self._waiting_work: list[float] = []  # per queue: the work of what waits in it

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues)

    @property
    def replicas(self) -> int:
        return len(self._queues)

    def add(self, lists: list[list[Planned]], loads: list[float]) -> None:
        """One list per replica (from a splitter); the heaviest goes to the replica with
        the least work (`loads`: its engine's, plus what waits here for it)."""
        if len(lists) != len(self._queues) or len(loads) != len(lists):
            raise ValueError(f"{len(lists)} lists and {len(loads)} loads for {len(self._queues)} replicas")
        works = [sum(p.work for p in batch) for batch in lists]
        totals = [load + waiting for load, waiting in zip(loads, self._waiting_work)]
        for replica, picked in enumerate(balance(works, len(self._queues), totals)):
            for index in sorted(picked.tolist(), key=lambda i: -works[i]):  # the heaviest first, as it was given out
                self._queues[replica].extend(lists[index])
                self._waiting_work[replica] += works[index]

    def regroup(self, replicas: int, split: Splitter) -> None:
        """Spread what waits over `replicas` queues (a no-op when the count is unchanged)."""
        if replicas == len(self._queues):
            return
        waiting = [p for queue in self._queues for p in queue]
        lists = split(waiting, replicas) if waiting else [[] for _ in range(replicas)]
        self._queues = [deque(batch) for batch in lists]
        self._waiting_work = [sum(p.work for p in batch) for batch in lists]

    def take(self, replica: int, count: int, running: Sequence[int]) -> list[EngineRequest]:
        """Up to `count` requests for the replica's engine; `running`: per replica, the requests
        its engine runs now (no more than it may run: a server whose latency guard holds its
        calls back runs none of them)."""
        if len(running) != len(self._queues):
            raise ValueError(f"{len(running)} running counts for {len(self._queues)} replicas")
        queue = self._queues[replica]
        if count > 0 and not queue:
            self._steal_for(replica, running)
        taken = [queue.popleft() for _ in range(min(count, len(queue)))]
        self._waiting_work[replica] = self._waiting_work[replica] - sum(p.work for p in taken) if queue else 0.0
        return [p.request for p in taken]

    def _steal_for(self, replica: int, running: Sequence[int]) -> None:
        """Move the back half of the fullest other queue (by waiting work) to `replica`'s, but
        no more than leaves as many waiting there as its engine runs."""
        victim = max((r for r in range(len(self._queues)) if r != replica and len(self._queues[r]) > running[r]),
                     key=lambda r: self._waiting_work[r], default=None)
        if victim is None:
            return
        source = self._queues[victim]
        count = min(max(1, len(source) // 2), len(source) - running[victim])
        moved = [source.pop() for _ in range(count)][::-1]
        work = sum(p.work for p in moved)
        self._queues[replica].extend(moved)
        self._waiting_work[replica] += work
        self._waiting_work[victim] -= work
