"""`batchllm profile`: measure a model on the real engine and write its profile.

Per replica shape, an engine is started on the first devices and fed real prompts:
first turns of ShareGPT conversations (lengths unrestricted: the output-length CDF is
measured on these, on the widest shape) and long multi-turn prompts (prefill-heavy
steps). Every engine step is recorded (wall time, prompt tokens computed, decoding
sequences and their context), and the step-latency model is fit on those records.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import pyarrow.parquet as pq

from batchllm.core.requests import EngineRequest, EngineResult
from batchllm.core.sampling import SamplingSpec
from batchllm.costmodel.latency import FEATURES, StepFeatures, StepLatencyModel, step_features
from batchllm.costmodel.lengths import LengthDistribution
from batchllm.costmodel.profile import ModelFacts, Profile, ReplicaShape, ShapeProfile
from batchllm.engines.devices import DeviceSet, Replica, engine_dtype
from batchllm.engines.engine import Engine, EngineFactory
from batchllm.engines.hardware import this_machine
from batchllm.engines.protocol import EngineConfig, StepRecord

PROMPTS = Path(__file__).resolve().parent.parent.parent / "profiles" / "prompts"
WARMUP_STEPS = 3  # the first steps of a fresh engine pay one-time costs (measured as warmup_s)


@dataclass(frozen=True)
class ProfileSettings:
    length_prompts: int = 256  # first turns whose output lengths form the CDF
    length_cap_tokens: int = 256
    prefill_prompts: int = 32  # long multi-turn prompts, few output tokens
    length_prompt_max_chars: int = 2000  # CPU prefill is slow; the longest prompts add time, not information
    latency_prompts: int = 128  # first turns on the narrower shapes (latency only)
    # Short prompts at full batch: decode steps whose context is small for their batch size,
    # so the fit can tell the per-sequence cost from the per-context-token cost.
    short_decode_prompts: int = 128
    short_prompt_max_chars: int = 200
    max_model_len: int = 2048
    kv_cache_memory_bytes: int | None = 1 << 30


def feature_rows(steps: list[StepRecord]) -> np.ndarray:
    """Rows of FEATURES, one a step."""
    return np.array([step_features(s) for s in steps], float).reshape(len(steps), len(FEATURES))


def shapes_to_profile(devices: DeviceSet, attention_heads: int) -> list[ReplicaShape]:
    count = len(devices.ids)
    if devices.kind == "gpu":
        return [ReplicaShape(t, t) for t in (1, 2, 4, 8) if t <= count and attention_heads % t == 0]
    shapes = [ReplicaShape(w, 1) for w in range(1, count + 1)]  # one rank, w cores of threads
    return shapes + [ReplicaShape(t, t) for t in range(2, count + 1) if attention_heads % t == 0]


def model_facts(model_dir: Path, max_model_len: int) -> ModelFacts:
    config = json.loads((model_dir / "config.json").read_text())
    parameters = 0
    for weights in model_dir.glob("*.safetensors"):
        with open(weights, "rb") as handle:
            header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
        parameters += sum(int(np.prod(t["shape"])) for name, t in header.items() if name != "__metadata__")
    return ModelFacts(
        parameters=parameters, layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        attention_heads=config["num_attention_heads"], kv_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
        max_model_len=max_model_len,
    )


def prompts(name: str, start: int, count: int, max_chars: int | None = None) -> list[str]:
    texts = pq.read_table(PROMPTS / f"{name}.parquet", columns=["prompt"]).column("prompt").to_pylist()[start:]
    if max_chars is not None:
        texts = [text for text in texts if len(text) <= max_chars]
    return texts[:count]


def run_requests(engine: Engine, requests: list[EngineRequest], on_result: Callable[[int], None]) -> tuple[list[EngineResult], list[StepRecord]]:
    engine.drain_steps()
    engine.submit(requests)
    results: list[EngineResult] = []
    while len(results) < len(requests):
        batch = engine.poll(timeout_s=1.0)
        results += batch
        if batch:
            on_result(len(results))
    return results, engine.drain_steps()


def fit_steps(features: np.ndarray, seconds: np.ndarray) -> tuple[StepLatencyModel, float]:
    """The step-latency model and its median relative error over all measured steps."""
    latency = StepLatencyModel.fit(features, seconds)
    predicted = np.array([latency.step_s(StepFeatures(*row)) for row in features])
    return latency, round(float(np.median(np.abs(predicted - seconds) / seconds)), 4)


def refit(directory: Path) -> Profile:
    """Refit a saved profile's step latency from its saved measurements (no engine)."""
    profile = Profile.load(directory)
    shapes = {}
    for key, shape in profile.shapes.items():
        with open(directory / f"steps-{key}.csv", newline="") as handle:
            rows = list(csv.DictReader(handle))
        features = np.array([[float(row[name]) for name in FEATURES] for row in rows])
        latency, error = fit_steps(features, np.array([float(row["wall_s"]) for row in rows]))
        shapes[key] = dataclasses.replace(shape, latency=latency, fit_median_error=error)
    refitted = dataclasses.replace(profile, shapes=shapes)
    refitted.save(directory)
    return refitted


