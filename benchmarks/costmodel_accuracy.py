"""Cost model accuracy: estimated vs measured time on the real engine, side by side.

    .venv/bin/python benchmarks/costmodel_accuracy.py          (about 15 minutes on 2 cores)

For each workload (real ShareGPT prompts not used for profiling; counts and max_tokens
vary), the run time is estimated from the committed profile before the run, with
output lengths sampled (mean of 5 seeds), then measured on the real engine, then
estimated again with the measured output lengths fed back in. Engine start-up is
reported apart (it is a profile constant). Also writes the simulated vs real running
count per step of the first workload to benchmarks/results/running_trace.csv.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from batchllm.core.requests import EngineRequest  # noqa: E402
from batchllm.core.sampling import SamplingSpec  # noqa: E402
from batchllm.costmodel.estimator import ExecutionPlan, Workload, estimate  # noqa: E402
from batchllm.costmodel.profile import Profile, ReplicaShape, profile_dir  # noqa: E402
from batchllm.engines.devices import Replica, hardware_name  # noqa: E402
from batchllm.engines.process_engine import start_vllm_engine  # noqa: E402
from batchllm.engines.protocol import EngineConfig  # noqa: E402
from batchllm.models.registry import batchllm_home, resolve_model  # noqa: E402
from batchllm.models.tokens import PromptTokenizer  # noqa: E402
from batchllm.profiling.profiler import prompts, run_requests  # noqa: E402

# (label, prompt set, count, max_tokens, cores, longest prompt in characters). Prompts come
# from index 300 on (profiling used first_turns[0:256] and multi_turn[0:48]). Prefill on
# these CPUs runs at ~200 tokens/s, so counts stay small enough for ~15 minutes in all.
WORKLOADS = [
    ("short-100x64", "first_turns", 100, 64, 2, 400),
    ("short-150x128", "first_turns", 150, 128, 2, 400),
    ("long-30x64", "multi_turn", 30, 64, 2, 3000),
    ("short-100x256", "first_turns", 100, 256, 2, 400),
    ("short-100x96-1core", "first_turns", 100, 96, 1, 400),
]
FIRST_UNUSED_PROMPT = 300
SEEDS = 5


def main() -> None:
    home = batchllm_home()
    model_dir = resolve_model("smollm2-135m", dag_dir=REPO, home=home, where="benchmark").materialise(home)
    profile = Profile.load(profile_dir(REPO / "profiles", hardware_name("cpu"), "smollm2-135m"))
    tokenizer = PromptTokenizer(model_dir)
    rows, engines = [], {}
    try:
        used: dict[str, int] = {}
        fresh_engine = False
        for label, prompt_set, count, max_tokens, cores, max_chars in WORKLOADS:
            shape = ReplicaShape(cores, 1)
            if cores not in engines:
                for engine in engines.values():
                    engine.stop()
                engines.clear()
                config = EngineConfig(model=model_dir, replica=Replica("cpu", tuple(range(cores))),
                                      max_model_len=int(profile.engine["max_model_len"]),
                                      kv_cache_memory_bytes=profile.engine.get("kv_cache_memory_bytes"), enforce_eager=True,
                                      dtype=profile.engine.get("dtype") if profile.engine.get("dtype") != "bfloat16" else None,
                                      log_path=str(REPO / "benchmarks" / "results" / f"engine-{cores}.log"))
                (REPO / "benchmarks" / "results").mkdir(exist_ok=True)
                engines[cores] = start_vllm_engine(config)
                fresh_engine = True
                measured_load = engines[cores].ready.load_time_s
                print(f"engine on {cores} core(s): started in {measured_load:.1f} s (profile says {profile.shape(shape).load_time_s:.1f} s)", flush=True)
            texts = [t for t in prompts(prompt_set, FIRST_UNUSED_PROMPT, 10_000) if len(t) <= max_chars]
            texts = texts[used.get(prompt_set, 0): used.get(prompt_set, 0) + count]  # no prompt twice across workloads
            used[prompt_set] = used.get(prompt_set, 0) + count
            requests = [EngineRequest(f"{label}-{i}", text, sampling=SamplingSpec(max_tokens=max_tokens)) for i, text in enumerate(texts)]
            prompt_tokens = np.array([tokenizer.count(r) for r in requests])
            workload = Workload.of(prompt_tokens, max_tokens)
            plan = ExecutionPlan(1, shape)
            started = time.perf_counter()
            # the first workload on a fresh engine also pays its warm-up steps
            first_on_engine, fresh_engine = fresh_engine, False
            warmup_s = profile.shape(shape).warmup_s if first_on_engine else 0.0
            sampled_estimates = [estimate(profile, plan, workload, seed=s, include_load=False) for s in range(SEEDS)]
            sampled = [e.run_s + warmup_s for e in sampled_estimates]
            estimate_ms = (time.perf_counter() - started) * 1000 / SEEDS
            wall_started = time.perf_counter()
            results, steps = run_requests(engines[cores], requests, lambda n: None)
            measured = time.perf_counter() - wall_started
            by_id = {r.request_id: r for r in results}
            known = np.array([by_id[r.request_id].num_output_tokens for r in requests])
            known_estimate = estimate(profile, plan, Workload.of(prompt_tokens, max_tokens, known_output_tokens=known), include_load=False)
            guess = float(np.mean(sampled))
            rows.append((label, count, max_tokens, cores, guess, measured, known_estimate.run_s + warmup_s, estimate_ms,
                         float(np.mean(known)), float(np.mean(sampled_estimates[0].output_tokens))))
            print(f"{label}: estimated {guess:.1f} s, measured {measured:.1f} s, with known lengths {known_estimate.run_s + warmup_s:.1f} s", flush=True)
            write_steps(label, steps)
            save_workload(label, cores, max_tokens, prompt_tokens, known, measured, first_on_engine)
            if len(rows) == 1:
                write_running_trace(known_estimate, steps)
    finally:
        for engine in engines.values():
            engine.stop()
    report(rows)


RESULTS = REPO / "benchmarks" / "results"


def save_workload(label, cores, max_tokens, prompt_tokens, known, measured, first_on_engine) -> None:
    """What a re-evaluation needs without the engine: `--from-results` re-estimates from these."""
    body = {"label": label, "cores": cores, "max_tokens": max_tokens, "measured_s": measured, "first_on_engine": first_on_engine,
            "prompt_tokens": [int(t) for t in prompt_tokens], "output_tokens": [int(t) for t in known]}
    (RESULTS / f"workload-{label}.json").write_text(json.dumps(body))


def from_results() -> None:
    """Re-estimate the saved workloads of the last run with the current profile and code."""
    profile = Profile.load(profile_dir(REPO / "profiles", hardware_name("cpu"), "smollm2-135m"))
    rows = []
    for path in sorted(RESULTS.glob("workload-*.json"), key=lambda p: p.stat().st_mtime):
        w = json.loads(path.read_text())
        shape = ReplicaShape(w["cores"], 1)
        warmup_s = profile.shape(shape).warmup_s if w["first_on_engine"] else 0.0
        prompt_tokens, known = np.array(w["prompt_tokens"]), np.array(w["output_tokens"])
        plan = ExecutionPlan(1, shape)
        sampled = [estimate(profile, plan, Workload.of(prompt_tokens, w["max_tokens"]), seed=s, include_load=False) for s in range(SEEDS)]
        known_estimate = estimate(profile, plan, Workload.of(prompt_tokens, w["max_tokens"], known_output_tokens=known), include_load=False)
        rows.append((w["label"], len(known), w["max_tokens"], w["cores"], float(np.mean([e.run_s for e in sampled])) + warmup_s,
                     w["measured_s"], known_estimate.run_s + warmup_s, 0.0, float(known.mean()), float(np.mean(sampled[0].output_tokens))))
    report(rows)


def write_steps(label: str, steps) -> None:
    """Every real step of a workload, for comparing step by step with the latency model."""
    path = RESULTS / f"steps-{label}.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["wall_s", "prefill_tokens", "prefill_requests", "decode_seqs", "decode_context"])
        writer.writerows((round(s.wall_s, 4), s.prefill_tokens, s.prefill_requests, s.decode_seqs, s.decode_context) for s in steps)


def write_running_trace(simulated, real_steps) -> None:
    """Per step: real running count (decoding + prefilling) and the simulation's."""
    sim_running = [seg.running for seg in simulated.replicas[0].trace for _ in range(seg.steps)]
    path = REPO / "benchmarks" / "results" / "running_trace.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "real_running", "real_step_s", "simulated_running"])
        for i, step in enumerate(real_steps):
            writer.writerow([i, step.decode_seqs + step.prefill_requests, round(step.wall_s, 4), sim_running[i] if i < len(sim_running) else ""])
    print(f"running count per step, real vs simulated: {path}")


def report(rows) -> None:
    print()
    header = f"{'workload':<20}{'reqs':>6}{'max_tok':>8}{'cores':>6}{'est s':>8}{'real s':>8}{'err':>8}{'known s':>9}{'err':>8}{'est ms':>8}{'out tok real/sampled':>22}"
    print(header)
    errors, known_errors = [], []
    for label, count, max_tokens, cores, guess, measured, known, ms, real_len, sampled_len in rows:
        error, known_error = (guess - measured) / measured, (known - measured) / measured
        errors.append(abs(error))
        known_errors.append(abs(known_error))
        print(f"{label:<20}{count:>6}{max_tokens:>8}{cores:>6}{guess:>8.1f}{measured:>8.1f}{error:>+8.1%}{known:>9.1f}{known_error:>+8.1%}{ms:>8.1f}{real_len:>11.1f}/{sampled_len:<10.1f}")
    print(f"sampled lengths: median |error| {statistics.median(errors):.1%}, max {max(errors):.1%}; "
          f"known lengths: median {statistics.median(known_errors):.1%}, max {max(known_errors):.1%}")


if __name__ == "__main__":
    from_results() if "--from-results" in sys.argv else main()
