"""The first engine step and the whole command: batchllm run-batch, vLLM's own run-batch, Ray Data LLM.

    .venv/bin/python benchmarks/first_step.py [--requests 203] [--rounds 3] [--out FILE] [--no-ray]

The same OpenAI batch file (ShareGPT first turns, profiles/prompts/first_turns.parquet rows
600-803, a slice no test uses; chat requests for the embedded smollm2-135m, max_tokens 96,
temperature 0) through each tool as a whole command, in turns on the same cores (the order
rotated each round), after one uncounted run of each (a user's second command: verdicts,
kept engines and the OS's file cache in place):

- `batchllm run-batch -i FILE -o OUT --no-reuse` (every request computed), a fresh run folder;
- `python -m vllm.entrypoints.openai.run_batch` of the file, its engine on both cores;
- Ray Data LLM: `vLLMEngineProcessorConfig` + `build_processor`, one engine actor on both cores
  (`ray.init(num_cpus=8)`: its chat-template and tokenize stages hold a logical CPU each).

Each engine runs the dtype batchllm picks for this CPU, eager, with a 1 GiB KV cache. The time to
the first engine step is read from vLLM's own per-iteration log line (`Iteration(0)`, which
vLLM writes as that step ends; its clock has whole seconds), less the command's start.
The last line: `first step: batchllm <s> s, vLLM run-batch <v> s; whole command <r>x vLLM's,
<q>x Ray Data LLM's` (r, q: their whole time over batchllm's).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.batch_files import sharegpt_chat_file  # noqa: E402
from benchmarks.reporting import publish  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BATCHLLM = str(Path(sys.executable).parent / "batchllm")
FIRST_ROW, MAX_TOKENS = 600, 96
FIRST_STEP = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d) \[loggers\.py:\d+\] Engine \d+: Iteration\(0\)")

RAY_DATA = """
import json, sys
import ray
from ray.data.llm import build_processor, vLLMEngineProcessorConfig
requests, output, model, dtype, temp = sys.argv[1:6]
lines = [json.loads(line) for line in open(requests)]
ray.init(num_cpus=8, include_dashboard=False, log_to_driver=True, _temp_dir=temp)
config = vLLMEngineProcessorConfig(
    model_source=model, concurrency=1, batch_size=64, log_engine_metrics=False,
    placement_group_config={"bundles": [{"CPU": 1}]},
    engine_kwargs=dict(enforce_eager=True, dtype=dtype, kv_cache_memory_bytes=1 << 30, seed=0,
                       enable_logging_iteration_details=True, disable_log_stats=False),
    runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}})
processor = build_processor(
    config,
    preprocess=lambda row: dict(custom_id=row["custom_id"], messages=row["messages"],
                                sampling_params=dict(temperature=0, max_tokens=row["max_tokens"])),
    postprocess=lambda row: dict(custom_id=row["custom_id"], text=row["generated_text"]))
rows = [{"custom_id": l["custom_id"], "messages": l["body"]["messages"], "max_tokens": l["body"]["max_tokens"]} for l in lines]
done = processor(ray.data.from_items(rows)).take_all()
with open(output, "w") as handle:
    for row in done:
        handle.write(json.dumps({"custom_id": row["custom_id"], "text": row["text"]}) + "\\n")
