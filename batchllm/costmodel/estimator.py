"""How long a model takes to serve a set of requests under an execution plan.

Sampling then simulation: output lengths are sampled from the profile's CDF (or from the
workload's own per-request `output_lengths` when it has them, or taken as known), each
capped by max_tokens and the room the prompt leaves in the context; requests are split
over the data-parallel replicas by their work with the runtime's own rule
(`ordering.balance`): prompt + output, the expected output when per-request lengths are
given (what a split knows before the outputs are); each replica's continuous batching is
simulated with the profile's step latency, and a newly started model pays its load time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from batchllm.costmodel.lengths import output_lengths
from batchllm.costmodel.profile import Profile, ReplicaShape
from batchllm.costmodel.request_lengths import RequestLengths
from batchllm.costmodel.simulator import SchedulerLimits, SimulationResult, simulate_replica
from batchllm.ordering.balance import balance


@dataclass(frozen=True)
class ExecutionPlan:
    dp: int
    shape: ReplicaShape
    devices: int = field(init=False, compare=False, repr=False)  # dp x the shape's devices
    _hash: int = field(init=False, compare=False, repr=False)  # plans key the planner's tables

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", self.dp * self.shape.devices)
        object.__setattr__(self, "_hash", hash((self.dp, self.shape.devices, self.shape.tp)))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return f"dp{self.dp}x{self.shape.key}"


@dataclass(frozen=True)
class Workload:
    prompt_tokens: np.ndarray
    max_tokens: np.ndarray
    known_output_tokens: np.ndarray | None = None  # when known (e.g. measured), used instead of sampling
    cached_tokens: np.ndarray | None = None  # prefix-cache hits expected per request
    ready_s: np.ndarray | None = None  # when each request becomes available (pipelining)
    output_lengths: RequestLengths | None = None  # per request, predicted; None: the profile's CDF for every request

    def __post_init__(self) -> None:
        if self.output_lengths is not None and len(self.output_lengths) != np.size(self.prompt_tokens):
            raise ValueError(f"{len(self.output_lengths)} output lengths for {np.size(self.prompt_tokens)} requests")

    @classmethod
    def of(cls, prompt_tokens: npt.ArrayLike, max_tokens: npt.ArrayLike, **extra: Any) -> Workload:
        prompt_tokens = np.asarray(prompt_tokens, np.int64)
        return cls(prompt_tokens, np.broadcast_to(np.asarray(max_tokens, np.int64), prompt_tokens.shape), **extra)

    def __len__(self) -> int:
        return int(self.prompt_tokens.size)


@dataclass(frozen=True)
class Estimate:
    total_s: float  # load_s + run_s
    load_s: float  # engine start and warm-up, for a newly started model
    run_s: float
    finish_s: np.ndarray  # per request, from the plan's start (load included)
    output_tokens: np.ndarray  # the lengths the simulation used
    replicas: list[SimulationResult]


def scheduler_limits(profile: Profile, shape: ReplicaShape) -> SchedulerLimits:
    engine = profile.engine
    return SchedulerLimits(
        max_num_seqs=int(engine["max_num_seqs"]),
        max_num_batched_tokens=int(engine["max_num_batched_tokens"]),
        kv_capacity_tokens=profile.shape(shape).kv_capacity_tokens,
        block_size_tokens=int(engine["block_size_tokens"]),
    )


def estimate(profile: Profile, plan: ExecutionPlan, workload: Workload, *, seed: int = 0, include_load: bool = True) -> Estimate:
    shape_profile = profile.shape(plan.shape)
    predicted = workload.output_lengths if workload.known_output_tokens is None else None
    outputs = output_lengths(profile.lengths, workload.prompt_tokens, workload.max_tokens, profile.facts.max_model_len,
                             seed, known=predicted.sample(seed) if predicted is not None else workload.known_output_tokens)
    split = workload.prompt_tokens + (predicted.expected(workload.max_tokens) if predicted is not None else outputs)
    load_s = shape_profile.start_cost_s if include_load else 0.0
    limits = scheduler_limits(profile, plan.shape)
    finish = np.zeros(len(workload))
    results = []
    for indices in balance(split, plan.dp):
        pick = lambda values: None if values is None else np.asarray(values)[indices]  # noqa: E731, B023  called in this iteration only
        result = simulate_replica(workload.prompt_tokens[indices], outputs[indices], limits, shape_profile.latency,
                                  cached_tokens=pick(workload.cached_tokens), ready_s=pick(workload.ready_s))
        finish[indices] = result.finish_s + load_s
        results.append(result)
    run_s = max((r.total_s for r in results), default=0.0)
    return Estimate(load_s + run_s, load_s, run_s, finish, outputs, results)
