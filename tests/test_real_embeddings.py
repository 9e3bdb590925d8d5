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
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchllm.engines.devices import engine_dtype, parse_devices
from batchllm.models.embedded import MINILM_L6
from batchllm.runtime.launch import run_dag_file
from tests.classifier_model import make_classifier
from tests.example_rows import example_dag
from tests.killed_run import committed, kill_after_commits

pytestmark = pytest.mark.engine
REPO = Path(__file__).resolve().parent.parent
MODEL_HOME = REPO / ".batchllm-home"  # the prepared models, shared with the other real-engine tests
ROWS = 8  # of the 24 example questions

VLLM_POOLING = """
import json, sys
from vllm import LLM
calls = json.load(sys.stdin)
llm = LLM(model=sys.argv[1], runner="pooling", enforce_eager=True, dtype=sys.argv[2], seed=0)
for call, argument in calls:
    if call == "embed":
        print("embed " + json.dumps([output.outputs.embedding for output in llm.embed(argument)]))
    elif call == "classify":
        print("classify " + json.dumps([output.outputs.probs for output in llm.classify(argument)]))
    else:
        print("score " + json.dumps([output.outputs.score for output in llm.score(*argument)]))
"""


def vllm_pooling(model_dir: Path, calls: list[tuple[str, object]]) -> dict[str, list]:
    """What vLLM's own `LLM.embed`, `.classify` or `.score` (the calls' names) gives for each call's
    argument, in one process of its own as a user's script runs it: one engine start for them all."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", VLLM_POOLING, str(model_dir), engine_dtype("cpu") or "auto"], input=json.dumps(calls),
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ", 1)[0] in ("embed", "classify", "score"))
    return {call: json.loads(printed[call]) for call, _ in calls}


def cosines(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    return (ours * theirs).sum(axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))


@pytest.fixture(scope="module")
def questions() -> list[str]:
    return pq.read_table(REPO / "examples" / "questions.parquet").column("question").to_pylist()[:ROWS]


@pytest.fixture(scope="module")
def passages() -> list[str]:
    return pq.read_table(REPO / "examples" / "passages.parquet").column("passage").to_pylist()[:ROWS]


@pytest.fixture(scope="module")
def minilm_by_vllm(questions, passages) -> dict[str, list]:
    """vLLM's own embeddings of the questions and scores of (question, passage) pairs, from one engine."""
    return vllm_pooling(MINILM_L6.prepare(MODEL_HOME), [("embed", questions), ("score", [questions, passages])])


@pytest.fixture(scope="module")
def vllms_vectors(minilm_by_vllm) -> np.ndarray:
    return np.array(minilm_by_vllm["embed"], np.float32)


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


def test_embedding_score_and_rerank_lines_validate_against_vllms_response_models_with_its_vectors(tmp_path, monkeypatch, shared_engines,
                                                                                                   questions, vllms_vectors):
    """One line an input, one line of several inputs, a 1:N score line and a rerank line (cosines of
    the embedding model's vectors, as vLLM scores with a model that embeds)."""
    from vllm.entrypoints.launchers.run_batch import BatchRequestOutput
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingResponse
    from vllm.entrypoints.pooling.scoring.protocol import RerankResponse, ScoreResponse

    from batchllm.openai_batch.run import run_batch

    monkeypatch.setenv("BATCHLLM_HOME", str(MODEL_HOME))
    line = lambda custom_id, url, **body: json.dumps({"custom_id": custom_id, "method": "POST", "url": url,  # noqa: E731
                                                      "body": {"model": "text-embedding-3-small", **body}}) + "\n"
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(line(f"e{k}", "/v1/embeddings", input=text) for k, text in enumerate(questions))
                        + line("many", "/v1/embeddings", input=questions[2:5])
                        + line("score", "/score", text_1=questions[0], text_2=questions[1:4])
                        + line("rerank", "/rerank", query=questions[0], documents=questions[1:4], top_n=2))
    run_batch(requests, tmp_path / "results.jsonl", {"text-embedding-3-small": "minilm-l6"}, run_dir=tmp_path / "run",
              devices="cpu:2", engine_factory=shared_engines, console=Console(quiet=True))
    lines = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"e{k}" for k in range(ROWS)] + ["many", "score", "rerank"]
    for line in lines:
        BatchRequestOutput.model_validate(line)
    *embedded, many, scored, reranked = [line["response"]["body"] for line in lines]
    for body in (*embedded, many):
        EmbeddingResponse.model_validate(body)
    ours = np.array([body["data"][0]["embedding"] for body in embedded], np.float32)
    assert cosines(ours, vllms_vectors).min() >= 0.9999
    assert [item["index"] for item in many["data"]] == [0, 1, 2]
    assert cosines(np.array([item["embedding"] for item in many["data"]], np.float32), vllms_vectors[2:5]).min() >= 0.9999
    expected = [float(vllms_vectors[0] @ vllms_vectors[k]) / float(np.linalg.norm(vllms_vectors[0]) * np.linalg.norm(vllms_vectors[k]))
                for k in (1, 2, 3)]
    ScoreResponse.model_validate(scored)
    assert [item["score"] for item in scored["data"]] == pytest.approx(expected, abs=1e-4)
    RerankResponse.model_validate(reranked)
    best = sorted(range(3), key=lambda k: -expected[k])[:2]
    assert [result["index"] for result in reranked["results"]] == best
    assert [result["document"]["text"] for result in reranked["results"]] == [questions[1 + k] for k in best]
    assert [result["relevance_score"] for result in reranked["results"]] == pytest.approx([expected[k] for k in best], abs=1e-4)


