"""A real vLLM engine driven one iteration at a time. Runs inside a worker process.

The engine core runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so one `step()`
is one scheduler iteration, and stopping the worker stops everything it started.
A generating engine streams text deltas; a pooling engine (an EMBED config) answers each
request in the step that computes its prompt, with the vector the model's pooling config
gives (pooled and normalised as its sentence-transformers files say). A score request (one
with a `pair`) is two pooling requests, its text and its pair, answered with their vectors'
cosine once both are computed: what vLLM's score API gives for an embedding model. A
classifying engine (a CLASSIFY config) answers each request with its labels' probabilities as
the vector and the likeliest label as the text (the labels of the model's config, `ModelKind`).
Each step is measured: its wall time, and from vLLM's own per-iteration details
(through a stat logger, vLLM's public hook) how many prompt tokens it computed, how
many sequences decoded, and the prefix cache's lookups and hits.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from batchllm.core.images import ImageUnreadable
from batchllm.core.requests import EngineRequest, EngineResult, FinishReason, ModelTask, RequestId, TokenLogprob
from batchllm.core.sampling import SamplingSpec
from batchllm.engines.cpu_lora_ops import use_stacked_cpu_lora_ops
from batchllm.engines.cpu_seeded_sampling import use_offset_free_generators
from batchllm.engines.protocol import EngineConfig, StepRecord, WorkerReady
from batchllm.engines.score_pairs import PAIR_HALF, ScorePairs
from batchllm.engines.vllm_request_params import read_images, sampling_params, token_logprobs
from batchllm.engines.vllm_step_stats import IterationTally, step_recorder
from batchllm.models.model_kind import ModelKind
from batchllm.models.tokens import PromptTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from vllm.lora.request import LoRARequest
    from vllm.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput


def configure_environment(config: EngineConfig) -> None:
    """Must run before vllm is imported: device binding and in-process engine core."""
    os.environ.update(config.replica.environment())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class _LiveRequest:
    request_id: RequestId  # as the driver gave it (vLLM is given its text)
    prompt_tokens: int
    pieces: list[list[str]]  # per completion: text deltas
    output_tokens: list[int]
    finish_reasons: list[str | None]
    logprobs: list[TokenLogprob] | None = None  # of the main completion, when asked for
    top_logprobs: int = 0
    decoding: bool = False
    scores: bool = False  # a score request (a pair of texts)

    @classmethod
    def new(cls, request_id: RequestId, prompt_tokens: int, sampling: SamplingSpec, scores: bool = False) -> _LiveRequest:
        n = sampling.n
        return cls(request_id, prompt_tokens, [[] for _ in range(n)], [0] * n, [None] * n,
                   [] if sampling.logprobs else None, sampling.top_logprobs, scores=scores)

    def context(self) -> int:
        return sum(self.prompt_tokens + tokens for tokens in self.output_tokens)


class VllmStepper:
    def __init__(self, config: EngineConfig):
        started = time.perf_counter()
        import vllm
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        options: dict[str, Any] = dict(model=config.model, seed=0, disable_log_stats=False, enforce_eager=config.enforce_eager,
                                       tensor_parallel_size=config.replica.tp, enable_logging_iteration_details=True)
        for key in ("max_model_len", "max_num_seqs", "kv_cache_memory_bytes", "dtype"):
            if getattr(config, key) is not None:
                options[key] = getattr(config, key)
        self._pooling = config.task.pools
        self._classify = config.task is ModelTask.CLASSIFY
        if self._pooling:
            options["runner"] = "pooling"
        if config.max_loras:  # the base's requests and its adapters' in one engine, batched together
            use_stacked_cpu_lora_ops()  # vLLM's CPU ops give a base request beside adapter ones an adapter, and run slowly
            options.update(enable_lora=True, max_loras=config.max_loras, max_cpu_loras=config.max_loras,
                           max_lora_rank=config.max_lora_rank)
        if config.replica.kind == "cpu":
            use_offset_free_generators()  # a seeded request's prompt split over steps would kill the engine (cpu_seeded_sampling.py)
        self._adapters: dict[str, Any] = {}  # adapter directory -> its LoRARequest (ids from 1, in order of first use)
        self._tally = [IterationTally()]
        self._engine = LLMEngine.from_engine_args(EngineArgs(**options), stat_loggers=[step_recorder(self._tally)])
        self._tokenizer = PromptTokenizer(config.model)
        vllm_config = self._engine.vllm_config
        kind = ModelKind.of(Path(config.model))
        self._labels = kind.labels if self._classify else ()
        self._image_tokens = kind.image_tokens or 1  # the plan's count; vLLM's own replaces it once the request runs
        self._model_dir, self._cross_tokenizer = config.model, None
        cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
        self.ready = WorkerReady(
            load_time_s=time.perf_counter() - started,
            kv_capacity_tokens=int(cache.num_gpu_blocks or 0) * int(cache.block_size),
            block_size_tokens=int(cache.block_size),
            max_num_seqs=int(scheduler.max_num_seqs),
            max_num_batched_tokens=int(scheduler.max_num_batched_tokens),
            max_model_len=int(vllm_config.model_config.max_model_len),
            engine_version=f"vllm {vllm.__version__}",
        )
        self._live: dict[str, _LiveRequest] = {}
        self._pairs = ScorePairs()
        self._decode_context = 0  # sum of context over decoding sequences

    def add(self, request: EngineRequest) -> EngineResult | None:
        """Queue a request; a request the engine refuses comes back at once as an error result."""
        from vllm.exceptions import VLLMError
        from vllm.inputs import TokensPrompt

        texts, params = self._engine_texts(request)
        image_tokens = len(request.images) * (self._image_tokens - 1)  # each image's placeholder expands to its tokens
        tokens = sum(len(t) for _, t in texts) + image_tokens
        longest = max(len(t) for _, t in texts) + image_tokens
        if longest > self.ready.max_model_len or (longest == self.ready.max_model_len and not self._pooling):
            return EngineResult.failed(request.request_id, tokens, f"prompt has {longest} tokens, the engine's max_model_len is "
                                                                   f"{self.ready.max_model_len}")
        try:
            images = read_images(request.images)
        except ImageUnreadable as unreadable:
            return EngineResult.failed(request.request_id, tokens, str(unreadable))
        added: list[str] = []
        try:
            adapter = self._adapter(request.adapter)
            for text_id, text_ids in texts:
                prompt = TokensPrompt(prompt_token_ids=text_ids)
                if images:
                    prompt["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
                self._engine.add_request(text_id, prompt, params, lora_request=adapter)
                added.append(text_id)
        except (VLLMError, ValueError) as exc:  # any other request vLLM refuses
            if added:
                self._engine.abort_request(added)
            return EngineResult.failed(request.request_id, tokens, str(exc))
        for text_id, text_ids in texts:
            self._live[text_id] = _LiveRequest.new(request.request_id, len(text_ids) + image_tokens, request.sampling,
                                                   scores=request.pair is not None)
        if request.pair is not None and not self._classify:
            self._pairs.submitted(request.request_id)
        return None

    def _engine_texts(self, request: EngineRequest) -> tuple[list[tuple[str, list[int]]], Any]:
        """What the engine computes for a request, as (engine id, token ids), and its parameters:
        its prompt; with a pair on an embedding model also the pair (two vectors, then their
        cosine); with a pair on a classifier (a cross-encoder) the two texts as one sequence, the
        pair's tokens marked as the second segment (what vLLM's score API sends such a model)."""
        if not self._pooling:
            return [(str(request.request_id), self._prompt_ids(request))], sampling_params(request)
        from vllm.pooling_params import PoolingParams

        if request.pair is not None and self._classify:
            encoded = self._pair_tokenizer()(text=request.prompt, text_pair=request.pair)
            types = list(encoded["token_type_ids"])
            params = PoolingParams(task="classify", extra_kwargs={"compressed_token_type_ids": types.index(1) if 1 in types else len(types)})
            return [(str(request.request_id), list(encoded["input_ids"]))], params
        texts = [(str(request.request_id), self._prompt_ids(request))]
        if request.pair is not None:
            texts.append((str(request.request_id) + PAIR_HALF, self._tokenizer.token_ids(EngineRequest(request.request_id, request.pair, chat=False))))
        return texts, PoolingParams(task="classify" if self._classify else "embed")

    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        return list(request.prompt_token_ids) if request.prompt_token_ids is not None else self._tokenizer.token_ids(request)

    def _pair_tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's own tokenizer (transformers'), for pairs of texts as a cross-encoder reads them."""
        if self._cross_tokenizer is None:
            from transformers import AutoTokenizer

            self._cross_tokenizer = AutoTokenizer.from_pretrained(self._model_dir)
        return self._cross_tokenizer

    def _adapter(self, path: str | None) -> LoRARequest | None:
        """The LoRARequest of an adapter directory (None: the base model), loaded into the engine at
        its first use, before its request is added: left to vLLM, it is read from disk inside the
        step that first runs it, and the cost model would take that load for step time."""
        if path is None:
            return None
        if path not in self._adapters:
            from vllm.lora.request import LoRARequest

            number = len(self._adapters) + 1
            adapter = LoRARequest(f"adapter-{number}", number, path)
            self._engine.add_lora(adapter)
            self._adapters[path] = adapter
        return self._adapters[path]

    def _pooled(self, output: PoolingRequestOutput, live: _LiveRequest) -> EngineResult | None:
        """A pooling request's answer from its finished output; None for a score pair's half while the other is not computed."""
        vector = cast("PoolingOutput", output.outputs).data.float().numpy()  # float32, whatever the engine's dtype
        if self._classify and live.scores:  # a cross-encoder's one value for the pair
            return EngineResult(live.request_id, ("",), live.prompt_tokens, 0, FinishReason.STOP, score=float(vector[0]))
        if self._classify:  # the probabilities, and the likeliest label as the text
            return EngineResult(live.request_id, (self._labels[int(vector.argmax())],), live.prompt_tokens, 0, FinishReason.STOP,
                                vector=vector)
        if not self._pairs.owns(output.request_id):
            return EngineResult(live.request_id, ("",), live.prompt_tokens, 0, FinishReason.STOP, vector=vector)
        return self._pairs.half_done(output.request_id, live.request_id, vector, live.prompt_tokens)

    def has_work(self) -> bool:
        return self._engine.has_unfinished_requests()

    def step(self) -> tuple[list[EngineResult], StepRecord]:
        self._tally[0] = IterationTally()
        context_before = self._decode_context
        started = time.perf_counter()
        outputs = self._engine.step()
        wall_s = time.perf_counter() - started
        finished = []
        for output in outputs:
            live = self._live[output.request_id]
            if self._pooling:  # answered whole in the step that computed the last of its prompt
                if output.finished:
                    del self._live[output.request_id]
                    if (pooled := self._pooled(output, live)) is not None:
                        finished.append(pooled)
                continue
            if not live.decoding and output.prompt_token_ids is not None:  # with images expanded: vLLM's own count
                live.prompt_tokens = len(output.prompt_token_ids)
            before = live.context() if live.decoding else 0
            for completion in cast("list[CompletionOutput]", output.outputs):  # a generating engine: no PoolingOutput
                if live.logprobs is not None and completion.index == 0 and completion.logprobs:
                    live.logprobs.extend(token_logprobs(completion.token_ids, completion.logprobs, live.top_logprobs))
                live.pieces[completion.index].append(completion.text)
                live.output_tokens[completion.index] += len(completion.token_ids)
                if completion.finish_reason is not None:
                    live.finish_reasons[completion.index] = str(completion.finish_reason)
            live.decoding = True
            if output.finished:
                del self._live[output.request_id]
                self._decode_context -= before
                reason = FinishReason(live.finish_reasons[0] or "stop")
                finished.append(EngineResult(
                    request_id=live.request_id,
                    texts=tuple("".join(p) for p in live.pieces),
                    num_prompt_tokens=live.prompt_tokens,
                    num_output_tokens=sum(live.output_tokens),
                    finish_reason=reason,
                    error="the engine failed the request" if reason is FinishReason.ERROR else None,
                    logprobs=None if live.logprobs is None else tuple(live.logprobs),
                ))
            else:
                self._decode_context += live.context() - before
        tally = self._tally[0]
        record = StepRecord(wall_s, tally.prefill_tokens, tally.prefill_requests, tally.decode_seqs,
                            context_before, tally.prefix_queries, tally.prefix_hits)
        return finished, record
