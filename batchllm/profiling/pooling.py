"""`batchllm profile` of a pooling model (an embedding model or a classifier): prefill only.

A pooling engine answers each request in the step that computes its prompt, so what a plan
needs of it is the step latency over the prompt tokens a step computes (and their attention),
its load time, and how many texts it holds at once. Per replica shape (thread widths: a model
this small gains nothing from tensor parallelism) an engine is started on the first devices
and fed real texts: many short ones (ShareGPT first turns of at most 200 characters: full
batches of small prompts) and long ones (cut at 900 characters: steps full of prefill).
The step model is fit on every step as a generation model's is; its decode terms stay 0. The
"output length" of every request is 1: the planner sees a pooling request as a generation
request of one token, answered by its prefill step.

An encoder's engine keeps no KV cache between steps (vLLM reports a block of one for
all-MiniLM-L6-v2: 128 tokens); the profile holds at least what could ever be in a step at once
(`max_num_seqs` x its context), so the simulator never waits for memory the engine does not use.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np

from batchllm.core.requests import EngineRequest, ModelTask
from batchllm.costmodel.calibration.model import kv_capacity_tokens
from batchllm.costmodel.latency import FEATURES, StepFeatures
from batchllm.costmodel.lengths import LengthDistribution
from batchllm.costmodel.profile import Profile, ReplicaShape, ShapeProfile
from batchllm.engines.devices import DeviceSet, Replica, engine_dtype
from batchllm.engines.engine import EngineFactory
from batchllm.engines.hardware import this_machine
from batchllm.engines.protocol import EngineConfig, StepRecord
from batchllm.models.model_kind import ModelKind
from batchllm.profiling.profiler import WARMUP_STEPS, feature_rows, fit_steps, model_facts, prompts, run_requests

SHORT_TEXTS, SHORT_MAX_CHARS = 512, 200
LONG_TEXTS, LONG_CUT_CHARS = 96, 900


def pooling_task(model_dir: Path) -> ModelTask | None:
    """The engine task a model directory is profiled with: None for a generation model."""
    kind = ModelKind.of(model_dir)
    if kind.generates or not kind.architectures:
        return None
    return ModelTask.CLASSIFY if kind.classifies else ModelTask.EMBED


def pooling_workloads() -> list[tuple[str, list[EngineRequest]]]:
    short = prompts("first_turns", 0, SHORT_TEXTS, SHORT_MAX_CHARS)
    long = [text[:LONG_CUT_CHARS] for text in prompts("multi_turn", 0, LONG_TEXTS)]
    return [("short", [EngineRequest(f"s{i}", text, chat=False) for i, text in enumerate(short)]),
            ("long", [EngineRequest(f"l{i}", text, chat=False) for i, text in enumerate(long)])]


def profile_pooling_model(model_name: str, model_dir: Path, task: ModelTask, devices: DeviceSet, hardware: str,
                          factory: EngineFactory, log_dir: Path, report: Callable[[str], None]) -> tuple[Profile, dict[str, list[dict]]]:
    shapes = [ReplicaShape(width, 1) for width in range(1, len(devices.ids) + 1)]
    shape_profiles, tables, engine_settings = {}, {}, {}
    max_model_len = 0
    for shape in shapes:
        replica = Replica(devices.kind, devices.ids[: shape.devices], tp=1)
        config = EngineConfig(model=str(model_dir), replica=replica, enforce_eager=devices.kind == "cpu", dtype=engine_dtype(devices.kind),
                              log_path=str(log_dir / f"profile-{shape.key}.log"), task=task)
        report(f"[{shape.key}] starting a {task.value} engine on {replica.kind} {','.join(map(str, replica.device_ids))}")
        engine = factory(config)
        try:
            ready = engine.ready
            max_model_len = ready.max_model_len
            engine_settings = {"engine_version": ready.engine_version, "max_num_seqs": ready.max_num_seqs,
                               "max_num_batched_tokens": ready.max_num_batched_tokens, "block_size_tokens": ready.block_size_tokens,
                               "max_model_len": ready.max_model_len, "dtype": config.dtype or "bfloat16",
                               "enforce_eager": config.enforce_eager, "task": task.value}
            steps: list[StepRecord] = []
            first_steps: list[StepRecord] = []
            for label, requests in pooling_workloads():
                started = time.monotonic()
                results, records = run_requests(engine, requests, lambda n: None)
                if not first_steps:  # the engine's first steps: warm-up, measured apart
                    first_steps, records = records[:WARMUP_STEPS], records[WARMUP_STEPS:]
                steps += records
                refused = sum(r.is_error for r in results)
                report(f"[{shape.key}] {label}: {len(requests)} texts ({refused} over the context), {len(records)} steps, "
                       f"{time.monotonic() - started:.1f} s")
        finally:
            engine.stop()
        features, seconds = feature_rows(steps), np.array([s.wall_s for s in steps])
        latency, error = fit_steps(features, seconds)
        warmup_s = sum(max(0.0, s.wall_s - latency.step_s(StepFeatures(*row))) for s, row in zip(first_steps, feature_rows(first_steps)))
        capacity = kv_capacity_tokens(config, ready)  # kept none between steps: at least what one holds
        shape_profiles[shape.key] = ShapeProfile(ready.load_time_s, capacity, latency, error, round(warmup_s, 2))
        tables[shape.key] = [{"wall_s": round(s.wall_s, 6), **dict(zip(FEATURES, map(float, f)))} for s, f in zip(steps, features)]
        report(f"[{shape.key}] load {ready.load_time_s:.1f} s + warm-up {warmup_s:.1f} s, step fit median error {error:.1%}")
    identity = dataclasses.replace(this_machine(devices.kind), dtype=cast(str, engine_settings["dtype"]))
    one_token = LengthDistribution.fit([1] * 16, [True] * 16)  # answered by the prefill step: one "token"
    profile = Profile("measured", hardware, model_name, engine_settings, model_facts(model_dir, max_model_len), shape_profiles,
                      one_token, notes={"task": task.value, "texts": "profiles/prompts: first turns <= 200 characters, "
                                        "multi-turn cut at 900"}, identity=identity)
    return profile, tables