KILL_ROWS = 200  # short ShareGPT first turns: 4 s of embedding on 2 AVX-512 cores, the kill lands after the first 8


def test_a_killed_embed_run_resumes_with_every_row_once_and_the_vectors_of_an_uninterrupted_run(tmp_path, monkeypatch,
                                                                                                 shared_engines):
    monkeypatch.setenv("BATCHLLM_HOME", str(MODEL_HOME))
    texts = [p[:300] for p in pq.read_table(REPO / "profiles" / "prompts" / "first_turns.parquet").column("prompt").to_pylist()]
    pq.write_table(pa.table({"id": [f"t{k}" for k in range(KILL_ROWS)], "text": texts[:KILL_ROWS]}), tmp_path / "texts.parquet")
    dag = tmp_path / "dag.yaml"
    dag.write_text("inputs:\n  texts: {path: texts.parquet, id_column: id}\n"
                   "nodes:\n  embed:\n    model: minilm-l6\n    task: embed\n    prompt: '{{ text }}'\n")
    out = tmp_path / "out"
    kill_after_commits(dag, out, ("embed",), 8)
    assert 8 <= committed(out, ("embed",)) < KILL_ROWS, "the kill must land with work left"
    # resumed in this process on the session's engine: what resumes is the killed run's journal on disk (the CLI's
    # own resume after kill -9 is test_real_engine.py's; a second engine start here cost 10-15 s of the suite)
    resumed, _ = run_dag_file(dag, out, parse_devices("cpu:2"), console=Console(quiet=True), engine_factory=shared_engines)
    assert resumed.nodes_failed == {}
    node = pq.read_table(out / "nodes" / "embed.parquet")
    assert sorted(node.column("row_id").to_pylist()) == sorted(f"t{k}" for k in range(KILL_ROWS)) and committed(out, ("embed",)) == KILL_ROWS
    run_dag_file(dag, tmp_path / "whole", parse_devices("cpu:2"), console=Console(quiet=True), engine_factory=shared_engines)
    whole = pq.read_table(tmp_path / "whole" / "nodes" / "embed.parquet")
    by_row = dict(zip(whole.column("row_id").to_pylist(), whole.column("vector").to_pylist()))
    ours = np.array(node.column("vector").to_pylist(), np.float32)
    theirs = np.array([by_row[r] for r in node.column("row_id").to_pylist()], np.float32)
    assert cosines(ours, theirs).min() >= 0.9999  # batches of other sizes: the same vectors to float32 rounding


RETRIEVAL_ROWS = 4  # questions (the corpus is whole): two whose own answer is a passage


def test_the_retrieval_example_answers_from_passages_its_questions_own_answers_are_among(tmp_path, monkeypatch, shared_engines):
    monkeypatch.setenv("BATCHLLM_HOME", str(MODEL_HOME))
    dag = example_dag("retrieval_qa", tmp_path, RETRIEVAL_ROWS, whole=("passages.parquet",))
    result, _ = run_dag_file(dag, tmp_path / "out", parse_devices("cpu:2"), console=Console(quiet=True), engine_factory=shared_engines)
    assert result.nodes_failed == {}
    answers = pq.read_table(tmp_path / "out" / "answers.parquet").to_pylist()
    assert len(answers) == RETRIEVAL_ROWS and all(row["answer"] for row in answers) and {row["grade"] for row in answers} <= {"yes", "no"}
    # the nearest passages by the run's own vectors: a question's own ShareGPT answer, where the corpus has it, is among its 3
    nodes = tmp_path / "out" / "nodes"
    passages = pq.read_table(nodes / "passage_vector.parquet")
    questions = pq.read_table(nodes / "question_vector.parquet")
    similarities = np.array(questions.column("vector").to_pylist()) @ np.array(passages.column("vector").to_pylist()).T
    answered = dict(zip(pq.read_table(tmp_path / "passages.parquet").column("answers").to_pylist(), passages.column("row_id").to_pylist()))
    own = [(k, answered[q]) for k, q in enumerate(questions.column("row_id").to_pylist()) if q in answered]
    assert len(own) == 2  # of the first 4 questions, the 1st and the 3rd
    nearest = [[passages.column("row_id")[int(j)].as_py() for j in np.argsort(-similarities[k])[:3]] for k, _ in own]
    assert all(passage in found for (_, passage), found in zip(own, nearest)), (own, nearest)


