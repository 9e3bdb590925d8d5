"""Plain records crossing the engine boundary (picklable; no vLLM types).

A request and its result are NamedTuples: each is built, pickled and unpickled a few
times per (row, step); as NamedTuples they are built 1.4-2.6x and unpickled 3.5-4.5x faster
than as frozen dataclasses (measured on this project's records).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from batchllm.dag.model import OutputConstraint
from batchllm.engines.devices import Replica


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


ERROR_PREFIX = "error: "  # a finish reason saying the request could not run, and why


def error_reason(why: str) -> str:
    """The finish reason of a request the engine could not run."""
    return ERROR_PREFIX + why


def is_error(finish_reason: str) -> bool:
    return finish_reason.startswith(ERROR_PREFIX)


def error_of(finish_reason: str) -> str:
    """Why the request could not run (an error finish reason without its prefix)."""
    return finish_reason[len(ERROR_PREFIX):].strip()


class EngineResult(NamedTuple):
    request_id: RequestId
    texts: tuple[str, ...]  # n completions; texts[0] is the main one
    num_prompt_tokens: int
    num_output_tokens: int  # summed over the n completions
    finish_reason: str  # "stop" | "length" | error_reason(...) (the request could not run)


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to start one engine replica on its devices."""

    model: str  # a local directory or hub id
    replica: Replica
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool = True
    dtype: str | None = None  # None: the model's own (bfloat16 for the embedded model)
    log_path: str | None = None  # where the engine's own logs go

    def sharing_key(self) -> tuple:
        """Two configs with the same key can be served by one running engine."""
        return (self.model, self.replica, self.max_model_len, self.max_num_seqs, self.kv_cache_memory_bytes, self.enforce_eager, self.dtype)


@dataclass(frozen=True)
class StepRecord:
    """One engine iteration as measured: what it computed and how long it took."""

    wall_s: float
    prefill_tokens: int  # prompt tokens computed (chunks of prefills)
    prefill_requests: int
    decode_seqs: int  # sequences that decoded one token
    decode_context: int  # total context (prompt + output so far) of those sequences
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, served from the cache


# Worker -> driver messages.
@dataclass(frozen=True)
class WorkerReady:
    load_time_s: float
    kv_capacity_tokens: int
    block_size_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    engine_version: str


@dataclass(frozen=True)
class WorkerResults:
    results: tuple[EngineResult, ...]
    steps: tuple[StepRecord, ...] = ()


@dataclass(frozen=True)
class WorkerFailed:
    error: str


# Driver -> worker messages.
@dataclass(frozen=True)
class SubmitRequests:
    requests: tuple[EngineRequest, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class StopWorker:
    pass
