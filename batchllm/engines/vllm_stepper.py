"""A real vLLM engine driven one iteration at a time. Runs inside a worker process.

The engine core runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so one `step()`
is one scheduler iteration, and stopping the worker stops everything it started.
"""

from __future__ import annotations

import os
import time
import zlib

from batchllm.engines.protocol import EngineConfig, EngineRequest, EngineResult, WorkerReady


def configure_environment(config: EngineConfig) -> None:
    """Must run before vllm is imported: device binding and in-process engine core."""
    os.environ.update(config.replica.environment())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def request_seed(seed: int, request_id: str) -> int:
    """A per-request seed: reproducible, and different for every request of a node."""
    return (seed * 1_000_003 + zlib.crc32(request_id.encode())) % (2**31)


class VllmStepper:
    def __init__(self, config: EngineConfig):
        started = time.perf_counter()
        from vllm import LLM

        options = dict(model=config.model, seed=0, disable_log_stats=False, enforce_eager=config.enforce_eager,
                       tensor_parallel_size=config.replica.tp)
        for key in ("max_model_len", "max_num_seqs", "kv_cache_memory_bytes"):
            if getattr(config, key) is not None:
                options[key] = getattr(config, key)
        self._llm = LLM(**options)
        self._engine = self._llm.llm_engine
        self._tokenizer = self._llm.get_tokenizer()
        cache = self._engine.vllm_config.cache_config
        self.ready = WorkerReady(
            load_time_s=time.perf_counter() - started,
            kv_capacity_tokens=int(cache.num_gpu_blocks or 0) * int(cache.block_size),
            block_size_tokens=int(cache.block_size),
        )
        self._prompt_tokens: dict[str, int] = {}

    def _token_ids(self, request: EngineRequest) -> list[int]:
        if not request.chat:
            return list(self._tokenizer.encode(request.prompt))
        messages = ([{"role": "system", "content": request.system}] if request.system else [])
        messages.append({"role": "user", "content": request.prompt})
        ids = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # a BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)

    def add(self, request: EngineRequest) -> EngineResult | None:
        """Queue a request; a request the engine refuses comes back at once as an error result."""
        from vllm import SamplingParams

        params = SamplingParams(
            n=request.n, max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
            seed=None if request.seed is None else request_seed(request.seed, request.request_id),
        )
        ids = self._token_ids(request)
        try:
            self._engine.add_request(request.request_id, {"prompt_token_ids": ids}, params)
        except ValueError as exc:  # e.g. prompt longer than max_model_len
            return EngineResult(request.request_id, ("",), len(ids), 0, f"error: {exc}")
        self._prompt_tokens[request.request_id] = len(ids)
        return None

    def has_work(self) -> bool:
        return self._engine.has_unfinished_requests()

    def step(self) -> list[EngineResult]:
        finished = []
        for output in self._engine.step():
            if not output.finished:
                continue
            completions = output.outputs
            finished.append(EngineResult(
                request_id=output.request_id,
                texts=tuple(c.text for c in completions),
                num_prompt_tokens=self._prompt_tokens.pop(output.request_id, len(output.prompt_token_ids or ())),
                num_output_tokens=sum(len(c.token_ids) for c in completions),
                finish_reason=str(completions[0].finish_reason),
            ))
        return finished

    def prefix_cache_counters(self) -> dict[str, int]:
        counters = {}
        for metric in self._llm.get_metrics():
            if metric.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
                counters[metric.name.removeprefix("vllm:")] = int(metric.value)
        return counters
