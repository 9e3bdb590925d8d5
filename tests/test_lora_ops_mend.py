"""The mend of vLLM's CPU LoRA ops (batchllm/engines/lora_ops_mend.py) on the installed ops, with
no engine: a token of no adapter (index -1) beside adapter tokens gets no adapter's delta, and
the adapter tokens get what the op itself gives them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.engine, pytest.mark.starts_no_engine]


def _case():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(4, 6, generator=generator)
    shrink_weights = torch.randn(2, 3, 6, generator=generator)  # two adapter slots of rank 3 over a width of 6
    expand_weights = torch.randn(2, 5, 3, generator=generator)
    indices = torch.tensor([0, -1, 1, -1])  # tokens of slot 0, of the base, of slot 1, of the base
    return inputs, shrink_weights, expand_weights, indices


def test_a_base_token_beside_adapter_tokens_gets_no_delta_and_adapter_tokens_get_the_ops_own():
    from vllm.lora.ops.torch_ops import lora_ops

    from batchllm.engines.lora_ops_mend import skip_base_tokens

    inputs, shrink_weights, expand_weights, indices = _case()
    shrunk, theirs = torch.zeros(4, 3), torch.zeros(4, 3)
    skip_base_tokens(lora_ops.bgmv_shrink)(inputs, shrink_weights, shrunk, indices, 0.5)
    lora_ops.bgmv_shrink(inputs, shrink_weights, theirs, indices, 0.5)
    assert torch.equal(shrunk[[1, 3]], torch.zeros(2, 3))
    assert torch.equal(shrunk[[0, 2]], theirs[[0, 2]])
    assert not torch.equal(shrunk[0], shrunk[2])  # each adapter token its own slot
    before = torch.randn(4, 5)
    expanded = before.clone()
    skip_base_tokens(lora_ops.bgmv_expand)(shrunk, expand_weights, expanded, indices, True)
    assert torch.equal(expanded[[1, 3]], before[[1, 3]])
    delta = torch.einsum("bi,boi->bo", shrunk[[0, 2]], expand_weights[[0, 1]])  # slot 0's and slot 1's B
    assert torch.allclose(expanded[[0, 2]], before[[0, 2]] + delta, atol=1e-6)
    sliced = torch.zeros(4, 9)
    skip_base_tokens(lora_ops.bgmv_expand_slice)(shrunk, expand_weights, sliced, indices, 2, 5, True)
    assert torch.equal(sliced[[1, 3]], torch.zeros(2, 9))
    assert torch.allclose(sliced[[0, 2], 2:7], delta, atol=1e-6) and torch.equal(sliced[:, :2], torch.zeros(4, 2))


def test_mending_the_installed_ops_leaves_no_fault_and_is_done_once():
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    from batchllm.engines.lora_ops_mend import MENDED_OPS, mend_cpu_lora_ops, ops_apply_the_last_adapter_to_base_tokens

    originals = {name: getattr(lora_ops, name) for name in MENDED_OPS}
    faulty = ops_apply_the_last_adapter_to_base_tokens()
    try:
        assert mend_cpu_lora_ops() is faulty
        assert not ops_apply_the_last_adapter_to_base_tokens()
        if faulty:  # every holder of the names calls the mended op, wrapped once
            assert all(getattr(punica_cpu, name) is getattr(lora_ops, name) is not originals[name] for name in MENDED_OPS)
            assert mend_cpu_lora_ops() and getattr(lora_ops, "bgmv_shrink").__wrapped__ is originals["bgmv_shrink"]
    finally:
        import vllm.lora.ops.torch_ops as package

        for module in (lora_ops, package, punica_cpu):
            for name, op in originals.items():
                setattr(module, name, op)
