"""Rendered requests -> requests an engine can take at once: tokenized (so the engine
does not tokenize again), and split over a node's data-parallel replicas in prefix order
(see `batchllm.ordering.request_order`), so prompts sharing a prefix run while it is in
the prefix cache. A request's images lead its key as stand-in tokens of their digest (the
images come before the text, and vLLM's prefix cache tells images apart by their hash).

With the prefix order off, requests are split by work in the order given and the engine
tokenizes them. Tokenizing and ordering run in one background thread, off the driver's main loop (the
fast tokenizer releases the GIL); the main loop only submits a window and later takes
the finished result. One tokenizer per model directory, loaded in that thread too (its
first load, transformers import included, takes seconds).

Each request's work is its prompt tokens plus the output tokens predicted for it (a
node's `WindowForecast`, from its `OutputLengths`: the expected length of its answer, cut at
max_tokens, times n); without one, the most it may generate (max_tokens x n, `MAX_TOKENS`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from batchllm.core.images import order_key_ids
from batchllm.core.requests import EngineRequest
from batchllm.core.text_tokens import estimated_tokens
from batchllm.costmodel.output_lengths import MAX_TOKENS, WindowForecast
from batchllm.costmodel.work import request_work
from batchllm.models.tokens import PromptTokenizer
from batchllm.ordering.balance import balance
from batchllm.ordering.request_order import order_requests


class Planned(NamedTuple):
    """A request on its way to an engine, with its predicted work."""

    request: EngineRequest
    output_tokens: float  # predicted (x n)
    work: float  # prompt tokens + output_tokens


@dataclass(frozen=True)
class PreparedWindow:
    replicas: list[list[Planned]]  # per replica, in submission order, token ids filled in
    prompt_tokens: int
    ideal_cached_tokens: int  # what an unbounded prefix cache serves for this window in the best order
    mean_work: float  # of its requests, worked out here, off the driver's main loop


def prompt_tokens_of(request: EngineRequest) -> float:
    """Its prompt tokens once tokenized, else estimated from its characters."""
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    return estimated_tokens(len(request.prompt) + len(request.system or ""))


def planned(requests: Sequence[EngineRequest], forecast: WindowForecast = MAX_TOKENS) -> list[Planned]:
    outputs = np.asarray(forecast(requests), float).tolist()
    return [Planned(r, o, float(request_work(prompt_tokens_of(r), o))) for r, o in zip(requests, outputs)]


def split(items: Sequence[Planned], replicas: int, block_size: int, prefix_order: bool) -> PreparedWindow:
    """Tokenized requests over `replicas` lists: in prefix order, or by work in the given order."""
    if not items:
        return PreparedWindow([[] for _ in range(replicas)], 0, 0, 0.0)
    prompts = [p.request.prompt_token_ids or () for p in items]
    tokens = sum(map(len, prompts))
    mean_work = sum(p.work for p in items) / len(items)
    if prefix_order:
        keys = [order_key_ids(p.request.images) + list(ids) if p.request.images else ids for p, ids in zip(items, prompts)]
        order = order_requests(keys, block_size=block_size, replicas=replicas, extra_work=[p.output_tokens for p in items])
        return PreparedWindow([[items[i] for i in indices] for indices in order.replicas], tokens,
                              order.ideal_cached_tokens, mean_work)
    return PreparedWindow([[items[i] for i in indices.tolist()] for indices in balance([p.work for p in items], replicas)],
                          tokens, 0, mean_work)


class RequestPreparer:
    def __init__(self, prefix_order: bool = True, tokenizer_for: Callable[[str], PromptTokenizer] = PromptTokenizer):
        self.prefix_order = prefix_order
        self._tokenizer_for = tokenizer_for
        self._tokenizers: dict[str, Future] = {}
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare")  # it never spawns engines

    def preload(self, model_dir: str) -> None:
        """Load the model's tokenizer in the background while its engines start."""
        if self.prefix_order and model_dir not in self._tokenizers:
            self._tokenizers[model_dir] = self._thread.submit(self._tokenizer_for, model_dir)

    def submit(self, requests: list[EngineRequest], model_dir: str | None, block_size: int, replicas: int,
               forecast: WindowForecast = MAX_TOKENS) -> Future:
        """Future of a PreparedWindow (`model_dir` None: no tokenizer here, so no prefix order)."""
        tokenizer = None
        if self.prefix_order and model_dir is not None:
            self.preload(model_dir)
            tokenizer = self._tokenizers[model_dir]
        return self._thread.submit(self._prepare, tokenizer, requests, block_size, replicas, forecast)

    def _prepare(self, tokenizer: Future | None, requests: list[EngineRequest], block_size: int, replicas: int,
                 forecast: WindowForecast) -> PreparedWindow:
        if tokenizer is None:  # no prefix order: the engine tokenizes
            return split(planned(requests, forecast), replicas, block_size, prefix_order=False)
        ids = tokenizer.result().token_ids_many(requests)
        tokenized = [r.with_token_ids(i) for r, i in zip(requests, ids)]
        return split(planned(tokenized, forecast), replicas, block_size, self.prefix_order)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
