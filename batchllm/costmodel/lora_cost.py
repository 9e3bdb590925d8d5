"""What serving LoRA adapters costs an engine's steps, before a run of this model with adapters
has measured it on this machine.

An engine started with LoRA on computes, in every step, each adapted layer's low-rank product
for the requests of every adapter in the batch (vLLM's punica kernels; on CPUs their torch
fallbacks). The cost model keeps what it learns of such an engine apart from the base's (the
local store keys it by `LORA_SETTING`: a run with adapters teaches neither the base's profile
nor is taught by it), and until it has learnt one, it takes the base's profile with its steps'
prefill terms and decode terms as many times longer as adapter requests' were measured to be. A run's calibration replaces the prior with what
its own steps take, and the store keeps that for the next plan.
"""

from __future__ import annotations

from dataclasses import replace

from batchllm.costmodel.calibration.store import LORA_REVISION, LORA_SETTING
from batchllm.costmodel.latency import StepLatencyModel
from batchllm.costmodel.profile import Profile

__all__ = ["LORA_DECODE_FACTOR_PRIOR", "LORA_PREFILL_FACTOR_PRIOR", "LORA_REVISION", "LORA_SETTING", "with_adapters"]

# Adapter requests' steps over the base's on one engine, measured by benchmarks/lora_step_cost.py (smollm2-135m,
# rank 8 on q_proj and v_proj, cpu:2, bfloat16 on an AVX-512 host, 2026-11-29, with the LoRA ops batchllm's engines
# run on CPUs (engines/cpu_lora_ops.py, which also skip the modules no held adapter targets): decode 1.30x, prefill
# 1.04x; the base's own requests on a LoRA engine 1.02x. vLLM's own CPU ops there: 3.38x and 5.16x; on an AVX2-only
# host 2.00x and 3.28x). Adapters on every linear module cost more (no module skipped: 2.21x decode, 1.33x prefill
# before the skip); on GPUs (punica's kernels) far less; a run learns its own.
LORA_DECODE_FACTOR_PRIOR = 1.30
LORA_PREFILL_FACTOR_PRIOR = 1.04


def with_adapters(profile: Profile, decode: float = LORA_DECODE_FACTOR_PRIOR, prefill: float = LORA_PREFILL_FACTOR_PRIOR) -> Profile:
    """The base's profile as the prior of an engine that serves adapters: every shape's prefill terms
    `prefill` x, its per-step and decode terms `decode` x (every request taken for an adapter's)."""
    shapes = {key: replace(shape, latency=StepLatencyModel(
        base_s=shape.latency.base_s * decode, per_prefill_token_s=shape.latency.per_prefill_token_s * prefill,
        per_attention_unit_s=shape.latency.per_attention_unit_s * prefill, per_decode_seq_s=shape.latency.per_decode_seq_s * decode,
        per_context_token_s=shape.latency.per_context_token_s * decode)) for key, shape in profile.shapes.items()}
    return replace(profile, shapes=shapes, engine={**profile.engine, LORA_SETTING: LORA_REVISION})
