"""batchllm's LoRA ops for vLLM's CPU path, put in place in the engine's process before the engine starts.

vLLM's CPU platform runs LoRA through its PyTorch ops (`vllm.lora.ops.torch_ops`). The three
every other one calls (`bgmv_shrink`, `bgmv_expand`, `bgmv_expand_slice`) take each token's
adapter matrices as `weights[index]`, a copy of them per token of the step, and multiply token
by token. Two things follow (vLLM 0.32):

- Wrong answers. Index -1 marks a token of no adapter (the base model's); in Python -1 is the
  last slot, so a base request batched beside adapter requests runs with whichever adapter sits
  there, without an error (vLLM pull request 48421, open). The GPU kernels skip such tokens.
- Slow steps. The copies move tokens x rank x width numbers per module and layer where each
  adapter's matrices are rank x width: an adapter request's prefill cost 5.35x the base's and
  its decode 3.02x; with these ops 1.33x and 2.21x (benchmarks/results/lora-step-cost-2026-11-29-avx512.txt,
  AVX-512 host; in decode, what was left was mostly these ops' own small tensor calls, about 200 us
  a call and 14 calls a layer a step), and 1.04x and 1.30x with the skip below
  (lora-step-cost-2026-11-29-avx512-skipped-slices.txt).

These ops do the same sums in one matrix product a call, with every slot's matrices side by side
(slots x rank columns, a few dozen: `max_loras` slots), each token keeping its own slot's part,
and the rows of tokens of no adapter left as they were, as the GPU kernels leave them. A shape
the stacked form does not cover (an output of another row count than the tokens', where vLLM
broadcasts one row) goes to vLLM's own op, with the base tokens' rows still kept
(`skip_base_tokens`). The CPU punica wrapper's calls skip the modules (and slices of a merged
module) whose matrices are zeros in every slot (`AllZeros`): vLLM wraps every linear module
for LoRA, whichever the loaded adapters target.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

REPLACED_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")  # (inputs, weights, output, indices, ...)


def _stacked(weights: Any, dtype: Any) -> Any:
    """vLLM's stacked adapter matrices, (slots, out, in), from (slots, out, in) or (slots, 1, out, in)."""
    return (weights.squeeze(1) if weights.dim() == 4 else weights).to(dtype)


def _slot_of_each(indices: Any, width: int) -> Any:
    """Each token's slot (a token of no adapter: slot 0, its result discarded), shaped to gather or
    scatter `width` numbers a token along a (tokens, slots, width) tensor's slot dimension."""
    return indices.clamp(min=0).view(-1, 1, 1).expand(-1, 1, width)


def stacked_shrink(inputs: Any, weights: Any, output: Any, indices: Any, scaling: float = 1.0) -> None:
    """`bgmv_shrink`: output[t, :rank] = scaling * A[slot of t] @ inputs[t], for the tokens of an adapter.
    One product of the tokens with every slot's A (slots x rank columns: a few dozen), then each
    token's own slot's columns."""
    import torch

    matrices = _stacked(weights, output.dtype)
    slots, rank = matrices.shape[0], matrices.shape[1]
    every = (inputs.to(output.dtype) @ matrices.reshape(slots * rank, -1).T).view(-1, slots, rank)
    own = every.gather(1, _slot_of_each(indices, rank)).squeeze(1)
    output[:, :rank] = torch.where((indices >= 0).unsqueeze(1), scaling * own, output[:, :rank])


def _expanded(inputs: Any, weights: Any, indices: Any, dtype: Any) -> Any:
    """B[slot of t] @ inputs[t] for every token, 0 for a token of no adapter: each token's rank numbers put in
    its slot's block of a (tokens, slots x rank) row, zeros elsewhere, times every slot's B at once."""
    matrices = _stacked(weights, dtype)
    slots, width, rank = matrices.shape
    placed = inputs.new_zeros((inputs.shape[0], slots, rank), dtype=dtype)
    placed.scatter_(1, _slot_of_each(indices, rank), inputs[:, :rank].to(dtype).unsqueeze(1))
    placed *= (indices >= 0).view(-1, 1, 1)
    return placed.view(-1, slots * rank) @ matrices.permute(1, 0, 2).reshape(width, slots * rank).T


def _put(output: Any, columns: slice, delta: Any, indices: Any, add_inputs: bool) -> None:
    """output[:, columns] (+)= delta, the rows of tokens of no adapter left as they were (added: their delta is exactly 0)."""
    import torch

    if add_inputs:
        output[:, columns] += delta
    else:
        output[:, columns] = torch.where((indices >= 0).unsqueeze(1), delta, output[:, columns])


def stacked_expand(inputs: Any, weights: Any, output: Any, indices: Any, add_inputs: bool = True) -> None:
    """`bgmv_expand`: output[t, :width] (+)= B[slot of t] @ inputs[t], for the tokens of an adapter (the
    width the narrower of B's and the output's: the adapter and the model may pad differently)."""
    delta = _expanded(inputs, weights, indices, output.dtype)
    width = min(delta.shape[1], output.shape[1])
    _put(output, slice(0, width), delta[:, :width], indices, add_inputs)


def stacked_expand_slice(inputs: Any, weights: Any, output: Any, indices: Any, slice_offset: int, slice_size: int,
                         add_inputs: bool = True) -> None:
    """`bgmv_expand_slice`: output[t, offset:offset + size] (+)= B[slot of t] @ inputs[t], for the tokens of an adapter."""
    _put(output, slice(slice_offset, slice_offset + slice_size), _expanded(inputs, weights, indices, output.dtype), indices, add_inputs)


STACKED: dict[str, Callable[..., None]] = {"bgmv_shrink": stacked_shrink, "bgmv_expand": stacked_expand, "bgmv_expand_slice": stacked_expand_slice}


