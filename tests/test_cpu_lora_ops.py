"""batchllm's LoRA ops for vLLM's CPU path (batchllm/engines/cpu_lora_ops.py) against the installed
ops, with no engine: a token of no adapter (index -1) beside adapter tokens gets no adapter's delta,
the adapter tokens get what vLLM's op gives them (the same sums, by slot), and the ops are put in
place once, wherever vLLM holds them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.engine, pytest.mark.starts_no_engine]


def _case(dtype):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(6, 16, generator=generator).to(dtype)
    shrink_weights = torch.randn(3, 1, 4, 16, generator=generator).to(dtype)  # three adapter slots of rank 4 over a width of 16
    expand_weights = torch.randn(3, 1, 10, 4, generator=generator).to(dtype)
    indices = torch.tensor([0, -1, 2, -1, 0, 2])  # tokens of slot 0, of the base, of slot 2, ...; slot 1 unused
    return inputs, shrink_weights, expand_weights, indices


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["float32", "bfloat16"])
def test_a_base_token_gets_no_delta_and_adapter_tokens_get_the_sums_vllms_ops_give_them(dtype, tolerance):
    from vllm.lora.ops.torch_ops import lora_ops

    from batchllm.engines.cpu_lora_ops import stacked_expand, stacked_expand_slice, stacked_shrink

    inputs, shrink_weights, expand_weights, indices = _case(dtype)
    adapter_rows, base_rows = [0, 2, 4, 5], [1, 3]
    shrunk, theirs = torch.full((6, 4), 7.0), torch.zeros(6, 4)  # float32, as vLLM's shrink buffer
    stacked_shrink(inputs, shrink_weights, shrunk, indices, 0.5)
    lora_ops.bgmv_shrink(inputs, shrink_weights, theirs, indices, 0.5)
    assert torch.equal(shrunk[base_rows], torch.full((2, 4), 7.0))  # left as they were
    assert torch.allclose(shrunk[adapter_rows], theirs[adapter_rows], rtol=tolerance, atol=tolerance)
    assert not torch.allclose(shrunk[0], shrunk[2])  # each token its own slot's matrix
    before = torch.randn(6, 10).to(dtype)
    mine, theirs_expanded = before.clone(), before.clone()
    stacked_expand(shrunk, expand_weights, mine, indices, True)
    lora_ops.bgmv_expand(shrunk, expand_weights, theirs_expanded, indices, True)
    assert torch.equal(mine[base_rows], before[base_rows])
    assert torch.allclose(mine[adapter_rows].float(), theirs_expanded[adapter_rows].float(), rtol=tolerance, atol=tolerance * 10)
    sliced, theirs_sliced = torch.zeros(6, 14).to(dtype), torch.zeros(6, 14).to(dtype)
    stacked_expand_slice(shrunk, expand_weights, sliced, indices, 2, 10, True)
    lora_ops.bgmv_expand_slice(shrunk, expand_weights, theirs_sliced, indices, 2, 10, True)
    assert torch.equal(sliced[base_rows], torch.zeros(2, 14)) and torch.equal(sliced[:, :2], torch.zeros(6, 2))
    assert torch.allclose(sliced[adapter_rows].float(), theirs_sliced[adapter_rows].float(), rtol=tolerance, atol=tolerance * 10)


def test_tokens_all_of_one_adapter_and_a_shape_the_stacked_form_does_not_cover_get_vllms_sums():
    from vllm.lora.ops.torch_ops import lora_ops

    from batchllm.engines.cpu_lora_ops import stacked_in_place_of, stacked_shrink

    inputs, shrink_weights, _, _ = _case(torch.float32)
    one = torch.tensor([1] * 6)
    mine, theirs = torch.zeros(6, 4), torch.zeros(6, 4)
    stacked_in_place_of(lora_ops.bgmv_shrink, stacked_shrink)(inputs, shrink_weights, mine, one, 1.0)
    lora_ops.bgmv_shrink(inputs, shrink_weights, theirs, one, 1.0)
    assert torch.allclose(mine, theirs, atol=1e-5)
    calls = []
    stock = lambda *args: calls.append(args)  # noqa: E731  (vLLM's op, for a shape of one input row and six output rows)
    stacked_in_place_of(stock, stacked_shrink)(inputs[:1], shrink_weights, torch.zeros(6, 4), torch.tensor([-1]), 1.0)
    assert len(calls) == 1 and torch.equal(calls[0][3], torch.tensor([0]))  # its base token clamped to a slot, its row kept


def _base_token_gets_a_delta() -> bool:
    """One token of no adapter (index -1) beside two slots of ones: does the installed shrink op give it a delta?"""
    from vllm.lora.ops.torch_ops import lora_ops

    output = torch.zeros(1, 1)
    lora_ops.bgmv_shrink(torch.ones(1, 2), torch.ones(2, 1, 2), output, torch.tensor([-1]), 1.0)
    return bool(output.abs().sum() > 0)


def test_the_stacked_ops_are_put_in_place_once_wherever_vllm_holds_them_and_leave_no_fault():
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    from batchllm.engines.cpu_lora_ops import REPLACED_OPS, use_stacked_cpu_lora_ops

    originals = {name: getattr(lora_ops, name) for name in REPLACED_OPS}
    wrapper_calls = {name: getattr(punica_cpu.PunicaWrapperCPU, name) for name in ("add_lora_linear", "add_lora_logits", "add_lora_embedding")}
    try:
        assert use_stacked_cpu_lora_ops()  # these machines run vLLM's CPU platform
        assert not _base_token_gets_a_delta()
        assert all(getattr(punica_cpu, name) is getattr(lora_ops, name) is not originals[name] for name in REPLACED_OPS)
        assert use_stacked_cpu_lora_ops() and lora_ops.bgmv_shrink.__wrapped__ is originals["bgmv_shrink"]
    finally:
        import vllm.lora.ops.torch_ops as package

        for module in (lora_ops, package, punica_cpu):
            for name, op in originals.items():
                setattr(module, name, op)
        for name, call in wrapper_calls.items():
            setattr(punica_cpu.PunicaWrapperCPU, name, call)



def _decode_wrapper(indices):
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    wrapper = PunicaWrapperCPU(16, 4, "cpu")
    wrapper._token_lora_indices[: len(indices)] = indices
    wrapper.indices_len = [len(indices)] * 4  # a decode step (bgmv ops) over these tokens
    return wrapper


def test_slices_no_held_adapter_targets_are_skipped_and_the_sums_stay_vllms_until_a_slot_is_written():
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from batchllm.engines.cpu_lora_ops import AllZeros, skipping_empty_slices

    generator = torch.Generator().manual_seed(1)
    indices = torch.tensor([0, -1, 2, 1, 0, 2])
    a = tuple(torch.randn(3, 1, 4, 16, generator=generator) for _ in range(3))  # three slices (q, k, v), three slots of rank 4
    b = tuple(torch.randn(3, 1, 8, 4, generator=generator) for _ in range(3))
    a[1].zero_()  # no adapter targets the middle slice (k_proj)
    b[2][:, :, :, :] = 0  # nor, by its B, the last one
    x = torch.randn(6, 16, generator=generator)
    before = torch.randn(6, 24, generator=generator)
    stock, skipping = PunicaWrapperCPU.add_lora_linear, skipping_empty_slices(PunicaWrapperCPU.add_lora_linear, AllZeros())
    shrinks = []
    wrapper = _decode_wrapper(indices)
    wrapper.add_shrink = lambda *args, **kwargs: shrinks.append(1) or PunicaWrapperCPU.add_shrink(wrapper, *args, **kwargs)

    def both():
        theirs, mine = before.clone(), before.clone()
        stock(_decode_wrapper(indices), theirs, x, a, b, 0.5, (8, 8, 8))
        shrinks.clear()
        skipping(wrapper, mine, x, a, b, 0.5, (8, 8, 8))
        return theirs, mine

    theirs, mine = both()
    assert len(shrinks) == 1  # the first slice only
    assert torch.allclose(mine, theirs, atol=1e-5) and not torch.equal(mine[:, :8], before[:, :8])
    assert torch.equal(mine[:, 8:], before[:, 8:])
    a[1][2] = torch.randn(1, 4, 16, generator=generator)  # an adapter on k_proj loaded into slot 2, in place
    theirs, mine = both()
    assert len(shrinks) == 2 and not torch.equal(mine[:, 8:16], before[:, 8:16])
    assert torch.allclose(mine, theirs, atol=1e-5)
