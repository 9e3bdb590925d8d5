"""A batchllm request in vLLM's terms, and vLLM's per-token answer in batchllm's: sampling and
structured-output parameters, images as vLLM's multimodal input, logprobs. Imports vLLM and PIL
only inside the calls (the worker has set its environment by then)."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from batchllm.core.images import ImageSource, ImageUnreadable, image_bytes
from batchllm.core.output_constraint import OutputConstraint
from batchllm.core.requests import EngineRequest, TokenLogprob
from batchllm.core.sampling import request_seed

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams


def read_images(sources: tuple[ImageSource, ...]) -> list[Any]:
    """A request's images as PIL images in RGB (vLLM's multimodal input); ImageUnreadable for the
    first one that cannot be read or is no image."""
    if not sources:
        return []
    from PIL import Image, UnidentifiedImageError

    images = []
    for number, source in enumerate(sources, 1):
        try:
            with Image.open(io.BytesIO(image_bytes(source, number))) as image:
                images.append(image.convert("RGB"))
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as error:
            if isinstance(error, ImageUnreadable):
                raise
            raise ImageUnreadable(f"image {number} is not an image PIL can read: {error}") from None
    return images


def structured_outputs(output: OutputConstraint | None) -> StructuredOutputsParams | None:
    """vLLM's structured-output parameters for a node's constraint (None: free text)."""
    if output is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(choice=list(output.choices) if output.choices else None, json=output.json_schema,
                                   regex=output.regex)


def sampling_params(request: EngineRequest) -> SamplingParams:
    """vLLM's SamplingParams of a generating request: deltas streamed, the seed per request."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    s = request.sampling
    return SamplingParams(
        n=s.n, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
        seed=None if s.seed is None else request_seed(s.seed, request.request_id),
        stop=list(s.stop) or None, presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, top_k=s.top_k, min_p=s.min_p, logit_bias=dict(s.logit_bias) or None,
        ignore_eos=s.ignore_eos, min_tokens=s.min_tokens, logprobs=s.top_logprobs if s.logprobs else None,
        output_kind=RequestOutputKind.DELTA, structured_outputs=structured_outputs(request.output),
    )


def token_logprobs(token_ids: Sequence[int], positions: Sequence[Mapping[int, Any]], top_k: int) -> list[TokenLogprob]:
    """vLLM's per-position {token id: Logprob} (the sampled token, and the `top_k` most
    likely ranked 1..top_k) -> ours."""
    tokens = []
    for token_id, candidates in zip(token_ids, positions):
        chosen = candidates[token_id]
        top = sorted((c for c in candidates.values() if c.rank is not None and 1 <= c.rank <= top_k), key=lambda c: c.rank)
        tokens.append(TokenLogprob(chosen.decoded_token or "", float(chosen.logprob),
                                   tuple((c.decoded_token or "", float(c.logprob)) for c in top)))
    return tokens
