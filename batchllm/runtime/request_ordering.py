"""Each batch of ready requests goes to its engine in prefix order (see
`batchllm.ordering.request_order`), so prompts sharing a prefix run while it is cached;
and, per node, the cached tokens a perfect order would get, for the run summary.

Token ids come from the model's own tokenizer, applied as the worker applies it; one
tokenizer per model directory per process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from batchllm.engines.protocol import EngineRequest
from batchllm.models.tokens import PromptTokenizer
from batchllm.ordering.prefix_tree import PrefixTree
from batchllm.ordering.request_order import order_requests


@functools.lru_cache(maxsize=8)
def _tokenizer(model_dir: str) -> PromptTokenizer:
    return PromptTokenizer(model_dir)


class PrefixOrdering:
    def __init__(self, tokenizer_for: Callable[[str], PromptTokenizer] | None = None):
        self._tokenizer_for = tokenizer_for or _tokenizer
        self._prompts: dict[str, dict[str, list[int]]] = {}  # node -> request id -> token ids, each request once
        self._loading: dict[str, Future] = {}
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer-loader")  # it never spawns engines

    def preload(self, model_dir: str) -> None:
        """Load the model's tokenizer in a thread while its engines start (measured: the
        first load, transformers import included, takes ~6 s of driver time here)."""
        if model_dir not in self._loading:
            self._loading[model_dir] = self._loader.submit(self._tokenizer_for, model_dir)

    def _tokenizer_of(self, model_dir: str) -> PromptTokenizer:
        self.preload(model_dir)
        return self._loading[model_dir].result()

    def __call__(self, node: str, requests: list[EngineRequest], model_dir: str, block_size: int) -> list[EngineRequest]:
        return self.split(node, requests, model_dir, block_size, replicas=1)[0]

    def split(self, node: str, requests: list[EngineRequest], model_dir: str, block_size: int,
              replicas: int) -> list[list[EngineRequest]]:
        """One list per data-parallel replica, of similar work, each in prefix order. A
        request split again (re-split for other replicas, or sent again after its engine
        was lost) counts once towards the node's ideal."""
        if not requests:
            return [[] for _ in range(replicas)]
        tokenizer = self._tokenizer_of(model_dir)
        prompts = [tokenizer.token_ids(r) for r in requests]
        self._prompts.setdefault(node, {}).update((r.request_id, ids) for r, ids in zip(requests, prompts))
        order = order_requests(prompts, block_size=block_size, replicas=replicas,
                               extra_work=[r.max_tokens * r.n for r in requests])
        return [[requests[i] for i in indices] for indices in order.replicas]

    def ideal_cached_tokens(self, node: str, block_size: int) -> int:
        """Prompt tokens an unbounded prefix cache serves for this node's requests in the best order."""
        return PrefixTree(list(self._prompts.get(node, {}).values()), block_size).ideal_cached_tokens()