def test_a_score_node_gives_the_scores_of_vllms_own_score(tmp_path, monkeypatch, shared_engines, questions, passages, minilm_by_vllm):
    monkeypatch.setenv("BATCHLLM_HOME", str(MODEL_HOME))
    pq.write_table(pa.table({"id": [f"r{k}" for k in range(ROWS)], "question": questions, "passage": passages}), tmp_path / "pairs.parquet")
    dag = tmp_path / "dag.yaml"
    dag.write_text("inputs:\n  pairs: {path: pairs.parquet, id_column: id}\n"
                   "nodes:\n  relevance:\n    model: minilm-l6\n    task: score\n    prompt: '{{ question }}'\n    pair: '{{ passage }}'\n")
    result, _ = run_dag_file(dag, tmp_path / "out", parse_devices("cpu:2"), console=Console(quiet=True), engine_factory=shared_engines)
    assert result.nodes_failed == {}
    ours = pq.read_table(tmp_path / "out" / "results.parquet").column("relevance").to_pylist()
    theirs = minilm_by_vllm["score"]
    assert np.allclose(ours, theirs, atol=1e-4, rtol=0), (ours, theirs)
    assert len(set(np.round(ours, 3))) == ROWS  # eight pairs, eight scores: not one value for all


LABELS = ("negative", "neutral", "positive")


def test_a_classify_node_gives_the_probabilities_of_vllms_own_classify(tmp_path, monkeypatch, shared_engines, questions):
    monkeypatch.setenv("BATCHLLM_HOME", str(MODEL_HOME))
    classifier = make_classifier(tmp_path / "classifier", MINILM_L6.prepare(MODEL_HOME), LABELS, seed=3)
    pq.write_table(pq.read_table(REPO / "examples" / "questions.parquet").slice(0, ROWS), tmp_path / "questions.parquet")
    dag = tmp_path / "dag.yaml"
    dag.write_text("inputs:\n  questions: {path: questions.parquet, id_column: id}\n"
                   "nodes:\n  mood:\n    model: ./classifier\n    task: classify\n    prompt: '{{ question }}'\n"
                   "outputs:\n  moods:\n    columns: {mood: mood, probs: mood.probs}\n")
    result, _ = run_dag_file(dag, tmp_path / "out", parse_devices("cpu:2"), console=Console(quiet=True), engine_factory=shared_engines)
    assert result.nodes_failed == {}
    table = pq.read_table(tmp_path / "out" / "moods.parquet")
    ours = np.array(table.column("probs").to_pylist(), np.float64)
    theirs = np.array(vllm_pooling(classifier, [("classify", questions)])["classify"], np.float64)
    assert ours.shape == theirs.shape == (ROWS, len(LABELS))
    assert np.allclose(ours, theirs, atol=1e-5, rtol=0), (ours, theirs)
    assert np.allclose(ours.sum(axis=1), 1.0, atol=1e-4)  # probabilities
    assert table.column("mood").to_pylist() == [LABELS[k] for k in theirs.argmax(axis=1)]
    assert len({tuple(np.round(p, 3)) for p in ours}) == ROWS  # the head tells the questions apart


def test_a_score_node_on_a_cross_encoder_gives_the_scores_of_vllms_own_score(tmp_path, monkeypatch, shared_engines, questions, passages):
    monkeypatch.setenv("BATCHLLM_HOME", str(MODEL_HOME))
    make_classifier(tmp_path / "cross-encoder", MINILM_L6.prepare(MODEL_HOME), ("LABEL_0",), seed=4)
    pq.write_table(pa.table({"id": [f"r{k}" for k in range(ROWS)], "question": questions, "passage": passages}), tmp_path / "pairs.parquet")
    dag = tmp_path / "dag.yaml"
    dag.write_text("inputs:\n  pairs: {path: pairs.parquet, id_column: id}\n"
                   "nodes:\n  relevance:\n    model: ./cross-encoder\n    task: score\n    prompt: '{{ question }}'\n    pair: '{{ passage }}'\n")
    result, _ = run_dag_file(dag, tmp_path / "out", parse_devices("cpu:2"), console=Console(quiet=True), engine_factory=shared_engines)
    assert result.nodes_failed == {}
    ours = pq.read_table(tmp_path / "out" / "results.parquet").column("relevance").to_pylist()
    theirs = vllm_pooling(tmp_path / "cross-encoder", [("score", [questions, passages])])["score"]
    assert np.allclose(ours, theirs, atol=1e-5, rtol=0), (ours, theirs)
    assert len(set(np.round(ours, 4))) == ROWS  # eight pairs, eight scores
