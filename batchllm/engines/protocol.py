"""Plain records of the engine layer (picklable; no vLLM types): how to start an engine,
what one of its steps measured, and the messages between driver and worker. Requests and
results are `batchllm.core.requests`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchllm.core.requests import EngineRequest, EngineResult, ModelTask
from batchllm.engines.devices import Replica

if TYPE_CHECKING:
    from batchllm.core.endpoint import Endpoint


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
    endpoint: Endpoint | None = None  # a server that already serves the model (its replica names no devices then)
    task: ModelTask = ModelTask.GENERATE  # EMBED, CLASSIFY: the engine runs the model as a pooling model (prefill only, one vector a request)
    # LoRA adapters on the model (its nodes with `adapter:`): how many the engine holds at once, and the largest rank;
    # the base's nodes and its adapters' share the engine (0 and None: no adapter)
    max_loras: int = 0
    max_lora_rank: int | None = None

    def sharing_key(self) -> tuple:
        """Two configs with the same key can be served by one running engine."""
        return (self.model, self.replica, self.max_model_len, self.max_num_seqs, self.kv_cache_memory_bytes, self.enforce_eager, self.dtype,
                self.endpoint, self.task, self.max_loras, self.max_lora_rank)


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
    cause: str  # one line: the exception's type and message
    traceback: str = ""

    @classmethod
    def of(cls, error: BaseException, traceback_text: str = "") -> WorkerFailed:
        return cls(exception_cause(error), traceback_text)


def exception_cause(error: BaseException) -> str:
    """An exception as one line: its type and message, without the advice lines some
    libraries append (pydantic's "For further information visit ...")."""
    details = getattr(error, "errors", None)  # pydantic's ValidationError: its messages, without the input it quotes
    if callable(details):
        try:
            return f"{type(error).__name__}: " + "; ".join(str(d["msg"]).removeprefix("Value error, ") for d in details())
        except (TypeError, KeyError):
            pass
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and "errors.pydantic.dev" not in line]
    return f"{type(error).__name__}: {' '.join(lines)}" if lines else type(error).__name__


# Driver -> worker messages.
@dataclass(frozen=True)
class SubmitRequests:
    requests: tuple[EngineRequest, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class StopWorker:
    pass


DriverMessage = SubmitRequests | StopWorker  # driver -> worker
WorkerMessage = WorkerReady | WorkerResults | WorkerFailed  # worker -> driver
