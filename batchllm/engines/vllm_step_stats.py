"""What vLLM's stat logger (its public hook) reports of each iteration, tallied for the step's
record: prompt tokens computed, requests prefilled, sequences decoded, prefix-cache lookups and hits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class IterationTally:
    """What vLLM's stat logger reported during the current step."""

    prefill_tokens: int = 0
    prefill_requests: int = 0
    decode_seqs: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0


def step_recorder(tally_holder: list[IterationTally]) -> type:
    """A StatLoggerBase class that adds each iteration's details to `tally_holder[0]`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepRecorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            if scheduler_stats is None:
                return
            tally = tally_holder[0]
            details = scheduler_stats.iteration_details
            if details is not None and not details.is_dummy:
                tally.prefill_tokens += details.num_ctx_tokens
                tally.prefill_requests += details.num_ctx_requests
                tally.decode_seqs += details.num_generation_requests
            cache = scheduler_stats.prefix_cache_stats
            if cache is not None:
                tally.prefix_queries += cache.queries
                tally.prefix_hits += cache.hits

        def log_engine_initialized(self) -> None:
            pass

    return StepRecorder
