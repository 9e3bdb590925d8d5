"""A stand-in engine for benchmarking the driver only: never the default, never for results.

    from benchmarks.standin_engine import standin_engine
    run_dag_file(..., engine_factory=standin_engine)

`standin_engine(config)` has the signature of `start_vllm_engine`: it starts the real
worker process (`ProcessEngine`) with `StandinStepper` in place of vLLM, so requests and
results cross the same process boundary, queues and pickling as in a real run. The
stepper answers every request it holds in one step, at once, with a short deterministic
text, so whatever time a run takes is the driver's (and the boundary's).

Invariant: the answer to a request depends on the request alone (its prompt, max_tokens
and n), never on the order, batch or engine it arrived in, so an interrupted and resumed
run must produce exactly the outputs of an uninterrupted one.
"""

from __future__ import annotations

import time

from batchllm.core.requests import EngineRequest, EngineResult, FinishReason
from batchllm.engines.process_engine import ProcessEngine
from batchllm.engines.protocol import EngineConfig, StepRecord, WorkerReady

BLOCK_SIZE_TOKENS = 16
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 8192
MAX_MODEL_LEN = 4096
KV_CAPACITY_TOKENS = 1_000_000
CHARS_PER_TOKEN = 4  # prompt tokens of a request sent without token ids
ANSWER_WORDS = 3  # the answer repeats the prompt's last words


def standin_text(prompt: str, max_tokens: int) -> tuple[str, FinishReason]:
    """The answer to `prompt` ("ok" + its last three words, one token a word, cut at
    `max_tokens`) and its finish reason."""
    words = ["ok", *prompt.split()[-ANSWER_WORDS:]]
    if len(words) > max_tokens:
        return " ".join(words[:max_tokens]), FinishReason.LENGTH
    return " ".join(words), FinishReason.STOP


def prompt_tokens(request: EngineRequest) -> int:
    token_ids = getattr(request, "prompt_token_ids", None)
    return len(token_ids) if token_ids is not None else len(request.prompt) // CHARS_PER_TOKEN


class StandinStepper:
    """The stepper protocol of `worker.serve`: `ready`, `add`, `has_work`, `step`."""

    def __init__(self, config: EngineConfig):
        self.ready = WorkerReady(load_time_s=0.0, kv_capacity_tokens=KV_CAPACITY_TOKENS, block_size_tokens=BLOCK_SIZE_TOKENS,
                                 max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                                 max_model_len=MAX_MODEL_LEN, engine_version="standin")
        self._queue: list[EngineRequest] = []

    def add(self, request: EngineRequest) -> EngineResult | None:
        """Accept the request, or refuse one that does not fit the context (as vLLM does)."""
        tokens = prompt_tokens(request)
        if tokens >= MAX_MODEL_LEN:
            return EngineResult(request.request_id, ("",) * request.n, tokens, 0,
                                FinishReason.ERROR, f"prompt of {tokens} tokens does not fit max_model_len {MAX_MODEL_LEN}")
        self._queue.append(request)
        return None

    def has_work(self) -> bool:
        return bool(self._queue)

    def step(self) -> tuple[list[EngineResult], StepRecord]:
        started = time.perf_counter()
        batch, self._queue = self._queue, []
        results, total_prompt = [], 0
        for request in batch:
            text, reason = standin_text(request.prompt, request.max_tokens)
            tokens = prompt_tokens(request)
            total_prompt += tokens
            results.append(EngineResult(request.request_id, (text,) * request.n, tokens,
                                        len(text.split()) * request.n, reason))
        record = StepRecord(wall_s=time.perf_counter() - started, prefill_tokens=total_prompt, prefill_requests=len(batch),
                            decode_seqs=0, decode_context=0, prefix_queries=0, prefix_hits=0)
        return results, record


class _StandinStepperFactory:
    """Picklable: the worker process builds its stepper from it."""

    def __call__(self, config: EngineConfig) -> StandinStepper:
        return StandinStepper(config)


def standin_engine(config: EngineConfig) -> ProcessEngine:
    """Same signature as `start_vllm_engine`; a real worker process, no model loaded."""
    return ProcessEngine(config, _StandinStepperFactory())
