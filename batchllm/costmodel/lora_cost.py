"""What serving LoRA adapters costs an engine's steps, before a run of this model with adapters
has measured it on this machine.

An engine started with LoRA on computes, in every step, each adapted layer's low-rank product
for the requests of every adapter in the batch (vLLM's punica kernels; on CPUs their torch
fallbacks). The cost model keeps what it learns of such an engine apart from the base's (the
local store keys it by `LORA_SETTING`: a run with adapters teaches neither the base's profile
nor is taught by it), and until it has learnt one, it takes the base's profile with the LoRA ops'
own time added as adapter requests' steps were measured to take it: mostly a fixed time a step,
a little per decoding sequence and per prompt token. A run's calibration replaces the prior with
what its own steps take, and the store keeps that for the next plan.
"""

from __future__ import annotations

from dataclasses import replace

from batchllm.costmodel.calibration.store import LORA_REVISION, LORA_SETTING
from batchllm.costmodel.latency import StepFeatures, StepLatencyModel
from batchllm.costmodel.profile import Profile

__all__ = ["LORA_DECODE_SEQ_FACTOR_PRIOR", "LORA_PREFILL_FACTOR_PRIOR", "LORA_REVISION", "LORA_SETTING", "LORA_STEP_OVERHEAD_PRIOR",
           "with_adapters"]

# What adapter requests' steps took over the base's on one engine (smollm2-135m, three adapters of rank 8 on q_proj
# and v_proj, cpu:2, bfloat16, AVX-512 host, 2026-11-29, with the LoRA ops batchllm's engines run on CPUs,
# engines/cpu_lora_ops.py). A decode step took 22.3, 25.5 and 29.6 ms more than the base's at 1, 8 and 48 sequences
# (the base's: 26.6, 30.3, 77.2 ms; benchmarks/lora_step_cost.py's sweep another time: +21.6, +31.8, +26.7 ms over
# 23.6, 28.3, 71.8): the ops' own calls, a fixed number a step whatever its batch, and little per sequence.
# A prior of one factor on the decode terms (1.30x, right at 48) made a pilot's small batches read 1.8x and
# carried that level to the run's large ones: its rest estimated 10-13 % long (benchmarks/adapters.py).
# So: every step the base's one-sequence decode step x LORA_STEP_OVERHEAD_PRIOR longer, each decoding sequence
# LORA_DECODE_SEQ_FACTOR_PRIOR x, prefill terms LORA_PREFILL_FACTOR_PRIOR x (600-token prompts: 1.04x,
# benchmarks/lora_step_cost.py). Adapters on more modules cost more (all seven linear ones: about twice the calls);
# GPUs (punica's kernels) far less; a run learns its own.
LORA_STEP_OVERHEAD_PRIOR = 0.84
LORA_DECODE_SEQ_FACTOR_PRIOR = 1.14
LORA_PREFILL_FACTOR_PRIOR = 1.04


def with_adapters(profile: Profile, step_overhead: float = LORA_STEP_OVERHEAD_PRIOR, decode_seq: float = LORA_DECODE_SEQ_FACTOR_PRIOR,
                  prefill: float = LORA_PREFILL_FACTOR_PRIOR) -> Profile:
    """The base's profile as the prior of an engine that serves adapters: in every shape, each step
    `step_overhead` x the base's one-sequence decode step longer, the per-sequence decode term
    `decode_seq` x, the prefill terms `prefill` x (every request taken for an adapter's)."""
    def adapted(latency: StepLatencyModel) -> StepLatencyModel:
        one_sequence_s = latency.step_s(StepFeatures(0, 0, 1, 0))
        return replace(latency, base_s=latency.base_s + step_overhead * one_sequence_s,
                       per_prefill_token_s=latency.per_prefill_token_s * prefill, per_attention_unit_s=latency.per_attention_unit_s * prefill,
                       per_decode_seq_s=latency.per_decode_seq_s * decode_seq)

    shapes = {key: replace(shape, latency=adapted(shape.latency)) for key, shape in profile.shapes.items()}
    return replace(profile, shapes=shapes, engine={**profile.engine, LORA_SETTING: LORA_REVISION})
