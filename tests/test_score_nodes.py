"""`task: score` nodes on a scripted engine: one float64 a row (the cosine of an embedding model's
vectors of the node's `prompt` and `pair`), read as a number by templates and `where:`, kept
exactly once across a crash, and what the loader and the checks refuse. The real engine's scores
against vLLM's own `LLM.score` are in test_real_embeddings.py."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchllm.core.errors import UserError
from batchllm.core.requests import EngineRequest, ModelTask
from batchllm.engines.devices import parse_devices
from batchllm.io.journal_records import ResultRecord
from batchllm.io.node_journal import ResultJournal
from batchllm.runtime.launch import run_dag_file
from tests.conftest import QUESTIONS, load_refused, make_model_dir
from tests.fakes import DriverCrash, FakeEngine, FakeEngineFactory, fake_score, fake_text

SCORE_DAG = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      answer:
        model: ./tiny-model
        prompt: "{{ question }}"
      relevance:
        model: ./bert-model
        task: score
        prompt: "{{ question }}"
        pair: "{{ answer }}"
      vector:
        model: ./bert-model
        task: embed
        prompt: "{{ question }}"
      explain:
        model: ./tiny-model
        where: relevance > 0
        prompt: "{{ answer }} scored {{ relevance | round(3) }}"
    outputs:
      scored:
        columns: {question: question, relevance: relevance, tokens: relevance.num_prompt_tokens, explained: explain}
"""


