"""What serving LoRA adapters costs an engine's steps, before a run of this model with adapters
has measured it on this machine.

An engine started with LoRA on computes, in every step, each adapted layer's low-rank product
for the requests of every adapter in the batch (vLLM's punica kernels; on CPUs their torch
fallbacks). The cost model keeps what it learns of such an engine apart from the base's (the
local store keys it by `LORA_SETTING`: a run with adapters teaches neither the base's profile
nor is taught by it), and until it has learnt one, it takes the base's profile with every
step `LORA_STEP_FACTOR_PRIOR` times as long. A run's calibration replaces the prior with what
its own steps take, and the store keeps that for the next plan.
"""

from __future__ import annotations

from dataclasses import replace

from batchllm.costmodel.calibration.latency import scaled
from batchllm.costmodel.calibration.store import LORA_SETTING
from batchllm.costmodel.profile import Profile

__all__ = ["LORA_SETTING", "LORA_STEP_FACTOR_PRIOR", "with_adapters"]
# Every step of an engine serving adapters, over the base's: benchmarks/lora_step_cost.py measures it
# (not yet run: 1.0, no cost, until it has).
LORA_STEP_FACTOR_PRIOR = 1.0


def with_adapters(profile: Profile, factor: float = LORA_STEP_FACTOR_PRIOR) -> Profile:
    """The base's profile as the prior of an engine that serves adapters: every shape's steps `factor` x."""
    shapes = {key: replace(shape, latency=scaled(shape.latency, factor)) for key, shape in profile.shapes.items()}
    return replace(profile, shapes=shapes, engine={**profile.engine, LORA_SETTING: True})
