"""The order a model's requests go to its replicas, so shared prefixes hit the cache.

1. Group: prompts sharing at least one cache block stay together, in depth-first order
   of the prefix tree (a prefix before what extends it, siblings adjacent). Groups share
   less than a block with each other, so how groups are ordered costs no cache hits.
2. Split for replicas: the heaviest group is cut at its shallowest branching while it
   is heavier than a replica's fair share (what is lost is the shared prefix above the
   cut, computed once more), then groups are balanced over the replicas (`balance`:
   heaviest first to the least-loaded).
3. Length buckets: within a replica, groups run in buckets of similar prompt length
   (powers of two of their mean), longest bucket first, so a batch does not mix very
   long and very short prompts; inside a bucket, the group with the longest predicted
   answer (`extra_work`) first, so long answers do not make the replica's tail.

Work of a request = prompt tokens the ideal cache does not hold + `extra_work` (its
predicted output tokens).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from batchllm.ordering.balance import balance
from batchllm.ordering.prefix_tree import PrefixTree

SPLIT_SLACK = 1.05  # a group may exceed a replica's fair share by this much before it is cut


@dataclass(frozen=True)
class RequestOrder:
    replicas: list[list[int]]  # per replica, request indices in submission order
    ideal_cached_tokens: int  # an unbounded cache, one replica, this order
    cached_tokens_after_split: int  # the same, with each replica's cache on its own


def order_requests(prompts: Sequence[Sequence[int]], *, block_size: int, replicas: int = 1,
                   extra_work: Sequence[float] | None = None) -> RequestOrder:
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    tree = PrefixTree(prompts, block_size)
    if len(tree) == 0:
        return RequestOrder([[] for _ in range(replicas)], 0, 0)
    lengths = tree.lengths[tree.order]
    cached = tree.cached_tokens()
    extra = np.zeros(len(tree)) if extra_work is None else np.asarray(extra_work, float)[tree.order]
    work = (lengths - cached) + extra  # per DFS position
    groups = tree.subtrees()
    ideal = int(cached.sum())
    lost = 0  # cache hits given up by cuts
    if replicas > 1:
        heap = [(-work[a:b].sum(), a, b) for a, b in groups]
        heapq.heapify(heap)
        while heap and -heap[0][0] > work.sum() / replicas * SPLIT_SLACK and heap[0][2] - heap[0][1] > 1:
            _, a, b = heapq.heappop(heap)
            cut = tree.shallowest_split(a, b, work)
            lost += int(cached[cut])
            work[cut] += cached[cut]  # its shared prefix is computed again on the other side
            cached[cut] = 0
            heapq.heappush(heap, (-work[a:cut].sum(), a, cut))
            heapq.heappush(heap, (-work[cut:b].sum(), cut, b))
        groups = sorted((a, b) for _, a, b in heap)
    picked = balance([work[a:b].sum() for a, b in groups], replicas)
    assigned = [[groups[k] for k in indices.tolist()] for indices in picked]
    running_total = np.concatenate([[0], np.cumsum(lengths)]).tolist()  # prompt tokens before each DFS position
    longest = np.maximum.reduceat(extra, [a for a, _ in groups]).tolist() if groups else []  # per group
    longest_of = {g: value for g, value in zip(groups, longest)}
    ordered = []
    for runs in assigned:
        runs.sort(key=lambda g: (-_bucket((running_total[g[1]] - running_total[g[0]]) / (g[1] - g[0])), -longest_of[g], g[0]))
        ordered.append([int(i) for a, b in runs for i in tree.order[a:b]])
    return RequestOrder(ordered, ideal, ideal - lost)


def _bucket(mean_length: float) -> int:
    return int(math.log2(max(mean_length, 1.0)))
