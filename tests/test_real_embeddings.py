"""Embeddings on the real engine with the embedded embedding model (all-MiniLM-L6-v2): an embed
node's vectors, and a batch file's `/v1/embeddings` lines, against what vLLM's own
`LLM.embed` gives for the same texts and vLLM's own response models. Slow: marked `engine`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchllm.engines.devices import engine_dtype, parse_devices
from batchllm.models.embedded import MINILM_L6
from batchllm.runtime.launch import run_dag_file

pytestmark = pytest.mark.engine
REPO = Path(__file__).resolve().parent.parent
MODEL_HOME = REPO / ".batchllm-home"  # the prepared models, shared with the other real-engine tests
ROWS = 8  # of the 24 example questions

VLLM_EMBED = """
import json, sys
from vllm import LLM
texts = json.load(sys.stdin)
llm = LLM(model=sys.argv[1], runner="pooling", enforce_eager=True, dtype=sys.argv[2], seed=0)
print("VECTORS " + json.dumps([output.outputs.embedding for output in llm.embed(texts)]))
"""


def vllm_embeddings(model_dir: Path, texts: list[str]) -> np.ndarray:
    """vLLM's own `LLM.embed` of `texts`, in a process of its own, as a user's script runs it."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", VLLM_EMBED, str(model_dir), engine_dtype("cpu") or "auto"], input=json.dumps(texts),
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("VECTORS "))
    return np.array(json.loads(line.removeprefix("VECTORS ")), np.float32)


def cosines(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    return (ours * theirs).sum(axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))


@pytest.fixture(scope="module")
def questions() -> list[str]:
    return pq.read_table(REPO / "examples" / "questions.parquet").column("question").to_pylist()[:ROWS]


@pytest.fixture(scope="module")
def vllms_vectors(questions) -> np.ndarray:
    return vllm_embeddings(MINILM_L6.prepare(MODEL_HOME), questions)


def test_an_embed_node_gives_the_vectors_of_vllms_own_embed(tmp_path, monkeypatch, shared_engines, vllms_vectors):
    monkeypatch.setenv("BATCHLLM_HOME", str(MODEL_HOME))
    pq.write_table(pq.read_table(REPO / "examples" / "questions.parquet").slice(0, ROWS), tmp_path / "questions.parquet")
    dag = tmp_path / "dag.yaml"
    dag.write_text("inputs:\n  questions: {path: questions.parquet, id_column: id}\n"
                   "nodes:\n  embed:\n    model: minilm-l6\n    task: embed\n    prompt: '{{ question }}'\n"
                   "outputs:\n  vectors:\n    columns: {question: question, vector: embed}\n")
    result, _ = run_dag_file(dag, tmp_path / "out", parse_devices("cpu:2"), console=Console(quiet=True), engine_factory=shared_engines)
    assert result.nodes_failed == {}
    table = pq.read_table(tmp_path / "out" / "vectors.parquet")
    ours = np.array(table.column("vector").to_pylist(), np.float32)
    assert ours.shape == (ROWS, 384)
    assert cosines(ours, vllms_vectors).min() >= 0.9999, cosines(ours, vllms_vectors)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-3)  # normalised, as the model's modules.json says


def test_embedding_lines_validate_against_vllms_response_models_with_its_vectors(tmp_path, monkeypatch, shared_engines,
                                                                                questions, vllms_vectors):
    from vllm.entrypoints.launchers.run_batch import BatchRequestOutput
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingResponse

    from batchllm.openai_batch.run import run_batch

    monkeypatch.setenv("BATCHLLM_HOME", str(MODEL_HOME))
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"custom_id": f"e{k}", "method": "POST", "url": "/v1/embeddings",
                                            "body": {"model": "text-embedding-3-small", "input": text}}) + "\n"
                                for k, text in enumerate(questions)))
    run_batch(requests, tmp_path / "results.jsonl", {"text-embedding-3-small": "minilm-l6"}, run_dir=tmp_path / "run",
              devices="cpu:2", engine_factory=shared_engines, console=Console(quiet=True))
    lines = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"e{k}" for k in range(ROWS)]
    for line in lines:
        BatchRequestOutput.model_validate(line)
        EmbeddingResponse.model_validate(line["response"]["body"])
    ours = np.array([line["response"]["body"]["data"][0]["embedding"] for line in lines], np.float32)
    assert cosines(ours, vllms_vectors).min() >= 0.9999
