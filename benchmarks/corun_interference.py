"""How much engine replicas on different cores slow each other down (real engine).

    .venv/bin/python benchmarks/corun_interference.py [--requests 48] [--max-tokens 96]

The same decode-heavy workload runs on one replica on core 0 alone, then on replicas on
cores 0 and 1 at once (each its own copy). If the cores were independent, each co-run
replica would take as long as the lone one. Prints both wall times and the slow-down:
the profile measures replicas alone, so the planner's estimates assume 1.0x.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchllm.core.requests import EngineRequest  # noqa: E402
from batchllm.core.sampling import SamplingSpec  # noqa: E402
from batchllm.engines.devices import Replica, engine_dtype  # noqa: E402
from batchllm.engines.process_engine import start_vllm_engine  # noqa: E402
from batchllm.engines.protocol import EngineConfig  # noqa: E402
from batchllm.models.registry import batchllm_home, resolve_model  # noqa: E402

PROMPTS = Path(__file__).resolve().parent.parent / "profiles" / "prompts" / "first_turns.parquet"


def run(model_dir: str, cores: list[int], prompts: list[str], max_tokens: int) -> list[float]:
    """Wall time of each replica, all started together once loaded."""
    engines = [start_vllm_engine(EngineConfig(model=model_dir, replica=Replica("cpu", (core,)), max_model_len=2048,
                                              kv_cache_memory_bytes=1 << 30, dtype=engine_dtype("cpu"))) for core in cores]
    try:
        for engine in engines:
            engine.ready  # noqa: B018  all loaded before the clock starts
        started = time.perf_counter()
        for engine in engines:
            engine.submit([EngineRequest(f"r{i}", p, sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0)) for i, p in enumerate(prompts)])
        pending, finished_at = {k: len(prompts) for k in range(len(engines))}, {}
        while pending:
            for k, engine in enumerate(engines):
                if k in pending:
                    pending[k] -= len(engine.poll(timeout_s=0.05))
                    if pending[k] == 0:
                        del pending[k]
                        finished_at[k] = time.perf_counter() - started
        return [finished_at[k] for k in range(len(engines))]
    finally:
        for engine in engines:
            engine.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    home = batchllm_home()
    model_dir = resolve_model("smollm2-135m", dag_dir=Path.cwd(), home=home, where="benchmark").materialise(home)
    prompts = [r["prompt"] for r in pq.read_table(PROMPTS).to_pylist() if len(r["prompt"]) < 400][: args.requests]
    alone = run(model_dir, [0], prompts, args.max_tokens)[0]
    together = run(model_dir, [0, 1], prompts, args.max_tokens)
    print(f"{args.requests} requests x {args.max_tokens} tokens, dtype {engine_dtype('cpu') or 'model default'}")
    print(f"one replica alone on core 0: {alone:.1f} s")
    print(f"replicas on cores 0 and 1 at once: {together[0]:.1f} s and {together[1]:.1f} s")
    print(f"co-run slow-down: {max(together) / alone:.2f}x (1.00x = independent cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