ray.shutdown()
"""


def first_step_s(texts: list[str], started_wall: float) -> float | None:
    """Seconds from the command's start to the end of its first engine step, from vLLM's log lines."""
    stamps = [m.group(1) for text in texts for m in FIRST_STEP.finditer(text)]
    if not stamps:
        return None
    year = datetime.fromtimestamp(started_wall).year
    first = min(datetime.strptime(f"{year}-{stamp}", "%Y-%m-%d %H:%M:%S").timestamp() for stamp in stamps)
    return first - started_wall


def run(argv: list[str], env: dict[str, str], log: Path) -> tuple[float, float]:
    """(wall seconds, the wall clock at its start), its output into `log`; exits on a failed command."""
    started_wall, started = time.time(), time.monotonic()
    with open(log, "w") as handle:
        done = subprocess.run(argv, env=env, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=3600)
    took = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{argv[:3]} failed ({done.returncode}): {log.read_text()[-3000:]}")
    return took, started_wall


def batchllm(requests: Path, folder: Path, env: dict[str, str]) -> tuple[float, float | None]:
    took, started_wall = run([BATCHLLM, "run-batch", "-i", str(requests), "-o", str(folder / "out.jsonl"), "--run-dir",
                              str(folder / "run"), "--no-reuse"], env, folder / "command.log")
    logs = [p.read_text(errors="replace") for p in (folder / "run" / ".batchllm" / "logs").glob("engine-*.log")]
    return took, first_step_s(logs, started_wall)


def vllm_run_batch(requests: Path, folder: Path, env: dict[str, str], model: Path, dtype: str) -> tuple[float, float | None]:
    took, started_wall = run([sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(requests), "-o",
                              str(folder / "out.jsonl"), "--model", str(model), "--served-model-name", "smollm2-135m",
                              "--enforce-eager", "--dtype", dtype, "--seed", "0", "--enable-logging-iteration-details"],
                             {**env, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1"}, folder / "command.log")
    return took, first_step_s([(folder / "command.log").read_text(errors="replace")], started_wall)


def ray_data(requests: Path, folder: Path, env: dict[str, str], model: Path, dtype: str) -> tuple[float, float | None]:
    home = folder / "home"  # Ray writes ~/.ray: a home of its own, never the user's
    home.mkdir()
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # a short path: Ray's sockets live under it
    took, started_wall = run([sys.executable, "-c", RAY_DATA, str(requests), str(folder / "out.jsonl"), str(model), dtype, str(temp)],
                             {**env, "HOME": str(home)}, folder / "command.log")
    return took, first_step_s([(folder / "command.log").read_text(errors="replace")], started_wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=203)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-ray", action="store_true", help="leave Ray Data LLM out")
    args = parser.parse_args()
    from batchllm.engines.devices import engine_dtype
    from batchllm.engines.hardware import this_machine
    from batchllm.models.embedded import SMOLLM2_135M
    from batchllm.models.registry import batchllm_home

    home = batchllm_home()
    model, dtype = SMOLLM2_135M.prepare(home), engine_dtype("cpu") or "auto"
    env = {**os.environ, "BATCHLLM_HOME": str(home)}
    machine = this_machine("cpu")
    tools = {"batchllm": lambda r, f: batchllm(r, f, env), "vLLM run-batch": lambda r, f: vllm_run_batch(r, f, env, model, dtype)}
    if not args.no_ray:
        tools["Ray Data LLM"] = lambda r, f: ray_data(r, f, env, model, dtype)
    lines = [f"first engine step: {args.requests} ShareGPT chats (rows {FIRST_ROW}-{FIRST_ROW + args.requests}), max_tokens {MAX_TOKENS}, "
             f"smollm2-135m in {dtype}, {os.cpu_count()} cores ({machine.name}; flags {', '.join(machine.cpu_flags or ())}), "
             f"{args.rounds} rounds after one uncounted run of each"]
    whole: dict[str, list[float]] = {name: [] for name in tools}
    first: dict[str, list[float]] = {name: [] for name in tools}
    with tempfile.TemporaryDirectory(prefix="bench-first-step-") as scratch:
        root = Path(scratch)
        requests = root / "requests.jsonl"
        sharegpt_chat_file(requests, FIRST_ROW, args.requests, MAX_TOKENS)
        names = list(tools)
        for round_ in range(-1, args.rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)] if round_ >= 0 else names
            for name in order:
                folder = root / f"{name.replace(' ', '-')}-{round_ + 1}"
                folder.mkdir()
                took, step = tools[name](requests, folder)
                label = "warm-up" if round_ < 0 else f"round {round_ + 1}"
                lines.append(f"{label}: {name} {took:.1f} s whole, first step {'?' if step is None else f'{step:.0f} s'}")
                print(lines[-1], flush=True)
                if round_ >= 0:
                    whole[name].append(took)
                    if step is not None:
                        first[name].append(step)
    median = {name: statistics.median(v) for name, v in whole.items()}
    step = {name: statistics.median(v) if v else float("nan") for name, v in first.items()}
    for name in tools:
        lines.append(f"{name:<16} whole {median[name]:6.1f} s, first engine step {step[name]:5.1f} s (medians)")
    ray_ratio = f"{median['Ray Data LLM'] / median['batchllm']:.2f}x" if "Ray Data LLM" in median else "(not run)"
    lines.append(f"first step: batchllm {step['batchllm']:.1f} s, vLLM run-batch {step['vLLM run-batch']:.1f} s; whole command "
                 f"{median['vLLM run-batch'] / median['batchllm']:.2f}x vLLM's, {ray_ratio} Ray Data LLM's")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
