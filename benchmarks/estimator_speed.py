"""Estimator speed: estimates per second for 10,000 requests, measured side by side.

    .venv/bin/python benchmarks/estimator_speed.py

Uses the committed profile of the embedded model on this machine kind, ShareGPT-like
prompt lengths, sampled output lengths, 1 and 2 data-parallel replicas; and, for the
same requests, the step-by-step reference simulation, to show what the event jumps buy.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from batchllm.costmodel.estimator import ExecutionPlan, Workload, estimate, scheduler_limits  # noqa: E402
from batchllm.costmodel.lengths import output_lengths  # noqa: E402
from batchllm.costmodel.profile import Profile, ReplicaShape, profile_dir  # noqa: E402
from batchllm.costmodel.simulator import simulate_replica  # noqa: E402
from batchllm.engines.devices import hardware_name  # noqa: E402

REQUESTS = 10_000
BUDGET_MS = 100.0


def timed(function, repeats: int) -> float:
    """Best of `repeats` wall times, in milliseconds (the least disturbed run)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, (time.perf_counter() - started) * 1000)
    return best


def main() -> None:
    profile = Profile.load(profile_dir(REPO / "profiles", hardware_name("cpu"), "smollm2-135m"))
    rng = np.random.default_rng(0)
    prompt_tokens = np.clip(rng.lognormal(mean=4.5, sigma=1.0, size=REQUESTS), 8, 1500).astype(np.int64)
    workload = Workload.of(prompt_tokens, max_tokens=256)
    shape = ReplicaShape(1, 1)
    results = {}
    for dp in (1, 2):
        plan = ExecutionPlan(dp, shape)
        results[f"estimate dp={dp}"] = timed(lambda: estimate(profile, plan, workload, seed=1), repeats=5)  # noqa: B023  called in this iteration only
    outputs = output_lengths(profile.lengths, prompt_tokens, 256, profile.facts.max_model_len, seed=1)
    limits, latency = scheduler_limits(profile, shape), profile.shape(shape).latency
    jump_ms = timed(lambda: simulate_replica(prompt_tokens, outputs, limits, latency), repeats=5)
    step_ms = timed(lambda: simulate_replica(prompt_tokens, outputs, limits, latency, jump=False), repeats=1)
    for label, ms in results.items():
        print(f"{label:<18} {REQUESTS:,} requests: {ms:7.1f} ms = {1000 / ms:6.1f} estimates/s  ({ms / BUDGET_MS:.2f}x the {BUDGET_MS:.0f} ms budget)")
    print(f"simulation alone: event jumps {jump_ms:.1f} ms, step by step {step_ms:.1f} ms: jumps are {step_ms / jump_ms:.1f}x faster")
    worst = max(results.values())
    print(f"worst estimate for {REQUESTS:,} requests: {worst:.1f} ms ({worst / BUDGET_MS:.2f}x the budget)")


if __name__ == "__main__":
    main()
