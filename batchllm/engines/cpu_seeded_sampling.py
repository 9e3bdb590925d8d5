"""Seeded sampling on vLLM's CPU path, made to survive a partial prefill; put in place in the
engine's process before the engine starts.

A request with a seed gets a generator of its own. When a step computes only part of a prompt
(a long prompt, or many at once: chunked prefill), the token sampled for it is dropped and vLLM
(0.32, `GPUModelRunner._bookkeeping_sync`) rewinds that generator by its offset, which only a
CUDA (Philox) generator has: a CPU generator raises `RuntimeError: CPU Generator does not use
offset` and the engine dies. Measured here: `dags/ensemble_judge.yaml` over 300 ShareGPT first
turns lost the engine of its seeded node three times in a row, and the node failed.

Here a seeded request's CPU generator is swapped, as the request joins the batch, for one of the
same state whose offset reads 0 and whose rewind does nothing: its samples are the same numbers
(same class of generator, same state), and a dropped sample advances its stream instead of being
rewound, so a request whose prompt was split samples from a later point of its seed's stream,
the same way each time the same steps run (the fix other vLLM backends on CPU generators took).
"""

from __future__ import annotations

import functools
from typing import Any

# torch is imported inside the functions, never when this module is: the worker imports the
# stepper's modules before it sets the engine's threads, and a torch imported then keeps its
# default thread count (the local engine's greedy answers then differ from a server's).


@functools.cache
def _offset_free_class() -> type:
    import torch

    class OffsetFreeGenerator(torch.Generator):
        """A CPU generator with vLLM's offset calls as no-ops."""

        def get_offset(self) -> int:
            return 0

        def set_offset(self, offset: int) -> OffsetFreeGenerator:
            return self

    return OffsetFreeGenerator


def offset_free(generator: Any) -> Any:
    """The same CPU generator state, as an offset-free generator (another device's is returned as it is)."""
    kind = _offset_free_class()
    if generator.device.type != "cpu" or isinstance(generator, kind):
        return generator
    copy = kind(device="cpu")
    copy.set_state(generator.get_state())
    return copy


def use_offset_free_generators() -> None:
    """Every request that joins a batch from now on in this process gets an offset-free generator (idempotent)."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    add_request = InputBatch.add_request
    if getattr(add_request, "_offset_free", False):
        return

    @functools.wraps(add_request)
    def adding(self: Any, request: Any) -> Any:
        if getattr(request, "generator", None) is not None:
            request.generator = offset_free(request.generator)
        return add_request(self, request)

    adding._offset_free = True  # type: ignore[attr-defined]  # marks the wrapper, so it is put in place once
    InputBatch.add_request = adding  # vLLM's own class, patched in the engine's process
