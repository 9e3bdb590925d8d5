"""`batchllm profile --quick`: calibrate a model on this machine in about two minutes.

Instead of a full profile (hundreds of prompts per replica shape), each shape's engine
runs a short mix (a few long prompts for prefill, short prompts decoding at a full batch,
first turns decoding at a typical batch) and its steps and start time calibrate the prior
(what the local store already learnt, else the shipped profile of this CPU kind or the
closest one, else the analytic one) exactly as a run does. Output lengths are the model's,
not the machine's: the prior's are kept. The result goes to the local profile store, where
the next plan and run on this machine start from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from batchllm.core.requests import EngineRequest
from batchllm.core.sampling import SamplingSpec
from batchllm.costmodel.calibration.model import SHAPES_MEASURED_HERE, ModelCalibration
from batchllm.costmodel.calibration.store import ProfileStore
from batchllm.costmodel.latency import step_features
from batchllm.costmodel.profile import Profile
from batchllm.dag.model import EngineSpec
from batchllm.engines.devices import CPU_KV_CACHE_DEFAULT_BYTES, DeviceSet, Replica, engine_dtype
from batchllm.engines.engine import EngineFactory
from batchllm.engines.protocol import EngineConfig
from batchllm.planner.cluster import cluster_profile, local_cluster, run_settings
from batchllm.profiling.profiler import WARMUP_STEPS, prompts, run_requests, shapes_to_profile


@dataclass(frozen=True)
class QuickSettings:
    prefill_prompts: int = 6  # long multi-turn prompts, 4 output tokens
    prefill_max_chars: int = 1500
    short_prompts: int = 48  # short first turns, 32 output tokens: a full batch of small context
    short_max_chars: int = 200
    decode_prompts: int = 32  # first turns, 64 output tokens
    decode_max_chars: int = 600
    max_model_len: int = 2048


def quick_profile(model_name: str, model_dir: Path, devices: DeviceSet, factory: EngineFactory, profiles_root: Path,
                  store: ProfileStore, report: Callable[[str], None], settings: QuickSettings = QuickSettings()) -> tuple[Profile, Path]:
    """Calibrate `model_name` on every replica shape that fits on `devices`; save and return
    the learnt profile and its store folder."""
    cluster = local_cluster(devices.kind, len(devices.ids))
    assert cluster.identity is not None  # local_cluster sets this machine's
    run = run_settings(EngineSpec(max_model_len=settings.max_model_len), cluster)
    stored = store.load(cluster.identity, model_name, run)
    prior = stored.profile if stored else cluster_profile(cluster, model_name, profiles_root, run)[0]
    report(f"prior: {stored.describe() if stored else f'{prior.kind} profile {prior.hardware}/{prior.model}'}")
    calibration = ModelCalibration(prior)
    workload = [
        [EngineRequest(f"p{i}", t, sampling=SamplingSpec(max_tokens=4)) for i, t in enumerate(prompts("multi_turn", 0, settings.prefill_prompts, settings.prefill_max_chars))],
        [EngineRequest(f"s{i}", t, sampling=SamplingSpec(max_tokens=32)) for i, t in enumerate(prompts("first_turns", 0, settings.short_prompts, settings.short_max_chars))],
        [EngineRequest(f"d{i}", t, sampling=SamplingSpec(max_tokens=64)) for i, t in enumerate(prompts("first_turns", 400, settings.decode_prompts, settings.decode_max_chars))],
    ]
    for shape in shapes_to_profile(devices, prior.facts.attention_heads):
        if shape.key not in prior.shapes:
            continue
        config = EngineConfig(model=str(model_dir), replica=Replica(devices.kind, devices.ids[: shape.devices], tp=shape.tp),
                              max_model_len=settings.max_model_len,
                              kv_cache_memory_bytes=CPU_KV_CACHE_DEFAULT_BYTES if devices.kind == "cpu" else None,
                              enforce_eager=devices.kind == "cpu", dtype=engine_dtype(devices.kind))
        started = time.monotonic()
        engine = factory(config)
        try:
            ready = engine.ready
            load_s = max(ready.load_time_s, time.monotonic() - started)
            calibration.observe_load(shape.key, load_s)
            calibration.observe_started(shape.key, config, ready)
            records = []
            for requests in workload:
                records += run_requests(engine, requests, lambda n: None)[1]
        finally:
            engine.stop()
        for step in records[WARMUP_STEPS:]:
            calibration.observe_step(shape.key, step_features(step), step.wall_s)
        factor = calibration.latency[shape.key].speed_factor() if shape.key in calibration.latency else 1.0
        report(f"[{shape.key}] load {load_s:.1f} s, {len(records)} steps in {time.monotonic() - started:.1f} s; "
               f"steps take {factor:.2f}x the prior's")
    learnt = calibration.profile()
    learnt = replace(learnt, kind="learnt", hardware=cluster.identity.folder_name, identity=cluster.identity,
                     engine={**learnt.engine, **{k: v for k, v in run.items() if k in ("dtype", "enforce_eager")}},
                     notes={"prior": f"{prior.kind} {prior.hardware}/{prior.model}", "method": "batchllm profile --quick",
                            "shapes_measured": list(calibration.evidence().shapes_measured),
                            SHAPES_MEASURED_HERE: list(calibration.shapes_measured_here())})
    evidence = calibration.evidence()
    folder = store.save(learnt, cluster.identity, run, source="batchllm profile --quick",
                        evidence={"steps": evidence.steps, "outputs": 0, "loads": evidence.loads,
                                  "shapes_measured": list(evidence.shapes_measured)})
    return learnt, folder
