"""Real output lengths of the embedded model on five prompt sets of different kinds: the
data benchmarks/length_model.py trains and tests the per-request length model on.

    .venv/bin/python benchmarks/length_sets.py [--per-set 350] [--sets a,b]   (~20-40 min on 2 cores)

Sets (each ~350 prompts; chat template; max_tokens 256, temperature 0):
  sharegpt      real ShareGPT first human turns (profiles/prompts/first_turns.parquet)
  multi-turn    real ShareGPT conversations up to a human turn: that turn is the last user
                turn, the earlier turns ride along as history (multi_turn.parquet)
  short-answer  short-answer tasks (the calibration benchmark's numbers prompts, one word,
                yes/no, sums, one-sentence definitions)
  long-form     essays, stories, letters, poems ("write a 300-word essay about ...")
  code          "write a Python function that ...", SQL, explanations of snippets

Two engines, one per core (data parallel). Results are cached set by set in
benchmarks/data/length_sets.parquet (the prompt fields, the set, output_tokens and finished;
not the texts): sets already there are not run again.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from batchllm.core.requests import EngineRequest, FinishReason  # noqa: E402
from batchllm.core.sampling import SamplingSpec  # noqa: E402
from batchllm.engines.devices import Replica, engine_dtype  # noqa: E402
from batchllm.engines.process_engine import start_vllm_engine  # noqa: E402
from batchllm.engines.protocol import EngineConfig  # noqa: E402
from batchllm.models.registry import batchllm_home, resolve_model  # noqa: E402

PROMPTS = REPO / "profiles" / "prompts"
OUT = REPO / "benchmarks" / "data" / "length_sets.parquet"
LOGS = REPO / "benchmarks" / "results"
MAX_TOKENS = 256
MAX_MODEL_LEN = 2048
HISTORY_CHARS = 4500  # earlier turns kept (from the end) so prompts fit the context

TOPICS = ["climate change", "the French Revolution", "photosynthesis", "black holes", "social media", "the printing press",
          "remote work", "artificial intelligence", "the ocean", "friendship", "coffee", "the Roman Empire", "vaccines",
          "electric cars", "honeybees", "the internet", "democracy", "volcanoes", "music education", "space exploration",
          "recycling", "the moon", "chess", "urban gardening", "sleep", "the stock market", "ancient Egypt", "rainforests",
          "video games", "public libraries", "renewable energy", "the human brain", "mountains", "tea", "bicycles"]
COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "India", "Italy", "Mexico", "Egypt", "Norway", "Australia",
             "Peru", "Germany", "Spain", "Thailand", "Argentina", "Sweden", "Nigeria", "Vietnam", "Greece"]
WORDS = ["happy", "big", "fast", "cold", "smart", "angry", "quiet", "bright", "old", "strong", "tiny", "brave", "rich", "calm"]
CHARACTERS = ["a lonely robot", "a young wizard", "an old fisherman", "a curious cat", "a time traveller", "a detective",
              "a girl who can talk to birds", "a retired astronaut", "a baker", "a dragon"]
EVENTS = ["finds a mysterious map", "loses their memory", "meets a stranger on a train", "discovers a hidden door",
          "wins a lottery", "gets lost in a forest", "builds a machine", "receives a letter from the future"]
FUNCS = ["reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
         "merges two sorted lists", "counts the words in a text", "removes duplicates from a list while keeping order",
         "computes the factorial of n", "finds the largest element in a list", "converts Celsius to Fahrenheit",
         "checks whether a string is a palindrome", "flattens a nested list", "parses a CSV file into a list of dicts",
         "validates an email address with a regular expression", "implements binary search",
         "sorts a list of dictionaries by a key", "reads a JSON file and prints its keys", "computes the GCD of two numbers",
         "returns the most common word in a text", "implements a stack with push and pop", "downloads a web page"]
SQL = ["lists the ten customers with the most orders", "finds employees earning more than their manager",
       "counts orders per month in 2023", "deletes duplicate rows from a table", "joins orders with customers"]
SNIPPETS = ["[x * x for x in range(10) if x % 2]", "sorted(d.items(), key=lambda kv: -kv[1])[:3]",
            "with open('f.txt') as f: lines = f.read().splitlines()", "sum(map(int, str(n)))", "dict(zip(keys, values))",
            "' '.join(reversed(s.split()))", "any(c.isdigit() for c in password)", "collections.Counter(words).most_common(1)"]
BUILTINS = ["zip", "enumerate", "map", "filter", "sorted", "any", "all", "isinstance", "range", "len", "getattr"]


def short_answer(rng: random.Random, count: int) -> list[str]:
    makers = [
        lambda i: f"Write a short sentence about the number {i}.",
        lambda i: f"What is the capital of {rng.choice(COUNTRIES)}? Answer in one word.",
        lambda i: f"Is {rng.randint(2, 999)} an even number? Answer yes or no.",
        lambda i: f"What is {rng.randint(2, 99)} + {rng.randint(2, 99)}? Reply with the number only.",
        lambda i: f"In one sentence, what is {rng.choice(TOPICS)}?",
        lambda i: f"Give a synonym for the word '{rng.choice(WORDS)}'. Reply with one word only.",
        lambda i: f"Name one famous person from {rng.choice(COUNTRIES)}.",
        lambda i: f"Briefly, what is {rng.choice(TOPICS)} known for?",
        lambda i: f"What is the opposite of '{rng.choice(WORDS)}'?",
        lambda i: f"Translate '{rng.choice(WORDS)}' into French. One word.",
    ]
    return [makers[i % len(makers)](i) for i in range(count)]


def long_form(rng: random.Random, count: int) -> list[str]:
    makers = [
        lambda: f"Write a {rng.choice([100, 200, 300, 500])}-word essay about {rng.choice(TOPICS)}.",
        lambda: f"Write a short story about {rng.choice(CHARACTERS)} who {rng.choice(EVENTS)}.",
        lambda: f"Write a poem about {rng.choice(TOPICS)}.",
        lambda: f"Write a haiku about {rng.choice(TOPICS)}.",
        lambda: f"Explain {rng.choice(TOPICS)} in detail, step by step.",
        lambda: f"Write a letter to a friend about {rng.choice(TOPICS)}.",
        lambda: f"Write a blog post about {rng.choice(TOPICS)}.",
        lambda: f"Write a two-sentence horror story about {rng.choice(TOPICS)}.",
        lambda: f"Write a {rng.choice([3, 5])}-paragraph essay on {rng.choice(TOPICS)}.",
        lambda: f"List {rng.choice([3, 5, 10])} interesting facts about {rng.choice(TOPICS)}.",
        lambda: f"Write a limerick about {rng.choice(CHARACTERS)}.",
        lambda: f"Describe {rng.choice(TOPICS)} to a five-year-old in a few sentences.",
    ]
    return [makers[i % len(makers)]() for i in range(count)]


def code(rng: random.Random, count: int) -> list[str]:
    makers = [
        lambda: f"Write a Python function that {rng.choice(FUNCS)}.",
        lambda: f"Write a JavaScript function that {rng.choice(FUNCS)}.",
        lambda: f"Write a Python one-liner that {rng.choice(FUNCS)}. Only the code.",
        lambda: f"Write a SQL query that {rng.choice(SQL)}.",
        lambda: f"Explain what this Python code does: `{rng.choice(SNIPPETS)}`",
        lambda: f"Write a Python class that {rng.choice(FUNCS)}, with docstrings and unit tests.",
        lambda: f"What does the Python built-in `{rng.choice(BUILTINS)}` do? Answer in one sentence.",
        lambda: f"Write a Python function that {rng.choice(FUNCS)}, and explain it step by step.",
        lambda: "Fix the bug in this Python code: `def add(a, b): return a - b`",
        lambda: f"Write a bash command that {rng.choice(['counts lines in all .py files', 'finds large files', 'lists open ports', 'renames all .txt files to .md'])}.",
    ]
    return [makers[i % len(makers)]() for i in range(count)]


def sharegpt(count: int) -> list[str]:
    texts = pq.read_table(PROMPTS / "first_turns.parquet").column("prompt").to_pylist()
    return [t for t in texts if 5 <= len(t.strip()) <= 4000][:count]


def multi_turn(count: int) -> list[tuple[tuple[str, str], ...]]:
    """Each conversation up to its last human turn, earlier turns cut from the front."""
    chats = []
    for row in pq.read_table(PROMPTS / "multi_turn.parquet").to_pylist():
        turns = re.split(r"(?:^|\n\n)(HUMAN|GPT): ", row["prompt"])[1:]
        messages = [("user" if who == "HUMAN" else "assistant", text) for who, text in zip(turns[::2], turns[1::2])]
        while messages and messages[-1][0] != "user":
            messages.pop()
        if len(messages) < 3 or len(messages[-1][1]) > 3000:
            continue
        history = messages[:-1]
        while history and (sum(len(t) for _, t in history) > HISTORY_CHARS or history[0][0] != "user"):
            history.pop(0)
        chats.append(tuple(history) + (messages[-1],))
    return chats[:count]


def requests_of(name: str, count: int) -> list[EngineRequest]:
    sampling = SamplingSpec(max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0, seed=0, n=1)
    rng = random.Random(sum(map(ord, name)))
    if name == "multi-turn":
        return [EngineRequest(f"{name}-{i}", "", None, True, sampling, messages=chat) for i, chat in enumerate(multi_turn(count))]
    texts = {"sharegpt": lambda: sharegpt(count), "short-answer": lambda: short_answer(rng, count),
             "long-form": lambda: long_form(rng, count), "code": lambda: code(rng, count)}[name]()
    return [EngineRequest(f"{name}-{i}", text, None, True, sampling) for i, text in enumerate(texts)]


def run(engines, requests: list[EngineRequest]) -> list:
    for r, engine in enumerate(engines):
        engine.submit(requests[r::len(engines)])
    results = []
    while len(results) < len(requests):
        for engine in engines:
            results.extend(engine.poll(timeout_s=0.2))
    return results


def rows_of(name: str, requests: list[EngineRequest], results: list) -> list[dict]:
    by_id = {r.request_id: r for r in results}
    rows = []
    for request in requests:
        result = by_id[request.request_id]
        if result.is_error:
            continue
        if request.messages is not None:
            last_user, history = request.messages[-1][1], request.messages[:-1]
        else:
            last_user, history = request.prompt, ()
        rows.append({"set": name, "id": request.request_id, "last_user": last_user, "system": request.system or "",
                     "history_chars": sum(len(t) for _, t in history), "history_turns": len(history),
                     "template": name, "prompt_tokens": result.num_prompt_tokens, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                     "output_tokens": result.num_output_tokens, "finished": result.finish_reason is not FinishReason.LENGTH})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-set", type=int, default=350)
    parser.add_argument("--sets", default="short-answer,code,long-form,sharegpt,multi-turn")
    args = parser.parse_args()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    LOGS.mkdir(exist_ok=True)
    done = pq.read_table(OUT).to_pylist() if OUT.exists() else []
    todo = [s for s in args.sets.split(",") if s not in {r["set"] for r in done}]
    if not todo:
        print("all sets cached in", OUT)
        return 0
    home = batchllm_home()
    model_dir = resolve_model("smollm2-135m", dag_dir=Path.cwd(), home=home, where="benchmark").materialise(home)
    configs = [EngineConfig(model=model_dir, replica=Replica("cpu", (core,)), max_model_len=MAX_MODEL_LEN,
                            kv_cache_memory_bytes=1 << 30, enforce_eager=True, dtype=engine_dtype("cpu"),
                            log_path=str(LOGS / f"engine-length-sets-core{core}.log")) for core in (0, 1)]
    engines = [start_vllm_engine(config) for config in configs]
    for engine in engines:
        engine.ready  # noqa: B018  wait until loaded
    try:
        for name in todo:
            requests = requests_of(name, args.per_set)
            started = time.perf_counter()
            rows = rows_of(name, requests, run(engines, requests))
            done.extend(rows)
            pq.write_table(pa.Table.from_pylist(done), OUT.with_suffix(".tmp"))
            OUT.with_suffix(".tmp").replace(OUT)
            tokens = sum(r["output_tokens"] for r in rows)
            print(f"{name}: {len(rows)} outputs, {tokens:,} tokens ({tokens / len(rows):.0f} mean, "
                  f"{sum(not r['finished'] for r in rows) / len(rows):.0%} cut at {MAX_TOKENS}) in {time.perf_counter() - started:.0f} s",
                  flush=True)
    finally:
        for engine in engines:
            engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
