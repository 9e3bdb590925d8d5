"""Per-step latency of an engine replica: a linear model fit on measured steps.

A step's time is t = c0 + c_prefill * P + c_attn * A + c_seq * B + c_ctx * C, with
P prefill tokens, A prefill attention work (sum over chunks of chunk x context seen),
B decoding sequences and C their total context. The terms are SamuLLM's computation,
input-preparation and sampling parts regrouped by what they scale with; a step that
mixes prefill chunks and decodes (chunked prefill) is just a step with P > 0 and B > 0.
Coefficients are non-negative, so adding work never makes a step faster.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

from batchllm.costmodel.nnls import nnls_normal
from batchllm.engines.protocol import StepRecord

FEATURES = ("prefill_tokens", "prefill_attention", "decode_seqs", "decode_context")


class StepFeatures(NamedTuple):
    prefill_tokens: float
    prefill_attention: float
    decode_seqs: float
    decode_context: float


def step_features(step: StepRecord) -> StepFeatures:
    """A measured step's features; prefill attention is approximated as if its chunks were equal."""
    prefill = float(step.prefill_tokens)
    return StepFeatures(prefill, prefill * prefill / max(step.prefill_requests, 1), float(step.decode_seqs), float(step.decode_context))


@dataclass(frozen=True)
class StepLatencyModel:
    base_s: float
    per_prefill_token_s: float
    per_attention_unit_s: float
    per_decode_seq_s: float
    per_context_token_s: float

    def step_s(self, f: StepFeatures) -> float:
        return (self.base_s + self.per_prefill_token_s * f.prefill_tokens + self.per_attention_unit_s * f.prefill_attention
                + self.per_decode_seq_s * f.decode_seqs + self.per_context_token_s * f.decode_context)

    def decode_steps_within(self, seqs: int, context: float, budget_s: float) -> int:
        """How many whole pure-decode steps fit in `budget_s` (at least 0)."""
        a = self.per_context_token_s * seqs / 2
        b = self.base_s + self.per_decode_seq_s * seqs + self.per_context_token_s * context - a
        if a <= 0:
            return int(budget_s // b) if b > 0 else 1 << 40
        return int((-b + (b * b + 4 * a * budget_s) ** 0.5) / (2 * a))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def fit(cls, features: np.ndarray, seconds: np.ndarray) -> StepLatencyModel:
        """Non-negative least squares on relative error (a 0.1 s step counts as much as a
        10 s one), then once more without the steps the first fit misses by over 2x
        (a step that stalled, or whose work was miscounted)."""
        model, _ = cls.fit_robust(features, seconds)
        return model

    @classmethod
    def fit_robust(cls, features: np.ndarray, seconds: np.ndarray) -> tuple[StepLatencyModel, int]:
        """The fitted model and how many outlying steps the second pass left out."""
        design = np.column_stack([np.ones(len(features)), np.asarray(features, float)])
        seconds = np.asarray(seconds, float)
        keep = seconds > 0
        for _ in range(2):
            relative = design[keep] / seconds[keep, None]  # rows scaled so each step's relative error counts
            coefficients = nnls_normal(relative.T @ relative, relative.sum(axis=0))
            ratio = (design @ coefficients) / np.where(seconds > 0, seconds, np.inf)
            keep = (seconds > 0) & (ratio > 0.5) & (ratio < 2.0)
        return cls(*map(float, coefficients)), int((seconds > 0).sum() - keep.sum())
