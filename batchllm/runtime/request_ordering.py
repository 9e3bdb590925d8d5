"""Each batch of ready requests goes to its engine in prefix order (see
`batchllm.ordering.request_order`), so prompts sharing a prefix run while it is cached.

Token ids come from the model's own tokenizer, applied as the worker applies it; one
tokenizer per model directory per process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from batchllm.engines.protocol import EngineRequest
from batchllm.models.tokens import PromptTokenizer
from batchllm.ordering.request_order import order_requests

# (requests, model directory, engine block size) -> the same requests, reordered
RequestOrdering = Callable[[list[EngineRequest], str, int], list[EngineRequest]]


@functools.lru_cache(maxsize=8)
def _tokenizer(model_dir: str) -> PromptTokenizer:
    return PromptTokenizer(model_dir)


def prefix_ordering(requests: list[EngineRequest], model_dir: str, block_size: int) -> list[EngineRequest]:
    if len(requests) < 2:
        return requests
    tokenizer = _tokenizer(model_dir)
    order = order_requests([tokenizer.token_ids(r) for r in requests], block_size=block_size)
    return [requests[i] for i in order.replicas[0]]


def given_order(requests: list[EngineRequest], model_dir: str, block_size: int) -> list[EngineRequest]:
    return requests
