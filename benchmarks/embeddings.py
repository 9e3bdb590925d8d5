"""Embeddings: batchllm against vLLM's own `run-batch` on the same texts and cores.

    .venv/bin/python benchmarks/embeddings.py [--texts 3000] [--rounds 2] [--out FILE]

The texts are real ShareGPT prompts of several lengths (profiles/prompts: 1,400 first turns
and multi-turn chats, each whole (cut at 1,500 characters) and cut to its first 200
characters), those within the model's 256 tokens (its sentence-transformers `max_seq_length`,
which vLLM takes as its context length; a longer text fails on both sides alike). Three whole commands run them with the
embedded `minilm-l6`, in turns, round after round so the machine's noise falls on all alike:

- `batchllm run` of a DAG with one embed node over a Parquet file of the texts;
- `batchllm run-batch` of a file of `/v1/embeddings` lines;
- `python -m vllm.entrypoints.openai.run_batch` of the same file (its engine on both cores,
  float32 where batchllm's is, eager, as batchllm's engines run here).

Each command's median wall time (start to exit: imports, engine start and all) and the
smallest cosine between batchllm's vectors and vLLM's, per text. The last line:
`embeddings: batchllm <a>x vLLM's run-batch, vectors equal (min cosine <c>)`, with `a` vLLM's
time over `batchllm run-batch`'s (above 1: batchllm is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchllm.core.requests import EngineRequest  # noqa: E402
from batchllm.engines.devices import engine_dtype  # noqa: E402
from batchllm.models.embedded import MINILM_L6  # noqa: E402
from batchllm.models.registry import batchllm_home  # noqa: E402
from batchllm.models.tokens import PromptTokenizer  # noqa: E402
from benchmarks.reporting import publish  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BATCHLLM = str(Path(sys.executable).parent / "batchllm")
MAX_CHARS, SHORT_CHARS, MAX_TOKENS = 1500, 200, 256


def texts(count: int, model_dir: Path) -> list[str]:
    prompts = [p for name in ("first_turns", "multi_turn")
               for p in pq.read_table(REPO / "profiles" / "prompts" / f"{name}.parquet").column("prompt").to_pylist()]
    candidates = [p[:MAX_CHARS] for p in prompts] + [p[:SHORT_CHARS] for p in prompts]
    tokens = PromptTokenizer(model_dir).token_ids_many([EngineRequest(str(k), t, chat=False) for k, t in enumerate(candidates)])
    return [text for text, ids in zip(candidates, tokens) if len(ids) <= MAX_TOKENS][:count]


def write_inputs(folder: Path, items: list[str]) -> tuple[Path, Path]:
    pq.write_table(pa.table({"id": [f"t{k}" for k in range(len(items))], "text": items}), folder / "texts.parquet")
    dag = folder / "embed.yaml"
    dag.write_text("inputs:\n  texts: {path: texts.parquet, id_column: id}\n"
                   "nodes:\n  embedded:\n    model: minilm-l6\n    task: embed\n    prompt: '{{ text }}'\n"
                   "outputs:\n  vectors:\n    columns: {vector: embedded}\n")
    requests = folder / "requests.jsonl"
    requests.write_text("".join(json.dumps({"custom_id": f"t{k}", "method": "POST", "url": "/v1/embeddings",
                                            "body": {"model": "minilm", "input": text}}) + "\n" for k, text in enumerate(items)))
    return dag, requests


def timed(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:3])} ... exited {done.returncode}:\n{done.stderr[-3000:]}")
    return wall_s


def batch_vectors(path: Path) -> dict[str, np.ndarray]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    failed = [line["custom_id"] for line in lines if line["error"] is not None]
    if failed:
        raise SystemExit(f"{path.name}: {len(failed)} lines failed, e.g. {failed[0]}")
    return {line["custom_id"]: np.array(line["response"]["body"]["data"][0]["embedding"], np.float32) for line in lines}


def min_cosine(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> float:
    assert sorted(ours) == sorted(theirs), "the two sides embedded different texts"
    a, b = np.stack([ours[k] for k in sorted(ours)]), np.stack([theirs[k] for k in sorted(ours)])
    return float(((a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=3000, help="at most this many (those that fit the model: 2,267)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    args = parser.parse_args()
    home = batchllm_home()
    model_dir = MINILM_L6.prepare(home)
    items = texts(args.texts, model_dir)
    env = {**os.environ, "BATCHLLM_HOME": str(home)}
    vllm_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    walls: dict[str, list[float]] = {"batchllm run (embed node)": [], "batchllm run-batch": [], "vLLM run-batch": []}
    with tempfile.TemporaryDirectory(prefix="embeddings-bench-") as scratch:
        folder = Path(scratch)
        dag, requests = write_inputs(folder, items)
        for round_ in range(args.rounds):
            walls["batchllm run (embed node)"].append(timed([BATCHLLM, "run", str(dag), "--out", str(folder / "dag-run"), "--fresh",
                                                             "--devices", "cpu:2"], env))
            walls["batchllm run-batch"].append(timed([BATCHLLM, "run-batch", "-i", str(requests), "-o", str(folder / "ours.jsonl"),
                                                      "--run-dir", str(folder / "batch-run"), "--fresh", "--devices", "cpu:2",
                                                      "--model", f"minilm={MINILM_L6.name}"], env))
            walls["vLLM run-batch"].append(timed([sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(requests),
                                                  "-o", str(folder / "theirs.jsonl"), "--model", str(model_dir),
                                                  "--served-model-name", "minilm", "--runner", "pooling", "--enforce-eager",
                                                  "--dtype", engine_dtype("cpu") or "auto", "--seed", "0"], vllm_env))
            print(f"round {round_ + 1}: " + ", ".join(f"{name} {w[-1]:.1f} s" for name, w in walls.items()), flush=True)
        theirs = batch_vectors(folder / "theirs.jsonl")
        cosine_batch = min_cosine(batch_vectors(folder / "ours.jsonl"), theirs)
        table = pq.read_table(folder / "dag-run" / "vectors.parquet")
        node = dict(zip(table.column("row_id").to_pylist(), np.array(table.column("vector").to_pylist(), np.float32)))
        cosine_node = min_cosine(node, theirs)
    medians = {name: statistics.median(w) for name, w in walls.items()}
    vllm_s = medians["vLLM run-batch"]
    lines = [f"{len(items)} texts ({sum(map(len, items)):,} characters), all-MiniLM-L6-v2 on cpu:2, {args.rounds} rounds in turns"]
    lines += [f"{name:<28} median {s:7.1f} s   vLLM's run-batch / this: {vllm_s / s:.2f}x" for name, s in medians.items()]
    lines.append(f"min cosine to vLLM's vectors: run-batch {cosine_batch:.6f}, embed node {cosine_node:.6f}")
    lines.append(f"embeddings: batchllm {vllm_s / medians['batchllm run-batch']:.2f}x vLLM's run-batch, vectors equal "
                 f"(min cosine {min(cosine_batch, cosine_node):.6f})")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
