"""What serving LoRA adapters costs an engine's steps on this machine: the same requests on vLLM
with LoRA off, and with LoRA on (three adapters held) as base requests and as adapter requests,
with the LoRA ops batchllm's engines run (batchllm/engines/cpu_lora_ops.py on vLLM's CPU
platform) and with vLLM's own.

    .venv/bin/python benchmarks/lora_step_cost.py [--requests 48] [--rounds 2] [--out FILE]

The embedded smollm2-135m on cpu:2 (eager, float32 where batchllm's engines run float32), each
engine in its own process (vLLM's `LLM`), three adapters of rank 8 on q_proj and v_proj (made as
testkit/lora_adapters.py makes them), prefix caching off (a round would find the last one's prompts
cached). Two workloads, each timed `--rounds` times per side after a warm-up: decode (real
ShareGPT prompts cut to 200 characters, 96 tokens each, `ignore_eos`) and prefill (prompts of
about 600 tokens, 1 token each). The adapter requests go round-robin over
the three adapters, so every batch mixes them, as an engine group's do.

Then one decode step at 1, 8 and 48 sequences, apart ((65 tokens - 1 token) / 64, the adapter
requests with batchllm's ops against the base with LoRA off): whether LoRA adds a time a step or a
share of the step, which the cost model's prior takes (costmodel/lora_cost.py).

The last lines: `decode step at <n> sequences: ...` per batch, `lora steps (vLLM's ops): ...`, then
`lora steps: adapters <d>x decode, <p>x prefill; base requests on a LoRA engine <b>x` with
batchllm's (each the median time over the median time with LoRA off; docs/cost-model.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from batchllm.engines.devices import engine_dtype  # noqa: E402
from batchllm.models.embedded import SMOLLM2_135M  # noqa: E402
from batchllm.models.registry import batchllm_home  # noqa: E402
from benchmarks.reporting import host_line, publish  # noqa: E402
from testkit.lora_adapters import make_lora_adapter  # noqa: E402

ENGINE = """
import json, statistics, sys, time
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
model, dtype, lora, rounds, ops = sys.argv[1], sys.argv[2], sys.argv[3] == "lora", int(sys.argv[4]), sys.argv[5]
work = json.load(sys.stdin)
if ops == "batchllm":
    from batchllm.engines.cpu_lora_ops import use_stacked_cpu_lora_ops
    use_stacked_cpu_lora_ops()
extra = dict(enable_lora=True, max_loras=len(work["adapters"]), max_lora_rank=8) if lora else {}
llm = LLM(model=model, enforce_eager=True, dtype=dtype, seed=0, max_model_len=2048, enable_prefix_caching=False, **extra)
adapters = [LoRARequest(f"a{k}", k + 1, path) for k, path in enumerate(work["adapters"])]
def timed(prompts, tokens, with_adapters):
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    requests = [adapters[k % len(adapters)] for k in range(len(prompts))] if with_adapters else None
    started = time.perf_counter()
    llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
    return time.perf_counter() - started
timed(work["decode"][:8], 8, lora)  # warm-up
result = {}
for kind, tokens in (("decode", work["decode_tokens"]), ("prefill", 1)):
    for with_adapters in ((False, True) if lora else (False,)):
        result[f"{kind} {'adapters' if with_adapters else 'base'}"] = [timed(work[kind], tokens, with_adapters) for _ in range(rounds)]
for seqs in (work["sweep"] if ops == "batchllm" else []):  # one decode step at this many sequences: (65 tokens - 1 token) / 64
    result[f"step {seqs} {'adapters' if lora else 'base'}"] = [
        (timed(work["decode"][:seqs], 65, lora) - timed(work["decode"][:seqs], 1, lora)) / 64 for _ in range(rounds)]
print("TIMES " + json.dumps(result))
"""


SWEEP = (1, 8, 48)  # decode batches whose one step is timed apart: what LoRA adds a step, against what it adds a sequence


def workloads(count: int) -> tuple[list[str], list[str]]:
    prompts = pq.read_table(REPO / "profiles" / "prompts" / "first_turns.parquet").column("prompt").to_pylist()
    decode = [p[:200] for p in prompts[:count]]
    long_texts = [p for p in prompts if len(p) >= 900]
    prefill = [(p + " " + q)[:2400] for p, q in zip(long_texts[:count], reversed(long_texts))]  # ~600 tokens each
    return decode, prefill


def run_engine(model: Path, lora: bool, work: dict, rounds: int, ops: str = "batchllm") -> dict[str, list[float]]:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", ENGINE, str(model), engine_dtype("cpu") or "auto", "lora" if lora else "off",
                           str(rounds), ops], input=json.dumps(work), env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"engine ({'lora' if lora else 'off'}, {ops}'s ops) exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("TIMES ")).removeprefix("TIMES "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    args = parser.parse_args()
    model = SMOLLM2_135M.prepare(batchllm_home())
    config = json.loads((model / "config.json").read_text())
    decode, prefill = workloads(args.requests)
    with tempfile.TemporaryDirectory(prefix="lora-cost-") as scratch:
        adapters = [str(make_lora_adapter(Path(scratch) / f"a{k}", config, seed=k, rank=8)) for k in range(3)]
        work = {"decode": decode, "prefill": prefill, "decode_tokens": args.decode_tokens, "adapters": adapters,
                "sweep": [n for n in SWEEP if n <= args.requests]}
        every = {f"off {k}": v for k, v in run_engine(model, False, work, args.rounds).items()}
        for ops in ("vllm", "batchllm"):
            every.update({f"on {k} ({ops})": v for k, v in run_engine(model, True, work, args.rounds, ops).items()})
    median = {name: statistics.median(times) for name, times in every.items()}
    lines = [f"{args.requests} requests a workload, {args.rounds} rounds, smollm2-135m on cpu:2, {host_line()}"]
    lines += [f"LoRA {name:<33} median {s:7.2f} s  ({', '.join(f'{x:.2f}' for x in every[name])})" for name, s in median.items()]
    for seqs in [n for n in SWEEP if n <= args.requests]:
        base_s, adapters_s = median[f"off step {seqs} base"], median[f"on step {seqs} adapters (batchllm)"]
        lines.append(f"decode step at {seqs:>2} sequences: base {base_s * 1000:6.1f} ms, adapters {adapters_s * 1000:6.1f} ms "
                     f"(+{(adapters_s - base_s) * 1000:.1f} ms, {adapters_s / base_s:.2f}x)")
    for ops, label in (("vllm", "lora steps (vLLM's ops)"), ("batchllm", "lora steps")):
        decode_x = median[f"on decode adapters ({ops})"] / median["off decode base"]
        prefill_x = median[f"on prefill adapters ({ops})"] / median["off prefill base"]
        base_x = statistics.median([median[f"on decode base ({ops})"] / median["off decode base"],
                                    median[f"on prefill base ({ops})"] / median["off prefill base"]])
        lines.append(f"{label}: adapters {decode_x:.2f}x decode, {prefill_x:.2f}x prefill; base requests on a LoRA engine {base_x:.2f}x")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
