"""One model's calibration: step latency and start cost per replica shape, output lengths,
and the calibrated `Profile` the planner reads.

A shape no engine ran yet keeps its prior, rescaled by the speed factor measured on the
shapes that did run (and the start cost by theirs): the machine that makes one shape 2x
slower than its profile makes the others so too, and re-planning must not prefer a shape
only because it was never measured. A model not run yet takes `fallback` factors (those of
the other models on the same machine), when given. What a run files in the store
(`profile_to_keep`) differs in one way: a shape it did not run but an earlier run here did
keeps a learnt prior's own numbers (see there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from batchllm.costmodel.calibration.latency import PRIOR_STEPS, LatencyCalibration, scaled
from batchllm.costmodel.calibration.lengths import LengthCalibration
from batchllm.costmodel.calibration.loads import LoadCalibration
from batchllm.costmodel.calibration.store import LORA_REVISION, LORA_SETTING
from batchllm.costmodel.latency import StepFeatures
from batchllm.costmodel.lengths import LengthDistribution
from batchllm.costmodel.profile import Profile
from batchllm.engines.protocol import EngineConfig, WorkerReady

SHAPES_MEASURED_HERE = "shapes_measured_here"  # a learnt profile's note: every shape a run on this machine measured


@dataclass(frozen=True)
class SpeedFactors:
    """Measured over prior: step time and start cost (1: the prior was right)."""

    step: float = 1.0
    load: float = 1.0
    steps: int = 0  # evidence behind `step`
    loads: int = 0  # evidence behind `load`


@dataclass(frozen=True)
class Evidence:
    steps: int
    outputs: float
    loads: int
    shapes_measured: tuple[str, ...]


@dataclass
class ModelCalibration:
    prior: Profile
    prior_steps: float = PRIOR_STEPS
    latency: dict[str, LatencyCalibration] = field(default_factory=dict)
    loads: dict[str, LoadCalibration] = field(default_factory=dict)
    lengths: LengthCalibration = field(init=False)
    engine: dict[str, object] = field(default_factory=dict)  # settings the running engines reported
    kv_capacity_tokens: dict[str, int] = field(default_factory=dict)  # per shape, as the engines reported

    def __post_init__(self) -> None:
        self.lengths = LengthCalibration(self.prior.lengths)

    def observe_started(self, shape_key: str, config: EngineConfig, ready: WorkerReady) -> None:
        """An engine of this model started with `config` and reported `ready`."""
        self.observe_engine(shape_key, {"engine_version": ready.engine_version, "max_num_seqs": ready.max_num_seqs,
                                        "max_num_batched_tokens": ready.max_num_batched_tokens,
                                        "block_size_tokens": ready.block_size_tokens, "max_model_len": ready.max_model_len,
                                        "enforce_eager": config.enforce_eager,
                                        "kv_cache_memory_bytes": config.kv_cache_memory_bytes,
                                        LORA_SETTING: LORA_REVISION if config.max_loras > 0 else False}, kv_capacity_tokens(config, ready))

    def observe_engine(self, shape_key: str, settings: dict[str, object], kv_capacity_tokens: int) -> None:
        """What a started engine reported about itself: its scheduler settings and KV cache."""
        self.engine.update(settings)
        if shape_key in self.prior.shapes and kv_capacity_tokens > 0:
            self.kv_capacity_tokens[shape_key] = int(kv_capacity_tokens)

    def observe_step(self, shape_key: str, features: StepFeatures, wall_s: float) -> None:
        shape = self.prior.shapes.get(shape_key)
        if shape is None:
            return  # a shape the profile does not plan with: nothing to correct
        if shape_key not in self.latency:
            engine = self.prior.engine
            self.latency[shape_key] = LatencyCalibration.for_engine(shape.latency, int(engine.get("max_num_seqs", 256)),
                                                                    int(engine.get("max_num_batched_tokens", 8192)), self.prior_steps)
        self.latency[shape_key].observe(features, wall_s)

    def observe_load(self, shape_key: str, load_s: float) -> None:
        shape = self.prior.shapes.get(shape_key)
        if shape is not None:
            self.loads.setdefault(shape_key, LoadCalibration(shape.load_time_s)).observe(load_s)

    def factors(self) -> SpeedFactors:
        """Step-time and start-cost factors over the measured shapes (geometric means
        weighted by evidence)."""
        steps = sum(c.steps for c in self.latency.values())
        loads = sum(c.loads for c in self.loads.values())
        step = math.exp(sum(c.steps * math.log(c.speed_factor()) for c in self.latency.values()) / steps) if steps else 1.0
        load = math.exp(sum(c.loads * math.log(c.factor()) for c in self.loads.values() if c.factor() > 0) / loads) if loads else 1.0
        return SpeedFactors(step, load, steps, loads)

    def evidence(self) -> Evidence:
        return Evidence(sum(c.steps for c in self.latency.values()), self.lengths.outputs,
                        sum(c.loads for c in self.loads.values()),
                        tuple(sorted(k for k, c in self.latency.items() if c.steps)))

    def profile(self, lengths: LengthDistribution | None = None, fallback: SpeedFactors | None = None) -> Profile:
        """The calibrated profile: measured shapes refit, the others rescaled; `lengths`
        overrides the model's own (a node's), `fallback` applies when this model has no
        evidence of its own."""
        return self._profile(lengths, *self._factors_or(fallback))

    def profile_to_keep(self, fallback: SpeedFactors | None = None) -> Profile:
        """The calibrated profile as the local store keeps it. When the prior was learnt on this
        machine, a shape this run did not run but an earlier run here measured keeps the prior's
        numbers: the speed factor of the shapes that did run is mostly noise for it (rescaled at
        every save, such a shape drifted run after run by the product of other shapes' factors).
        A shape no run here measured is filed rescaled, as `profile` plans it: kept as first
        filed, the next command planned it on another workload's level (`run` after a pilot on
        another shape: -14 % where `plan --pilot` was within 3 %)."""
        if self.prior.kind != "learnt":
            return self.profile(fallback=fallback)
        return self._profile(None, *self._factors_or(fallback), keep=frozenset(measured_here(self.prior)))

    def _factors_or(self, fallback: SpeedFactors | None) -> tuple[float, float]:
        """(step, load) factors: this model's own where it has evidence, else `fallback`'s."""
        own = self.factors()
        return (own.step if own.steps or fallback is None else fallback.step,
                own.load if own.loads or fallback is None else fallback.load)

    def shapes_measured_here(self) -> tuple[str, ...]:
        """The shapes some run on this machine measured: the learnt prior's and this run's."""
        here = set(self.evidence().shapes_measured) | (set(measured_here(self.prior)) if self.prior.kind == "learnt" else set())
        return tuple(sorted(here))

    def _profile(self, lengths: LengthDistribution | None, step_factor: float, load_factor: float,
                 keep: frozenset[str] = frozenset()) -> Profile:
        """Measured shapes refit; the others' step times and start costs times the factors, but
        those in `keep`: the prior's own."""
        shapes = {}
        for key, shape in self.prior.shapes.items():
            step, start = (1.0, 1.0) if key in keep else (step_factor, load_factor)
            calibration = self.latency.get(key)
            latency = calibration.model() if calibration is not None and calibration.steps else scaled(shape.latency, step)
            load = self.loads.get(key)
            load_s = load.posterior_s() if load is not None and load.loads else shape.load_time_s * start
            shapes[key] = replace(shape, latency=latency, load_time_s=load_s,  # warm-up: the prior's
                                  kv_capacity_tokens=self.kv_capacity_tokens.get(key, shape.kv_capacity_tokens))
        return replace(self.prior, engine={**self.prior.engine, **self.engine}, shapes=shapes,
                       lengths=lengths or self.lengths.posterior())


def measured_here(learnt: Profile) -> list[str]:
    """The shapes runs on this machine measured, as a learnt profile's notes say (a profile filed
    before they kept the whole list names its last run's)."""
    shapes = learnt.notes.get(SHAPES_MEASURED_HERE, learnt.notes.get("shapes_measured", []))
    return [str(key) for key in shapes] if isinstance(shapes, list) else []


def kv_capacity_tokens(config: EngineConfig, ready: WorkerReady) -> int:
    """The tokens a replica holds at once, as the simulator takes them: its KV cache; a pooling
    engine (an encoder keeps no KV between steps: vLLM reports one 128-token block for
    all-MiniLM-L6-v2) at least what one step can hold, `max_num_seqs` x its context."""
    if config.task.pools:
        return max(ready.kv_capacity_tokens, ready.max_num_seqs * ready.max_model_len)
    return ready.kv_capacity_tokens
