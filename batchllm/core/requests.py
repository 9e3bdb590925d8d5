"""A request to an engine and its result: plain records that cross the engine boundary
(picklable; no vLLM types).

A request and its result are NamedTuples: each is built, pickled and unpickled a few
times per (row, step); as NamedTuples they are built 1.4-2.6x and unpickled 3.5-4.5x faster
than as frozen dataclasses (measured on this project's records).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple

from batchllm.core.output_constraint import OutputConstraint

RequestId = int | str  # opaque to engines, which give it back with the result (the runtime's: see runtime/ledger.py)


class EngineRequest(NamedTuple):
    request_id: RequestId
    prompt: str  # the user message when `chat`, else the raw completion prompt
    system: str | None = None
    chat: bool = True
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    prompt_token_ids: tuple[int, ...] | None = None  # the prompt as the model's tokenizer gives it (chat template applied); None: the engine tokenizes
    output: OutputConstraint | None = None  # structured output the engine enforces

    def with_token_ids(self, token_ids: Sequence[int]) -> "EngineRequest":
        """This request with its prompt's token ids (positional: `_replace` costs twice as much)."""
        return EngineRequest(self.request_id, self.prompt, self.system, self.chat, self.max_tokens, self.temperature,
                             self.top_p, self.seed, self.n, tuple(token_ids), self.output)


class FinishReason(str, Enum):
    """Why a request's output ended."""

    STOP = "stop"  # the model ended it, or a stop condition did
    LENGTH = "length"  # cut at max_tokens
    ABORT = "abort"  # the engine aborted it
    REPETITION = "repetition"  # the engine stopped a repetitive pattern
    ERROR = "error"  # it could not run (the result's `error` says why)


ERROR_TEXT_PREFIX = "error: "  # the stored text of an ERROR: "error: <why>" (see finish_text)


def finish_text(reason: FinishReason, error: str | None = None) -> str:
    """How a finish reason is stored in a node's results (its `finish_reason` column):
    the reason's value ("stop", "length", ...), or "error: <why>"."""
    reason = FinishReason(reason)
    return ERROR_TEXT_PREFIX + (error or "") if reason is FinishReason.ERROR else reason.value


def parse_finish_text(text: str) -> tuple[FinishReason, str | None]:
    """The finish reason, and why it could not run, of a stored `finish_text`."""
    if text.startswith(ERROR_TEXT_PREFIX):
        return FinishReason.ERROR, text[len(ERROR_TEXT_PREFIX):].strip()
    return FinishReason(text), None


class EngineResult(NamedTuple):
    request_id: RequestId
    texts: tuple[str, ...]  # n completions; texts[0] is the main one
    num_prompt_tokens: int
    num_output_tokens: int  # summed over the n completions
    finish_reason: FinishReason
    error: str | None = None  # why it could not run (finish_reason ERROR)

    @classmethod
    def failed(cls, request_id: RequestId, num_prompt_tokens: int, why: str) -> "EngineResult":
        """The result of a request that could not run."""
        return cls(request_id, ("",), num_prompt_tokens, 0, FinishReason.ERROR, why)

    @property
    def is_error(self) -> bool:
        return self.finish_reason is FinishReason.ERROR

    def finish_text(self) -> str:
        return finish_text(self.finish_reason, self.error)
