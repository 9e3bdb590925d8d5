"""A prefix tree over token sequences at the granularity of cache blocks, kept as the
sequences in a depth-first order plus the shared whole blocks of each neighbouring pair
(the LCP array).

Each whole block of a prompt is named by a hash of it and of every block before it (its
prefix id: equal ids, equal prefixes, but for a 64-bit collision). Sorting the prompts
by their sequences of prefix ids gives a depth-first order of the block-level radix
tree: a prompt comes before what extends it, a run of neighbours whose LCPs are all >= d
is exactly the subtree below depth d, and the shallowest branching inside a run is its
smallest LCP. The sort compares short byte strings (8 bytes a block, not a token each),
so the time is about one pass over the tokens (~3.5 ns a token with the C accelerator,
~10.5 in Python, on the development machine); what is inside a block, or past a
prompt's last whole block, never changes the order, because an engine's prefix cache
matches whole blocks only.

Invariant: a sequence's longest common prefix with any sequence before it in `order`
is its LCP with its predecessor (a property of lexicographic order), so `lcp` alone
tells how much of each prompt an ideal prefix cache, visiting in this order, holds.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

ID_BYTES = 8  # a prefix id: one 64-bit hash


def python_block_prefix_ids(tokens: Sequence[int], block_size: int) -> bytes:
    """A prompt's prefix ids, ID_BYTES (native int64) a whole block: each block's id hashes
    the previous block's id with the block's tokens (CPython's tuple hash: one pass over
    the tokens, no unboxing, and the same in every process since integers are not
    hash-randomised)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    tokens = tuple(tokens)
    prefix, ids = 0, array("q")
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prefix = hash((prefix, tokens[start:start + block_size]))
        ids.append(prefix)
    return ids.tobytes()


try:  # the same ids from the optional C accelerator (setup.py), ~3x faster
    from batchllm.ordering._block_ids import block_prefix_ids
    BLOCK_IDS_IN = "C"
except ImportError:
    block_prefix_ids = python_block_prefix_ids
    BLOCK_IDS_IN = "Python"


def _keys(prompts: Sequence[Sequence[int]], block_size: int) -> tuple[list[bytes], np.ndarray]:
    """Each prompt's prefix ids as bytes, and its length in tokens."""
    keys = [block_prefix_ids(prompt, block_size) for prompt in prompts]
    lengths = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
    return keys, lengths


def _shared_blocks(a: bytes, b: bytes, block_bytes: int) -> int:
    """Whole blocks two keys share at their start (binary search over memcmp'd slices)."""
    blocks = min(len(a), len(b)) // block_bytes
    if blocks == 0 or a[:block_bytes] != b[:block_bytes]:
        return 0
    if a[:blocks * block_bytes] == b[:blocks * block_bytes]:
        return blocks
    low, high = 1, blocks - 1  # a[:low blocks] matches; a[:high + 1 blocks] does not
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle * block_bytes] == b[:middle * block_bytes]:
            low = middle
        else:
            high = middle - 1
    return low


class PrefixTree:
    """Prompts' prefix tree at the granularity of cache blocks: `lcp` counts the tokens of
    the whole `block_size` blocks neighbours share (an engine's prefix cache matches whole
    blocks only, so finer sharing buys nothing)."""

    def __init__(self, prompts: Sequence[Sequence[int]], block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        keys, self.lengths = _keys(prompts, block_size)
        self.order = np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
        lcp = np.zeros(len(keys), dtype=np.int64)
        ordered = [keys[i] for i in self.order.tolist()]
        for position in range(1, len(ordered)):
            lcp[position] = _shared_blocks(ordered[position - 1], ordered[position], ID_BYTES) * block_size
        self.lcp = lcp  # lcp[k]: whole-block common prefix of order[k-1] and order[k], in tokens; lcp[0] = 0

    def __len__(self) -> int:
        return int(self.order.size)

    def cached_tokens(self) -> np.ndarray:
        """Per position in DFS order: tokens an unbounded prefix cache serves (whole blocks,
        never a prompt's last token, which the engine always computes)."""
        lengths = self.lengths[self.order]
        usable = np.minimum(self.lcp, np.maximum(lengths - 1, 0))
        return usable // self.block_size * self.block_size

    def ideal_cached_tokens(self) -> int:
        return int(self.cached_tokens().sum())

    def subtrees(self) -> list[tuple[int, int]]:
        """[start, end) ranges of DFS positions: maximal runs whose neighbours share at least
        one block, i.e. the subtrees below the first block (and single prompts that share
        no block with anyone)."""
        cuts = np.flatnonzero(self.lcp < self.block_size)
        bounds = list(cuts) + [len(self)]
        return [(int(a), int(b)) for a, b in zip(bounds, bounds[1:])] if len(self) else []

    def shallowest_split(self, start: int, end: int, weight: np.ndarray) -> int:
        """Where to cut the run [start, end) in two, losing the least sharing: at its
        smallest LCP (the subtree's first branching), among those nearest the run's
        middle by `weight` (per DFS position)."""
        if end - start < 2:
            raise ValueError(f"a run of {end - start} prompts cannot be split")
        inner = self.lcp[start + 1:end]
        shallow = start + 1 + np.flatnonzero(inner == inner.min())
        cumulative = np.cumsum(weight[start:end])
        half = cumulative[-1] / 2
        return int(min(shallow, key=lambda p: abs(cumulative[p - start - 1] - half)))
