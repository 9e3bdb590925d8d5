"""Tokens of a text not tokenized yet, from its characters: the one estimate the data
summary (before a run), the planner and the runtime's replica balancing share."""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    import numpy as np

CHARS_PER_TOKEN = 4  # estimate for text not tokenized yet


@overload
def estimated_tokens(chars: float) -> float: ...
@overload
def estimated_tokens(chars: np.ndarray) -> np.ndarray: ...


def estimated_tokens(chars: float | np.ndarray) -> float | np.ndarray:
    """Tokens of a text from its length in characters (a number or a numpy array)."""
    return chars / CHARS_PER_TOKEN
