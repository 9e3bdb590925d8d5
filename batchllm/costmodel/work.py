"""A request's work: the one measure the planner, the prefix order and the runtime's
replica balancing all use.

work = prompt tokens the prefix cache does not serve + the output tokens predicted for it
(its expected answer length cut at max_tokens, times n; with nothing predicted, the most
it may generate: max_tokens x n). Before a prompt is tokenized (the planner, before a
run), its tokens are estimated from its characters (`core.text_tokens`).
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

Tokens = TypeVar("Tokens", float, np.ndarray)


def request_work(prompt_tokens: Tokens, output_tokens: Tokens, cached_tokens: Tokens | int = 0) -> Tokens:
    """Scalars or numpy arrays alike; `output_tokens` for all of a request's n samples."""
    return prompt_tokens - cached_tokens + output_tokens
