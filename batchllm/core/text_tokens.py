"""Tokens of a text not tokenized yet, from its characters: the one estimate the data
summary (before a run), the planner and the runtime's replica balancing share."""

from __future__ import annotations

CHARS_PER_TOKEN = 4  # estimate for text not tokenized yet


def estimated_tokens(chars):
    """Tokens of a text from its length in characters (a number or a numpy array)."""
    return chars / CHARS_PER_TOKEN
