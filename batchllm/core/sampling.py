"""How a request is sampled: one record for a DAG node's `sampling:` and a batch line's body,
with OpenAI's names where OpenAI has them and vLLM's where only vLLM does.

Each key's type and range is stated once (`SAMPLING_KEYS`), and both the DAG loader and the
batch-file reader check values against it, so a value is refused the same way wherever it
is written (the DAG: exit 2 naming the key path; a batch line: that line's error).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass(frozen=True)
class SamplingSpec:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()  # the output ends before the first of these strings (not included)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's: > 1 discourages tokens already in the prompt or output
    top_k: int = 0  # 0: all tokens
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by token id
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False  # keep each output token's log probability
    top_logprobs: int = 0  # and the k most likely tokens at each position (needs logprobs)

    def problem(self) -> tuple[str, str] | None:
        """(key, what is wrong) for a combination the keys' own ranges do not catch."""
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", f"top_logprobs = {self.top_logprobs} needs logprobs: true"
        if self.logprobs and self.n > 1:
            return "logprobs", f"logprobs are kept for one completion, and n = {self.n}: sample n = 1 (or drop logprobs)"
        if self.min_tokens > self.max_tokens:
            return "min_tokens", f"min_tokens = {self.min_tokens} is more than max_tokens = {self.max_tokens}"
        return None


DEFAULT_SAMPLING = SamplingSpec()
ORIGINAL_KEYS = ("max_tokens", "temperature", "top_p", "seed", "n")  # the keys every earlier version had


class SamplingKey(NamedTuple):
    accepts: Callable[[Any], bool]
    expect: str
    convert: Callable[[Any], Any] = lambda v: v


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _logit_bias(v: Any) -> bool:
    return isinstance(v, Mapping) and all(str(k).lstrip("-").isdigit() and int(k) >= 0 and _number(b) and -100 <= b <= 100
                                          for k, b in v.items())


SAMPLING_KEYS: dict[str, SamplingKey] = {
    "max_tokens": SamplingKey(lambda v: _integer(v) and v > 0, "a positive integer"),
    "temperature": SamplingKey(lambda v: _number(v) and 0 <= v <= 2, "a number in [0, 2]", float),
    "top_p": SamplingKey(lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]", float),
    "seed": SamplingKey(lambda v: _integer(v) and 0 <= v < 2**63, "an integer in [0, 2**63)"),
    "n": SamplingKey(lambda v: _integer(v) and 1 <= v <= 128, "an integer in [1, 128]"),
    "stop": SamplingKey(lambda v: (isinstance(v, str) and v != "") or (isinstance(v, list) and all(isinstance(s, str) and s for s in v)),
                        "a non-empty string or a list of them", lambda v: (v,) if isinstance(v, str) else tuple(v)),
    "presence_penalty": SamplingKey(lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]", float),
    "frequency_penalty": SamplingKey(lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]", float),
    "repetition_penalty": SamplingKey(lambda v: _number(v) and 0 < v <= 2, "a number in (0, 2]", float),
    "top_k": SamplingKey(lambda v: _integer(v) and v >= -1, "an integer >= 1, or 0 or -1 for all tokens", lambda v: max(v, 0)),
    "min_p": SamplingKey(lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]", float),
    "logit_bias": SamplingKey(_logit_bias, "a mapping of token ids to numbers in [-100, 100]",
                              lambda v: tuple(sorted((int(k), float(b)) for k, b in v.items()))),
    "ignore_eos": SamplingKey(lambda v: isinstance(v, bool), "true or false"),
    "min_tokens": SamplingKey(lambda v: _integer(v) and v >= 0, "an integer >= 0"),
    "logprobs": SamplingKey(lambda v: isinstance(v, bool), "true or false"),
    "top_logprobs": SamplingKey(lambda v: _integer(v) and 0 <= v <= MAX_TOP_LOGPROBS, f"an integer in [0, {MAX_TOP_LOGPROBS}]"),
}
assert set(SAMPLING_KEYS) == {f.name for f in fields(SamplingSpec)}


class SamplingError(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key, self.message = key, message


def sampling_from(values: Mapping[str, Any], defaults: SamplingSpec = DEFAULT_SAMPLING) -> SamplingSpec:
    """A SamplingSpec from `values` (keys of SAMPLING_KEYS; None means the default);
    SamplingError naming the first key that is out of range."""
    given = {}
    for key, value in values.items():
        if value is None:
            continue
        rule = SAMPLING_KEYS.get(key)
        if rule is None:
            raise SamplingError(key, f"{key} is not a sampling parameter (known: {', '.join(SAMPLING_KEYS)})")
        if not rule.accepts(value):
            raise SamplingError(key, f"{key} must be {rule.expect}, got {_show(value)}")
        given[key] = rule.convert(value)
    spec = SamplingSpec(**{**{f.name: getattr(defaults, f.name) for f in fields(SamplingSpec)}, **given})
    problem = spec.problem()
    if problem:
        raise SamplingError(*problem)
    return spec


def sampling_mapping(spec: SamplingSpec) -> dict[str, Any]:
    """The spec as a DAG's `sampling:` mapping (JSON-able; what `sampling_from` reads back)."""
    values: dict[str, Any] = {}
    for f in fields(SamplingSpec):
        value = getattr(spec, f.name)
        if value is None or (f.name not in ORIGINAL_KEYS and value == getattr(DEFAULT_SAMPLING, f.name)):
            continue
        values[f.name] = {str(k): b for k, b in value} if f.name == "logit_bias" else list(value) if f.name == "stop" else value
    return values


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def request_seed(seed: int, request_id: int | str) -> int:
    """A per-request seed: reproducible, and different for every request of a node."""
    return (seed * 1_000_003 + zlib.crc32(str(request_id).encode())) % (2**31)
