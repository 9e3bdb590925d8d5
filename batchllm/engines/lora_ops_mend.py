"""A mend for vLLM's CPU LoRA ops, applied in the engine's process before the engine starts.

vLLM's PyTorch LoRA ops (`vllm.lora.ops.torch_ops`, what its CPU platform runs) take each token's
adapter as `weights[index]`, where index -1 marks a token of no adapter (the base model's). In
Python, -1 is the last slot: a base request batched beside adapter requests runs with whichever
adapter sits in the last slot, and gives that adapter's tokens, without an error (vLLM 0.32; vLLM
pull request 48421, open). The GPU kernels skip such tokens.

The mend wraps the three ops every other one calls (`bgmv_shrink`, `bgmv_expand`,
`bgmv_expand_slice`): a token of no adapter gathers slot 0 and gets its output rows back as they
were before the op, so its result is the base model's, as on a GPU; the other tokens' results
are the op's own, bit for bit. It is applied only where the installed ops show the fault
(`ops_apply_the_last_adapter_to_base_tokens`), so a vLLM that fixed it runs unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

MENDED_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")  # (inputs, weights, output, indices, ...)


def ops_apply_the_last_adapter_to_base_tokens() -> bool:
    """One token of no adapter (index -1) beside two slots of ones: does the installed shrink op give it a delta?"""
    import torch
    from vllm.lora.ops.torch_ops import lora_ops

    output = torch.zeros(1, 1)
    lora_ops.bgmv_shrink(torch.ones(1, 2), torch.ones(2, 1, 2), output, torch.tensor([-1]), 1.0)
    return bool(output.abs().sum() > 0)


def skip_base_tokens(op: Callable[..., Any]) -> Callable[..., Any]:
    """`op` over (inputs, weights, output, indices, ...) with the rows of tokens of index < 0 left as they were."""

    @functools.wraps(op)
    def mended(inputs, weights, output, indices, *args, **kwargs):
        base = indices < 0
        if not bool(base.any()):
            return op(inputs, weights, output, indices, *args, **kwargs)
        rows = base.nonzero().flatten()
        rows = rows[rows < output.shape[0]]
        kept = output[rows].clone()
        result = op(inputs, weights, output, indices.clamp(min=0), *args, **kwargs)
        output[rows] = kept
        return result

    mended.mends_base_tokens = True  # type: ignore[attr-defined]
    return mended


def mend_cpu_lora_ops() -> bool:
    """Mend the installed ops where they show the fault, in every module that holds them by name
    (the ops' module, its package, the CPU punica wrapper); True when mended (now or before)."""
    import importlib

    from vllm.lora.ops.torch_ops import lora_ops

    if getattr(lora_ops.bgmv_shrink, "mends_base_tokens", False):
        return True
    if not ops_apply_the_last_adapter_to_base_tokens():
        return False
    holders = [lora_ops] + [importlib.import_module(name) for name in ("vllm.lora.ops.torch_ops", "vllm.lora.punica_wrapper.punica_cpu")]
    for name in MENDED_OPS:
        mended = skip_base_tokens(getattr(lora_ops, name))
        for module in holders:
            if hasattr(module, name):
                setattr(module, name, mended)
    return True
