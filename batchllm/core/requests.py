"""A request to an engine and its result: plain records that cross the engine boundary
(picklable; no vLLM types).

A request and its result are NamedTuples: each is built, pickled and unpickled a few
times per (row, step); as NamedTuples they are built 1.4-2.6x and unpickled 3.5-4.5x faster
than as frozen dataclasses (measured on this project's records).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

from batchllm.core.images import ImageSource
from batchllm.core.output_constraint import OutputConstraint
from batchllm.core.sampling import DEFAULT_SAMPLING, SamplingSpec

if TYPE_CHECKING:
    import numpy as np

RequestId = int | str  # opaque to engines, which give it back with the result (the runtime's: see runtime/ledger.py)


Message = tuple[str, str]  # (role, content) of a chat message: system, user or assistant


class EngineRequest(NamedTuple):
    request_id: RequestId
    prompt: str  # the user message when `chat`, else the raw completion prompt ("" when `messages` holds the chat)
    system: str | None = None
    chat: bool = True
    sampling: SamplingSpec = DEFAULT_SAMPLING  # one object shared by a node's requests
    prompt_token_ids: tuple[int, ...] | None = None  # the prompt as the model's tokenizer gives it (chat template applied); None: the engine tokenizes
    output: OutputConstraint | None = None  # structured output the engine enforces
    messages: tuple[Message, ...] | None = None  # a whole conversation (then `prompt` and `system` are unused)
    pair: str | None = None  # a score request's second text (`prompt` is its first): the result is their vectors' cosine
    adapter: str | None = None  # a LoRA adapter the request runs with, on the model as its base: its directory (on a server: its name there)
    images: tuple[ImageSource, ...] = ()  # images before the user message's text (see core.images); a vision-language model's

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def n(self) -> int:
        return self.sampling.n

    def with_token_ids(self, token_ids: Sequence[int]) -> EngineRequest:
        """This request with its prompt's token ids (positional: `_replace` costs twice as much)."""
        return EngineRequest(self.request_id, self.prompt, self.system, self.chat, self.sampling, tuple(token_ids), self.output,
                             self.messages, self.pair, self.adapter, self.images)

    def chat_messages(self) -> list[dict[str, str]]:
        """The chat as the model's chat template takes it (its images aside: see `content_parts`)."""
        if self.messages is not None:
            return [{"role": role, "content": content} for role, content in self.messages]
        return ([{"role": "system", "content": self.system}] if self.system else []) + [{"role": "user", "content": self.prompt}]

    def content_parts(self, image_part: Callable[[int], dict]) -> list[dict]:
        """The chat with the user message as OpenAI content parts: its images (`image_part(k)` for
        the k-th, from 1), then its text."""
        messages: list[dict] = list(self.chat_messages())
        parts = [image_part(k) for k in range(1, len(self.images) + 1)] + [{"type": "text", "text": self.prompt}]
        messages[-1] = {"role": "user", "content": parts}
        return messages


class ModelTask(str, Enum):
    """What a node asks of its model: text, one vector a row (a pooling model's), one score a
    row (the cosine of a pooling model's vectors of two texts, as vLLM's score API gives for an
    embedding model), or a label a row with every label's probability (a sequence-classification
    model's)."""

    GENERATE = "generate"
    EMBED = "embed"
    SCORE = "score"
    CLASSIFY = "classify"

    @property
    def verb(self) -> str:
        """What a node of this task does, in a sentence: `node 'x' embeds`."""
        return "classifies" if self is ModelTask.CLASSIFY else f"{self.value}s"

    @property
    def pools(self) -> bool:
        """The model runs as a pooling model: prefill only, one vector a text."""
        return self is not ModelTask.GENERATE


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


class TokenLogprob(NamedTuple):
    """One output token: its text, its log probability, and the most likely tokens there."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()  # (token, logprob), most likely first


class EngineResult(NamedTuple):
    request_id: RequestId
    texts: tuple[str, ...]  # n completions; texts[0] is the main one
    num_prompt_tokens: int
    num_output_tokens: int  # summed over the n completions
    finish_reason: FinishReason
    error: str | None = None  # why it could not run (finish_reason ERROR)
    logprobs: tuple[TokenLogprob, ...] | None = None  # of texts[0], token by token, when the request asked for them
    vector: np.ndarray | None = None  # an embedding request's pooled vector (float32; texts are empty then)
    score: float | None = None  # a score request's (texts are empty then)

    @classmethod
    def failed(cls, request_id: RequestId, num_prompt_tokens: int, why: str) -> EngineResult:
        """The result of a request that could not run."""
        return cls(request_id, ("",), num_prompt_tokens, 0, FinishReason.ERROR, why)

    @property
    def is_error(self) -> bool:
        return self.finish_reason is FinishReason.ERROR

    def finish_text(self) -> str:
        return finish_text(self.finish_reason, self.error)
