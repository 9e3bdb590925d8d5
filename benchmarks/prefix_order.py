"""Prefix-cache hits and wall time of three request orders on the real engine.

    .venv/bin/python benchmarks/prefix_order.py [--kv-tokens 3000] [--tokens 60000]   (~30 min on 2 cores)

Workloads, from the real ShareGPT text in profiles/prompts/ (shuffled with a fixed seed):
  multi-turn   every human turn of multi-turn conversations as a request, each holding
               all earlier turns (as one completion text);
  multi-turn-messages  the same conversations as chats (`messages:` turns rendered by the
               model's chat template, as a DAG node with `messages:` sends them);
  shared-docs  several questions over each of a few long texts.
--workloads NAME,... runs only those.
Each workload holds at least 5x the engine's KV cache in prompt tokens (the cache is
shrunk with kv_cache_memory_bytes), which is the normal offline case. Orders:
  given        as shuffled; with two replicas dealt out alternately;
  sorted       plain token-sorted; with two replicas cut into halves by count;
  batchllm     batchllm.ordering (groups in depth-first order, length buckets, groups
               split across replicas by work at their shallowest branch).
One replica runs on core 0; two data-parallel replicas on cores 0 and 1. Each run starts
fresh engines (an empty prefix cache). Cached tokens come from the engine's own
counters; the ideal is an unbounded cache in the best order, at the engine's block size.
First, on the otherwise idle machine, the time to order 100,000 prompts made from each
workload's (its prompts again and again, each copy with its own last token), and whether
the C accelerator hashed the blocks (without a C compiler at install, Python does: ~3x slower).
"""

from __future__ import annotations

import argparse
import random
import re
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
from batchllm.models.tokens import PromptTokenizer  # noqa: E402
from batchllm.ordering.prefix_tree import BLOCK_IDS_IN, PrefixTree  # noqa: E402
from batchllm.ordering.request_order import order_requests  # noqa: E402

PROMPTS = Path(__file__).resolve().parent.parent / "profiles" / "prompts"
RESULTS = Path(__file__).resolve().parent / "results"  # engine logs
DTYPE = engine_dtype("cpu")
# Embedded model: 2 (K and V) x 30 layers x 3 KV heads x 64 dims, 2 bytes each in bfloat16
# (1 GiB measured to hold 46,592 tokens), 4 in float32.
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * (4 if DTYPE == "float32" else 2)
MAX_MODEL_LEN = 2048
MAX_TOKENS = 4
ORDERING_PROMPTS = 100_000  # the ordering-time target is per 100,000 prompts


def multi_turn_texts() -> list[str]:
    texts = []
    for row in pq.read_table(PROMPTS / "multi_turn.parquet").to_pylist():
        parts = row["prompt"].split("\n\nHUMAN: ")
        for k in range(1, len(parts) + 1):
            texts.append("\n\nHUMAN: ".join(parts[:k]) + "\n\nASSISTANT:")
    return texts


def multi_turn_chats() -> list[tuple[tuple[str, str], ...]]:
    """The same conversations as chats: every prefix that ends at a human turn."""
    chats = []
    for row in pq.read_table(PROMPTS / "multi_turn.parquet").to_pylist():
        turns = re.split(r"(?:^|\n\n)(HUMAN|GPT): ", row["prompt"])[1:]
        messages = tuple(("user" if who == "HUMAN" else "assistant", text) for who, text in zip(turns[::2], turns[1::2]))
        chats.extend(messages[:k + 1] for k, (role, _) in enumerate(messages) if role == "user")
    return chats


def shared_doc_texts() -> list[str]:
    documents = [r["prompt"] for r in pq.read_table(PROMPTS / "multi_turn.parquet").to_pylist() if len(r["prompt"]) > 4500]
    questions = [r["prompt"] for r in pq.read_table(PROMPTS / "first_turns.parquet").to_pylist() if len(r["prompt"]) < 300]
    rng = random.Random(1)
    return [f"Read this text.\n\n{doc}\n\nQuestion: {q}\nAnswer:" for doc in documents[:40] for q in rng.sample(questions, 6)]


def workload(texts: list, tokenizer: PromptTokenizer, target_tokens: int, seed: int) -> list[tuple[object, list[int]]]:
    """Whole groups of texts (a conversation's turns, a document's questions) until the
    token target, shuffled."""
    picked, total = [], 0
    for text in texts:
        ids = tokenizer.token_ids(_request("x", text))
        if len(ids) > MAX_MODEL_LEN - MAX_TOKENS - 8:
            continue
        picked.append((text, ids))
        total += len(ids)
        if total >= target_tokens:
            break
    random.Random(seed).shuffle(picked)
    return picked


def _request(request_id: str, prompt: str | tuple) -> EngineRequest:
    """A completion text, or a chat's messages (rendered by the chat template)."""
    sampling = SamplingSpec(max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0, seed=0, n=1)
    if isinstance(prompt, tuple):
        return EngineRequest(request_id=request_id, prompt="", chat=True, sampling=sampling, messages=prompt)
    return EngineRequest(request_id=request_id, prompt=prompt, system=None, chat=False, sampling=sampling)


