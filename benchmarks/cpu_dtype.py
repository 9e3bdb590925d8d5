"""The CPU engine's dtype: float32 against bfloat16 weights on this host's cores, side by side.

    .venv/bin/python benchmarks/cpu_dtype.py [--rounds 2] [--out FILE]

vLLM's own `LLM` on the embedded smollm2-135m, one core (as one replica of batchllm's plans
runs), in a fresh process per measurement, the two dtypes in turns (the order swapped each
round). Each process times, after the engine is up: a prefill-bound job (12 ShareGPT chats,
16 tokens each) and a decode-bound one (4 of them, 128 tokens each, end-of-sequence ignored).
The last line: `float32: <p>x bfloat16's speed in prefill, <d>x in decode` (above 1: float32
is faster). batchllm picks float32 wherever the CPU has no bfloat16 arithmetic
(engines/hardware.py: cpu_engine_dtype); this is the measurement behind that rule.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.reporting import publish  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROMPTS = REPO / "profiles" / "prompts" / "first_turns.parquet"
FIRST_ROW = 300

ONE = """
import json, os, sys, time
import pyarrow.parquet as pq
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, dtype, prompts_path, first = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
llm = LLM(model=model, dtype=dtype, enforce_eager=True, kv_cache_memory_bytes=1 << 30, seed=0)
tokenizer = llm.get_tokenizer()
rows = pq.read_table(prompts_path).slice(first, 12).to_pylist()
prompts = [TokensPrompt(prompt_token_ids=tokenizer.encode(tokenizer.apply_chat_template(
    [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False), add_special_tokens=False)[:512])
    for r in rows]
llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # the first call's own costs apart
started = time.perf_counter()
llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
prefill = time.perf_counter() - started
started = time.perf_counter()
llm.generate(prompts[:4], SamplingParams(max_tokens=128, temperature=0, ignore_eos=True), use_tqdm=False)
decode = time.perf_counter() - started
print(json.dumps({"prefill_s": prefill, "decode_s": decode}))
"""


def measure(model: Path, dtype: str) -> dict[str, float]:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", ONE, str(model), dtype, str(PROMPTS), str(FIRST_ROW)], env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the {dtype} engine failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from batchllm.engines.hardware import this_machine
    from batchllm.models.embedded import SMOLLM2_135M
    from batchllm.models.registry import batchllm_home

    machine = this_machine("cpu")
    model = SMOLLM2_135M.prepare(batchllm_home())
    lines = [f"CPU engine dtype: {machine.name}, flags {', '.join(machine.cpu_flags or ())}, one core, smollm2-135m, "
             f"{args.rounds} rounds; batchllm's rule picks {machine.dtype} here"]
    times: dict[str, list[dict[str, float]]] = {"float32": [], "bfloat16": []}
    for round_ in range(args.rounds):
        for dtype in (["float32", "bfloat16"] if round_ % 2 == 0 else ["bfloat16", "float32"]):
            times[dtype].append(measure(model, dtype))
            lines.append(f"round {round_ + 1}: {dtype} prefill {times[dtype][-1]['prefill_s']:.2f} s, "
                         f"decode {times[dtype][-1]['decode_s']:.2f} s")
            print(lines[-1], flush=True)
    median = {dtype: {part: statistics.median(t[part] for t in runs) for part in ("prefill_s", "decode_s")} for dtype, runs in times.items()}
    lines.append(f"float32: {median['bfloat16']['prefill_s'] / median['float32']['prefill_s']:.2f}x bfloat16's speed in prefill, "
                 f"{median['bfloat16']['decode_s'] / median['float32']['decode_s']:.2f}x in decode")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