def profile_model(model_name: str, model_dir: Path, devices: DeviceSet, hardware: str, factory: EngineFactory,
                  settings: ProfileSettings, log_dir: Path, report: Callable[[str], None]) -> tuple[Profile, dict[str, list[dict]]]:
    facts = model_facts(model_dir, settings.max_model_len)
    shapes = shapes_to_profile(devices, facts.attention_heads)
    widest = max((s for s in shapes if s.tp == 1), key=lambda s: s.devices)
    shape_profiles, tables, engine_settings, lengths = {}, {}, {}, None
    for shape in shapes:
        replica = Replica(devices.kind, devices.ids[: shape.devices], tp=shape.tp)
        config = EngineConfig(model=str(model_dir), replica=replica, max_model_len=settings.max_model_len,
                              kv_cache_memory_bytes=settings.kv_cache_memory_bytes if devices.kind == "cpu" else None,
                              enforce_eager=devices.kind == "cpu", dtype=engine_dtype(devices.kind), log_path=str(log_dir / f"profile-{shape.key}.log"))
        report(f"[{shape.key}] starting engine on {replica.kind} {','.join(map(str, replica.device_ids))}")
        engine = factory(config)
        try:
            ready = engine.ready
            engine_settings = {"engine_version": ready.engine_version, "max_num_seqs": ready.max_num_seqs,
                               "max_num_batched_tokens": ready.max_num_batched_tokens, "block_size_tokens": ready.block_size_tokens,
                               "max_model_len": ready.max_model_len, "dtype": config.dtype or "bfloat16", "enforce_eager": config.enforce_eager,
                               "kv_cache_memory_bytes": config.kv_cache_memory_bytes}
            steps: list[StepRecord] = []
            first_steps: list[StepRecord] = []
            workloads = [("prefill", [EngineRequest(f"p{i}", text, sampling=SamplingSpec(max_tokens=4)) for i, text in enumerate(prompts("multi_turn", 0, settings.prefill_prompts))])]
            short = prompts("first_turns", 0, settings.short_decode_prompts, settings.short_prompt_max_chars)
            workloads.append(("short-decode", [EngineRequest(f"s{i}", text, sampling=SamplingSpec(max_tokens=48)) for i, text in enumerate(short)]))
            if shape == widest:
                texts = prompts("first_turns", 0, settings.length_prompts, settings.length_prompt_max_chars)
                workloads.append(("lengths", [EngineRequest(f"l{i}", t, sampling=SamplingSpec(max_tokens=settings.length_cap_tokens)) for i, t in enumerate(texts)]))
            else:
                texts = prompts("first_turns", 0, settings.latency_prompts, settings.length_prompt_max_chars)
                workloads.append(("decode", [EngineRequest(f"d{i}", t, sampling=SamplingSpec(max_tokens=128)) for i, t in enumerate(texts)]))
            for label, requests in workloads:
                started = time.monotonic()
                results, records = run_requests(engine, requests, lambda n: None)
                results = [r for r in results if not r.is_error]  # e.g. prompts too long
                if not first_steps:  # the engine's first steps: warm-up, measured apart
                    first_steps, records = records[:WARMUP_STEPS], records[WARMUP_STEPS:]
                steps += records
                report(f"[{shape.key}] {label}: {len(requests)} requests, {len(records)} steps, {time.monotonic() - started:.1f} s")
                if label == "lengths":
                    lengths = LengthDistribution.fit([r.num_output_tokens for r in results], [r.finish_reason != "length" for r in results])
        finally:
            engine.stop()
        features, seconds = feature_rows(steps), np.array([s.wall_s for s in steps])
        latency, error = fit_steps(features, seconds)
        warmup_s = sum(max(0.0, s.wall_s - latency.step_s(StepFeatures(*row))) for s, row in zip(first_steps, feature_rows(first_steps)))
        shape_profiles[shape.key] = ShapeProfile(ready.load_time_s, ready.kv_capacity_tokens, latency, error, round(warmup_s, 2))
        tables[shape.key] = [{"wall_s": round(s.wall_s, 6), **dict(zip(FEATURES, map(float, f)))} for s, f in zip(steps, features)]
        report(f"[{shape.key}] load {ready.load_time_s:.1f} s + warm-up {warmup_s:.1f} s, KV {ready.kv_capacity_tokens:,} tokens, step fit median error {error:.1%}")
    identity = dataclasses.replace(this_machine(devices.kind), dtype=cast(str, engine_settings["dtype"]))  # the dtype it ran
    assert lengths is not None  # measured on the widest shape, which is always one of `shapes`
    profile = Profile("measured", hardware, model_name, engine_settings, facts, shape_profiles, lengths,
                      notes={"length_prompts": "profiles/prompts/first_turns.parquet", "temperature": 0.0,
                             "length_cap_tokens": settings.length_cap_tokens}, identity=identity)
    return profile, tables