def orders(items: list[tuple[str, list[int]]], replicas: int, block_size: int) -> dict[str, list[list[int]]]:
    count = len(items)
    given = [list(range(r, count, replicas)) for r in range(replicas)]
    ranked = sorted(range(count), key=lambda i: items[i][1])
    half = -(-count // replicas)
    plain = [ranked[r * half:(r + 1) * half] for r in range(replicas)]
    ours = order_requests([ids for _, ids in items], block_size=block_size, replicas=replicas).replicas
    return {"given": given, "sorted": plain, "batchllm": ours}


def run_once(model_dir: str, items, assignment: list[list[int]], kv_tokens: int) -> tuple[float, int]:
    """Wall time (first submit to last result) and engine-counted cached tokens."""
    configs = [EngineConfig(model=model_dir, replica=Replica("cpu", (core,)), max_model_len=MAX_MODEL_LEN,
                            kv_cache_memory_bytes=int(kv_tokens * KV_BYTES_PER_TOKEN), enforce_eager=True, dtype=DTYPE,
                            log_path=str(RESULTS / f"engine-prefix-core{core}.log"))
               for core in range(len(assignment))]
    engines = [start_vllm_engine(config) for config in configs]  # from this thread: they load side by side
    for engine in engines:
        engine.ready  # noqa: B018  wait until loaded
    try:
        started = time.perf_counter()
        for engine, indices in zip(engines, assignment):
            engine.submit([_request(str(i), items[i][0]) for i in indices])
        pending = {r: len(indices) for r, indices in enumerate(assignment)}
        cached = 0
        while any(pending.values()):
            for r, engine in enumerate(engines):
                if pending[r]:
                    pending[r] -= len(engine.poll(timeout_s=0.2))
        wall_s = time.perf_counter() - started
        for engine in engines:
            cached += sum(step.prefix_hits for step in engine.drain_steps())
        return wall_s, cached
    finally:
        for engine in engines:
            engine.stop()


def ordering_time_s(prompts: list[list[int]], count: int, replicas: int, block_size: int) -> float:
    """Time to order `count` prompts: the workload's prompts again and again, each copy
    with its own last token (so shared prefixes are as in the real prompts)."""
    many = [prompts[i % len(prompts)][:-1] + [i] for i in range(count)]
    started = time.perf_counter()
    order_requests(many, block_size=block_size, replicas=replicas)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-tokens", type=int, default=3000, help="KV cache size given to each engine, in tokens")
    parser.add_argument("--tokens", type=int, default=60000, help="prompt tokens per workload (>= 5x --kv-tokens)")
    parser.add_argument("--workloads", default="multi-turn,multi-turn-messages,shared-docs", help="which workloads, comma-separated")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    home = batchllm_home()
    model_dir = resolve_model("smollm2-135m", dag_dir=Path.cwd(), home=home, where="benchmark").materialise(home)
    tokenizer = PromptTokenizer(model_dir)
    block_size = 128  # vLLM CPU's block size, also in the measured profile
    worst_speedup, worst_share, longest_order_s = float("inf"), 1.0, 0.0
    sources = {"multi-turn": multi_turn_texts, "multi-turn-messages": multi_turn_chats, "shared-docs": shared_doc_texts}
    workloads = {name: workload(sources[name](), tokenizer, args.tokens, seed=7) for name in args.workloads.split(",")}
    for name, items in workloads.items():  # before any engine runs: the machine is otherwise idle
        times = {r: ordering_time_s([ids for _, ids in items], ORDERING_PROMPTS, r, block_size) for r in (1, 2)}
        mean_tokens = sum(len(ids) for _, ids in items) / len(items)
        print(f"ordering {ORDERING_PROMPTS:,} prompts like {name}'s (mean {mean_tokens:.0f} tokens, block ids hashed in "
              f"{BLOCK_IDS_IN}): {times[1]:.2f} s for 1 replica, {times[2]:.2f} s for 2", flush=True)
        longest_order_s = max(longest_order_s, *times.values())
    print(f"KV cache {args.kv_tokens:,} tokens per engine; workloads of >= {args.tokens:,} prompt tokens; max_tokens {MAX_TOKENS}")
    print(f"{'workload':19} {'replicas':>8} {'order':9} {'requests':>8} {'prompt tok':>10} {'cached':>8} {'ideal':>8} "
          f"{'cached/ideal':>12} {'wall s':>8} {'speed-up':>8}")
    for name, items in workloads.items():
        prompt_tokens = sum(len(ids) for _, ids in items)
        ideal = PrefixTree([ids for _, ids in items], block_size).ideal_cached_tokens()
        for replicas in (1, 2):
            plans = orders(items, replicas, block_size)
            walls = {}
            for order, assignment in plans.items():
                wall_s, cached = run_once(model_dir, items, assignment, args.kv_tokens)
                walls[order] = wall_s
                speedup = walls["given"] / wall_s
                print(f"{name:19} {replicas:8} {order:9} {len(items):8} {prompt_tokens:10,} {cached:8,} {ideal:8,} "
                      f"{cached / ideal:12.1%} {wall_s:8.1f} {speedup:7.2f}x", flush=True)
                if order == "batchllm":
                    worst_speedup, worst_share = min(worst_speedup, speedup), min(worst_share, cached / ideal)
    print("speed-up: the given order's wall time / this order's, same workload and replicas")
    print(f"batchllm's order: worst cached/ideal {worst_share:.1%}; ordering {ORDERING_PROMPTS:,} prompts at most "
          f"{longest_order_s:.2f} s; worst speed-up over the given order {worst_speedup:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