@pytest.fixture
def score_workspace(workspace):
    model = make_model_dir(workspace.root / "bert-model")
    (model / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": FakeEngine.VECTOR_DIMENSIONS}))
    return workspace


def run(workspace, factory, dag_text=SCORE_DAG):
    return run_dag_file(workspace.dag(dag_text), workspace.out, parse_devices("cpu:2"), console=Console(quiet=True),
                        engine_factory=factory, prefix_order=False, schedule="sequential")


def expected_score(question: str) -> float:
    answer = fake_text(EngineRequest("", question))
    return fake_score(EngineRequest("", question, chat=False, pair=answer), FakeEngine.VECTOR_DIMENSIONS)


def test_a_score_node_gives_one_float64_a_row_that_templates_and_where_read_as_a_number(score_workspace):
    factory = FakeEngineFactory()
    result, _ = run(score_workspace, factory)
    assert result.nodes_failed == {}
    scores = {text: expected_score(text) for _, text in QUESTIONS}
    assert any(s > 0 for s in scores.values()) and any(s <= 0 for s in scores.values())  # the where: keeps some rows, not all
    scored = pq.read_table(score_workspace.out / "scored.parquet")
    assert scored.schema.field("relevance").type == pa.float64()
    assert scored.column("relevance").to_pylist() == [scores[t] for _, t in QUESTIONS]
    pairs = [r for r in factory.requests if r.pair is not None]
    assert [(r.prompt, r.pair, r.chat) for r in pairs] == [(t, fake_text(EngineRequest("", t)), False) for _, t in QUESTIONS]
    assert scored.column("tokens").to_pylist() == [len(r.prompt) + len(r.pair) for r in pairs]
    explained = {r.prompt for r in factory.requests if r.chat and " scored " in r.prompt}
    assert explained == {f"{fake_text(EngineRequest('', t))} scored {round(s, 3)}" for t, s in scores.items() if s > 0}
    # an embed node and a score node of one model share one engine: both pool
    assert [e.config.task for e in factory.started if e.config.model.endswith("bert-model")] == [ModelTask.EMBED]


def test_a_score_node_killed_mid_run_resumes_with_every_row_once(score_workspace):
    dag = """
        inputs:
          questions: {path: questions.parquet, id_column: id}
        nodes:
          relevance: {model: ./bert-model, task: score, prompt: "{{ question }}", pair: "{{ question }}?"}
    """
    with pytest.raises(DriverCrash):
        run(score_workspace, FakeEngineFactory(crash_after_results=3), dag)
    resumed = FakeEngineFactory()
    run(score_workspace, resumed, dag)
    assert len([r for r in resumed.requests if r.pair is not None]) == 1  # three committed before the crash (3 a poll)
    node = pq.read_table(score_workspace.out / "nodes" / "relevance.parquet")
    assert sorted(node.column("row_id").to_pylist()) == sorted(q for q, _ in QUESTIONS)
    expected = {q: fake_score(EngineRequest("", t, chat=False, pair=f"{t}?"), FakeEngine.VECTOR_DIMENSIONS) for q, t in QUESTIONS}
    assert dict(zip(node.column("row_id").to_pylist(), node.column("score").to_pylist())) == expected


def test_the_journal_keeps_scores_as_exact_floats_through_reopening_and_compaction(tmp_path):
    folder = tmp_path / "journal"
    scores = [0.1 + 0.2, -1 / 3, None]
    journal = ResultJournal(folder, "print", "relevance", scores=True)
    journal.append_many([ResultRecord(k, 0, ("",), 4, 0, "stop", None, None, s) for k, s in enumerate(scores)])
    journal.close()
    reopened = ResultJournal(folder, "print", "relevance", scores=True)
    assert reopened.scores(np.arange(3), np.zeros(3, np.int64)) == scores
    reopened.compact()
    segment = pq.read_table(folder / "seg-000000.parquet")
    assert segment.schema.field("score").type == pa.float64() and segment.column("score").to_pylist() == scores
    assert reopened.scores(np.array([1, 0]), np.zeros(2, np.int64)) == [scores[1], scores[0]]


@pytest.mark.parametrize("old, new, message, hint", [
    ("        pair: \"{{ answer }}\"\n", "", "nodes.relevance scores a pair of texts, but gives only `prompt:`",
     "add `pair:`, the template of the text to score the prompt against (e.g. pair: \"{{ answer }}\")"),
    ("      answer:\n        model: ./tiny-model\n", "      answer:\n        model: ./tiny-model\n        pair: x\n",
     "nodes.answer.pair: only a score node reads a pair of texts", "drop `pair:`, or set `task: score`"),
    ("        task: score\n", "        task: score\n        sampling: {max_tokens: 8}\n",
     "nodes.relevance.sampling: a score node scores its prompt as plain text, so `sampling:` does not apply",
     "drop `sampling:` from nodes.relevance, or make it a generation node (task: generate)"),
    ("relevance: relevance,", "relevance: relevance.text,", "outputs.scored.columns.relevance: 'relevance.text' names unknown "
     "field 'text'", "fields: score, num_prompt_tokens, finish_reason"),
    ("task: score", "task: rerank", "nodes.relevance.task must be generate, embed, score or classify, got 'rerank'", None),
    ("    outputs:", "    merges:\n      either: [relevance, answer]\n    outputs:",
     "merges.either joins generate and score nodes: a row's result would be a text or a number", "merge nodes of one task"),
])
def test_a_bad_score_node_is_refused_naming_the_key_and_the_fix(score_workspace, old, new, message, hint):
    assert old in SCORE_DAG
    refused = load_refused(score_workspace.dag(SCORE_DAG.replace(old, new)))
    assert (str(refused), refused.hint) == (message, hint)


def test_a_score_node_on_a_classifier_of_several_labels_is_exit_2_at_the_checks_with_nothing_written(score_workspace):
    (score_workspace.root / "bert-model" / "config.json").write_text(
        json.dumps({"architectures": ["BertForSequenceClassification"], "hidden_size": FakeEngine.VECTOR_DIMENSIONS, "num_labels": 3}))
    dag = SCORE_DAG.split("      vector:")[0]
    with pytest.raises(UserError) as refused:
        run(score_workspace, FakeEngineFactory(), dag + "    outputs:\n      s:\n        columns: {r: relevance}\n")
    assert str(refused.value) == ("node 'relevance' scores, but model './bert-model' (BertForSequenceClassification) is a "
                                  "classifier of 3 labels: a cross-encoder that scores gives one")
    assert refused.value.hint.endswith("or set `task: classify` for the labels' probabilities")
    assert not score_workspace.out.exists()


def test_a_score_node_on_a_cross_encoder_sends_each_pair_whole_to_a_classify_engine(score_workspace):
    (score_workspace.root / "bert-model" / "config.json").write_text(
        json.dumps({"architectures": ["BertForSequenceClassification"], "hidden_size": FakeEngine.VECTOR_DIMENSIONS,
                    "id2label": {"0": "LABEL_0"}}))
    dag = SCORE_DAG.split("      vector:")[0] + "    outputs:\n      s:\n        columns: {r: relevance}\n"
    factory = FakeEngineFactory()
    result, _ = run(score_workspace, factory, dag)
    assert result.nodes_failed == {}
    assert [e.config.task for e in factory.started] == [ModelTask.GENERATE, ModelTask.CLASSIFY]
    scored = [r for r in factory.started[1].seen]
    assert len(scored) == len(QUESTIONS) and all(r.pair is not None for r in scored)  # one request a pair, not two texts
    assert pq.read_table(score_workspace.out / "s.parquet").column("r").to_pylist() == \
        [pytest.approx(fake_score(r, FakeEngine.VECTOR_DIMENSIONS)) for r in scored]


def test_score_pairs_answer_once_both_halves_are_done_in_either_order_with_torchs_cosine():
    from batchllm.engines.score_pairs import PAIR_HALF, ScorePairs, cosine

    pairs = ScorePairs()
    pairs.submitted(7)
    pairs.submitted("b")
    first, second = np.array([1.0, 2.0, 2.0], np.float32), np.array([2.0, 0.0, 1.0], np.float32)
    assert pairs.owns("7") and pairs.owns(f"7{PAIR_HALF}") and not pairs.owns("8")
    assert pairs.half_done(f"7{PAIR_HALF}", 7, second, 5) is None
    result = pairs.half_done("7", 7, first, 3)
    assert result is not None and (result.request_id, result.num_prompt_tokens, result.vector) == (7, 8, None)
    assert result.score == pytest.approx(4 / (3 * 5 ** 0.5)) == cosine(first, second)
    assert not pairs.owns("7") and pairs.owns("b")  # answered once; the other still waits for its halves
    assert cosine(np.zeros(3), first) == 0.0  # torch's eps: a zero vector scores 0, not nan