def skip_base_tokens(op: Callable[..., Any]) -> Callable[..., Any]:
    """`op` over (inputs, weights, output, indices, ...) with the rows of tokens of index < 0 left as they were."""

    @functools.wraps(op)
    def kept(inputs: Any, weights: Any, output: Any, indices: Any, *args: Any, **kwargs: Any) -> Any:
        base = indices < 0
        if not bool(base.any()):
            return op(inputs, weights, output, indices, *args, **kwargs)
        rows = base.nonzero().flatten()
        rows = rows[rows < output.shape[0]]
        before = output[rows].clone()
        result = op(inputs, weights, output, indices.clamp(min=0), *args, **kwargs)
        output[rows] = before
        return result

    return kept


def stacked_in_place_of(op: Callable[..., Any], stacked: Callable[..., None]) -> Callable[..., Any]:
    """`stacked` where the tokens, their indices and the output rows are as many; else vLLM's `op`, base rows kept."""
    fallback = skip_base_tokens(op)

    @functools.wraps(op)
    def chosen(inputs: Any, weights: Any, output: Any, indices: Any, *args: Any, **kwargs: Any) -> Any:
        if inputs.shape[0] == indices.shape[0] == output.shape[0]:
            return stacked(inputs, weights, output, indices, *args, **kwargs)
        return fallback(inputs, weights, output, indices, *args, **kwargs)

    chosen.batchllm_stacked = True  # type: ignore[attr-defined]  # a mark on the function object, read back by getattr
    return chosen


class AllZeros:
    """Whether a stacked adapter tensor holds zeros in every slot, looked at again only once it was written:
    vLLM writes a slot's matrices in place when it loads or drops an adapter, which moves the tensor's
    version counter. A module no held adapter targets has zeros in every slot: with adapters on q_proj
    and v_proj (PEFT's default on Llama-like models) 10 of the 14 ops calls of a layer's step
    (the qkv's k slice, o_proj, gate_up's two, down_proj) add nothing."""

    def __init__(self) -> None:
        self._read: dict[int, tuple[Any, int, bool]] = {}  # id -> (the tensor, kept so its id stays its own; its version; all zeros)

    def __call__(self, tensor: Any) -> bool:
        read = self._read.get(id(tensor))
        if read is None or read[1] != tensor._version:
            read = (tensor, tensor._version, not bool(tensor.any()))
            self._read[id(tensor)] = read
        return read[2]


def skipping_empty_slices(add_lora_linear: Callable[..., Any], all_zeros: AllZeros) -> Callable[..., Any]:
    """The punica wrapper's `add_lora_linear` (y[:, slice i] += x @ A_i @ B_i per token's slot) over only the
    slices whose A and B hold some adapter's numbers (the others add exactly 0), each as it does them: its
    float32 shrink buffer (or the caller's), then the expand into the slice's columns."""

    @functools.wraps(add_lora_linear)
    def kept(self: Any, y: Any, x: Any, lora_a_stacked: Any, lora_b_stacked: Any, scale: float, output_slices: tuple[int, ...], *,
             buffer: Any = None, **kwargs: Any) -> None:
        import torch

        for i in range(len(output_slices)):
            if all_zeros(lora_a_stacked[i]) or all_zeros(lora_b_stacked[i]):
                continue
            shrunk = buffer[i] if buffer is not None else torch.zeros((x.view(-1, x.shape[-1]).size(0), lora_b_stacked[i].size(-1)),
                                                                      dtype=torch.float32, device=x.device)
            self.add_shrink((shrunk,), x, (lora_a_stacked[i],), scale, **kwargs)
            self.add_expand(y, (shrunk,), (lora_b_stacked[i],), (output_slices[i],), offset_start=sum(output_slices[:i]),
                            add_inputs=True, **kwargs)
        return None

    return kept


def skipping_when_empty(add: Callable[..., Any], all_zeros: AllZeros, *weights_at: int) -> Callable[..., Any]:
    """A punica wrapper's `add_*` (y += x @ weights...), not called when one of the weights at argument
    positions `weights_at` (after self) is all zeros: it would add exactly 0."""

    @functools.wraps(add)
    def kept(self: Any, *args: Any, **kwargs: Any) -> Any:
        if any(all_zeros(args[k]) for k in weights_at):
            return None
        return add(self, *args, **kwargs)

    return kept


def use_stacked_cpu_lora_ops() -> bool:
    """On vLLM's CPU platform, put the stacked ops in place of vLLM's in every module that holds them by
    name (the ops' module, their package, the CPU punica wrapper), and the CPU punica wrapper's calls
    that skip modules no held adapter targets, once; True when they are in place."""
    import importlib

    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    from vllm.platforms import current_platform

    if getattr(lora_ops.bgmv_shrink, "batchllm_stacked", False):
        return True
    if not current_platform.is_cpu():
        return False
    holders = [lora_ops] + [importlib.import_module(name) for name in ("vllm.lora.ops.torch_ops", "vllm.lora.punica_wrapper.punica_cpu")]
    for name in REPLACED_OPS:
        chosen = stacked_in_place_of(getattr(lora_ops, name), STACKED[name])
        for module in holders:
            if hasattr(module, name):
                setattr(module, name, chosen)
    all_zeros = AllZeros()
    PunicaWrapperCPU.add_lora_linear = skipping_empty_slices(PunicaWrapperCPU.add_lora_linear, all_zeros)
    PunicaWrapperCPU.add_lora_logits = skipping_when_empty(PunicaWrapperCPU.add_lora_logits, all_zeros, 2, 3)
    PunicaWrapperCPU.add_lora_embedding = skipping_when_empty(PunicaWrapperCPU.add_lora_embedding, all_zeros, 2)
    return True
