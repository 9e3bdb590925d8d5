"""A stand-in engine that takes an engine's time: for benchmarking how the driver splits
and orders work over replicas, never the default, never for results.

    from benchmarks.paced_engine import PacedEngines
    run_dag_file(..., engine_factory=PacedEngines(lengths, latency))

Like `standin_engine`, it runs the real worker process (`ProcessEngine`) with a stepper in
place of vLLM, so requests and results cross the real process boundary. Unlike it, the
stepper batches continuously as vLLM does: up to `MAX_NUM_SEQS` requests run at once, each
decodes one token a step, a waiting request is admitted when one ends, and every step
sleeps the time `latency` (a step-latency model, as profiles hold) gives for what it
computed. A request's answer is as long as `lengths` says for its prompt (the real
lengths of a real model's answers), so a replica ends when its longest answers do.

Invariant: a request's answer depends on the request alone (its prompt), never on the
batch or replica it arrived in.
"""

from __future__ import annotations

import time
from collections import deque

from batchllm.core.requests import EngineRequest, EngineResult, FinishReason
from batchllm.costmodel.latency import StepFeatures, StepLatencyModel
from batchllm.engines.process_engine import ProcessEngine
from batchllm.engines.protocol import EngineConfig, StepRecord, WorkerReady

MAX_NUM_SEQS = 32
BLOCK_SIZE_TOKENS = 16
MAX_MODEL_LEN = 8192
ENGINE_VERSION = "standin"  # the calibration learns nothing from it for the store


def prompt_key(prompt: str) -> str:
    """The part of a prompt the lengths are keyed by: without a trailing ` #<row>` copy mark."""
    head, mark, tail = prompt.rpartition(" #")
    return head if mark and tail.isdigit() else prompt


class PacedStepper:
    def __init__(self, lengths: dict[str, int], latency: StepLatencyModel):
        self.ready = WorkerReady(load_time_s=0.0, kv_capacity_tokens=10_000_000, block_size_tokens=BLOCK_SIZE_TOKENS,
                                 max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=8192, max_model_len=MAX_MODEL_LEN,
                                 engine_version=ENGINE_VERSION)
        self.lengths, self.latency = lengths, latency
        self._waiting: deque[EngineRequest] = deque()
        self._running: dict[object, list] = {}  # request id -> [request, prompt tokens, target, generated]

    def add(self, request: EngineRequest) -> EngineResult | None:
        self._waiting.append(request)
        return None

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> tuple[list[EngineResult], StepRecord]:
        prefill = 0
        admitted = 0
        while self._waiting and len(self._running) < MAX_NUM_SEQS:
            request = self._waiting.popleft()
            tokens = len(request.prompt_token_ids) if request.prompt_token_ids is not None else len(request.prompt) // 4
            target = min(self.lengths.get(prompt_key(request.prompt), 1), request.max_tokens)
            self._running[request.request_id] = [request, tokens, max(target, 1), 0]
            prefill += tokens
            admitted += 1
        decoding = [entry for entry in self._running.values() if entry[3] > 0 or admitted == 0]
        context = sum(entry[1] + entry[3] for entry in decoding)
        wall_s = self.latency.step_s(StepFeatures(float(prefill), float(prefill) ** 2 / max(admitted, 1), float(len(self._running)),
                                                  float(context)))
        time.sleep(wall_s)
        results = []
        for request_id, entry in list(self._running.items()):
            entry[3] += 1
            request, tokens, target, generated = entry
            if generated >= target:
                del self._running[request_id]
                reason = FinishReason.LENGTH if target >= request.max_tokens else FinishReason.STOP
                results.append(EngineResult(request_id, ("w " * generated,) * request.n, tokens, generated * request.n, reason))
        record = StepRecord(wall_s=wall_s, prefill_tokens=prefill, prefill_requests=admitted, decode_seqs=len(self._running),
                            decode_context=context, prefix_queries=0, prefix_hits=0)
        return results, record


class _PacedStepperFactory:
    """Picklable: the worker process builds its stepper from it."""

    def __init__(self, lengths: dict[str, int], latency: StepLatencyModel):
        self.lengths, self.latency = lengths, latency

    def __call__(self, config: EngineConfig) -> PacedStepper:
        return PacedStepper(self.lengths, self.latency)


class PacedEngines:
    """An engine factory with the signature of `start_vllm_engine`."""

    def __init__(self, lengths: dict[str, int], latency: StepLatencyModel):
        self._factory = _PacedStepperFactory(lengths, latency)

    def __call__(self, config: EngineConfig) -> ProcessEngine:
        return ProcessEngine(config, self._factory)
