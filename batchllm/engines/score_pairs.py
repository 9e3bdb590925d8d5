"""Score requests on a pooling engine: each is two pooling requests, its text (under the request's
id) and its pair (under the id and PAIR_HALF), answered once both are computed with their
vectors' cosine: what vLLM's score API gives for an embedding model (a bi-encoder).

Invariant: a score request is in `_first` from its two halves' submission until its result is
made; its value is None until one half is done, then that half's (vector, prompt tokens).
"""

from __future__ import annotations

import numpy as np

from batchllm.core.requests import EngineResult, FinishReason, RequestId

PAIR_HALF = "#pair"  # the engine's id of a score request's second text: the request's id and this


def cosine(first: np.ndarray, second: np.ndarray) -> float:
    """Two vectors' cosine similarity, as torch's `cosine_similarity` (which vLLM's score API uses) gives it."""
    a, b = np.asarray(first, np.float64), np.asarray(second, np.float64)
    return float(a @ b / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-8))


class ScorePairs:
    def __init__(self) -> None:
        self._first: dict[str, tuple[np.ndarray, int] | None] = {}

    def submitted(self, request_id: RequestId) -> None:
        self._first[str(request_id)] = None

    def owns(self, engine_id: str) -> bool:
        """Whether an engine request is a half of a score request."""
        return engine_id.removesuffix(PAIR_HALF) in self._first

    def half_done(self, engine_id: str, request_id: RequestId, vector: np.ndarray, prompt_tokens: int) -> EngineResult | None:
        """A half computed: None while the other is not, then the score request's result."""
        key = engine_id.removesuffix(PAIR_HALF)
        first = self._first[key]
        if first is None:
            self._first[key] = (vector, prompt_tokens)
            return None
        del self._first[key]
        return EngineResult(request_id, ("",), first[1] + prompt_tokens, 0, FinishReason.STOP, score=cosine(first[0], vector))
