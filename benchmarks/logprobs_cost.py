"""What keeping logprobs costs per engine step (real engine), to decide whether the cost
model must count it.

    .venv/bin/python benchmarks/logprobs_cost.py [--requests 48] [--max-tokens 64] [--rounds 3]

One engine on both cores runs the same prompts (ShareGPT first turns, `ignore_eos`, so
every request decodes exactly --max-tokens) in turns: without logprobs, with `logprobs`
(the sampled token's), and with `top_logprobs: 20` (OpenAI's maximum), round after round
so that the machine's noise falls on all three alike. Prints each setting's median wall
time and its ratio to the plain run.
"""

from __future__ import annotations

import argparse
import statistics
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
SETTINGS = {"plain": {}, "logprobs": {"logprobs": True}, "top_logprobs 20": {"logprobs": True, "top_logprobs": 20}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    home = batchllm_home()
    model_dir = resolve_model("smollm2-135m", dag_dir=Path.cwd(), home=home, where="benchmark").materialise(home)
    prompts = [p for p in pq.read_table(PROMPTS).column("prompt").to_pylist() if len(p) < 600][:args.requests]
    engine = start_vllm_engine(EngineConfig(model=model_dir, replica=Replica("cpu", (0, 1)), max_model_len=2048,
                                            kv_cache_memory_bytes=1 << 30, enforce_eager=True, dtype=engine_dtype("cpu")))
    walls: dict[str, list[float]] = {name: [] for name in SETTINGS}
    try:
        engine.ready  # noqa: B018
        for round_ in range(args.rounds):
            for name, extra in SETTINGS.items():
                sampling = SamplingSpec(max_tokens=args.max_tokens, ignore_eos=True, **extra)
                started = time.perf_counter()
                engine.submit([EngineRequest(f"{round_}-{name}-{i}", p, sampling=sampling) for i, p in enumerate(prompts)])
                done = 0
                while done < len(prompts):
                    results = engine.poll(timeout_s=0.5)
                    done += len(results)
                    if extra:
                        assert all(r.logprobs is not None and len(r.logprobs) == args.max_tokens for r in results)
                walls[name].append(time.perf_counter() - started)
                engine.drain_steps()
    finally:
        engine.stop()
    plain = statistics.median(walls["plain"])
    print(f"{args.requests} requests x {args.max_tokens} tokens, one engine on cores 0-1, {args.rounds} rounds in turns")
    for name, times in walls.items():
        median = statistics.median(times)
        print(f"{name:16} median {median:6.2f} s  ({', '.join(f'{t:.2f}' for t in times)})  {median / plain:5.3f}x plain")
    worst = max(statistics.median(t) for t in walls.values()) / plain
    print(f"worst: {worst:.3f}x the plain run's time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
