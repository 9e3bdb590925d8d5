"""Rendered requests -> requests an engine can take at once: tokenized (so the engine
does not tokenize again), and split over a node's data-parallel replicas in prefix order
(see `batchllm.ordering.request_order`), so prompts sharing a prefix run while it is in
the prefix cache.

With the prefix order off, requests are split by work in the order given and the engine
tokenizes them. Tokenizing and ordering run in one background thread, off the driver's main loop (the
fast tokenizer releases the GIL); the main loop only submits a window and later takes
the finished result. One tokenizer per model directory, loaded in that thread too (its
first load, transformers import included, takes seconds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from batchllm.costmodel.work import estimated_tokens, request_work
from batchllm.core.requests import EngineRequest
from batchllm.models.tokens import PromptTokenizer
from batchllm.ordering.balance import balance
from batchllm.ordering.request_order import order_requests


@dataclass(frozen=True)
class PreparedWindow:
    replicas: list[list[EngineRequest]]  # per replica, in submission order, token ids filled in
    prompt_tokens: int
    ideal_cached_tokens: int  # what an unbounded prefix cache serves for this window in the best order
    mean_work: float  # of its requests (`work_of`), worked out here, off the driver's main loop


def work_of(request: EngineRequest) -> float:
    """A request's work (see costmodel.work): its prompt tokens once tokenized, else estimated."""
    if request.prompt_token_ids is not None:
        tokens = len(request.prompt_token_ids)
    else:
        tokens = estimated_tokens(len(request.prompt) + len(request.system or ""))
    return request_work(tokens, request.max_tokens, request.n)


def split(requests: Sequence[EngineRequest], replicas: int, block_size: int, prefix_order: bool) -> PreparedWindow:
    """Tokenized requests over `replicas` lists: in prefix order, or by work in the given order."""
    prompts = [r.prompt_token_ids or () for r in requests]
    tokens = sum(map(len, prompts))
    if not requests:
        return PreparedWindow([[] for _ in range(replicas)], 0, 0, 0.0)
    mean_work = sum(map(work_of, requests)) / len(requests)
    if prefix_order:
        order = order_requests(prompts, block_size=block_size, replicas=replicas,
                               extra_work=[r.max_tokens * r.n for r in requests])
        return PreparedWindow([[requests[i] for i in indices] for indices in order.replicas], tokens,
                              order.ideal_cached_tokens, mean_work)
    return PreparedWindow(_split_by_work(requests, replicas), tokens, 0, mean_work)


def _split_by_work(requests: Sequence[EngineRequest], parts: int) -> list[list[EngineRequest]]:
    """Each part keeps the given order (see `ordering.balance`)."""
    return [[requests[i] for i in indices.tolist()] for indices in balance([work_of(r) for r in requests], parts)]


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

    def submit(self, requests: list[EngineRequest], model_dir: str, block_size: int, replicas: int) -> Future:
        """Future of a PreparedWindow."""
        tokenizer = None
        if self.prefix_order:
            self.preload(model_dir)
            tokenizer = self._tokenizers[model_dir]
        return self._thread.submit(self._prepare, tokenizer, requests, block_size, replicas)

    def _prepare(self, tokenizer: Future | None, requests: list[EngineRequest], block_size: int, replicas: int) -> PreparedWindow:
        if tokenizer is None:  # no prefix order: the engine tokenizes
            return split(requests, replicas, block_size, prefix_order=False)
        ids = tokenizer.result().token_ids_many(requests)
        tokenized = [r.with_token_ids(i) for r, i in zip(requests, ids)]
        return split(tokenized, replicas, block_size, self.prefix_order)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
