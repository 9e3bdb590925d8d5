"""`nearest:` lists, retrieval inside a DAG, on a scripted engine: the k corpus rows a node reads
per row are the nearest by cosine (checked against numpy's brute force), wait for the whole corpus,
survive a crash of the node that reads them, and bad lists are refused before anything runs. The
real embedding model's retrieval runs in tests/test_real_embeddings.py."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchllm.core.errors import UserError
from batchllm.core.requests import EngineRequest
from batchllm.dag.loader import load_dag
from batchllm.engines.devices import parse_devices
from batchllm.io.vector_search import VectorSearch
from batchllm.runtime.fingerprint import node_fingerprints
from batchllm.runtime.launch import run_dag_file
from tests.conftest import QUESTIONS, load_refused, make_model_dir
from tests.fakes import DriverCrash, FakeEngine, FakeEngineFactory, fake_text, fake_vector

PASSAGES = [("p1", "Primes have two divisors."), ("p2", "Python's sorted() returns a new list."),
            ("p3", "Rayleigh scattering colours the sky."), ("p4", "SQL: Structured Query Language."),
            ("p5", "Bees make honey."), ("p6", "The Moon orbits the Earth.")]

NEAREST_DAG = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
      passages: {path: passages.parquet, id_column: pid}
    nodes:
      passage_vector: {model: ./bert-model, task: embed, input: passages, prompt: "{{ passage }}"}
      question_vector: {model: ./bert-model, task: embed, input: questions, prompt: "{{ question }}"}
      answer:
        model: ./tiny-model
        input: questions
        prompt: "{% for p in context %}[{{ p.row_id }} {{ p.similarity | round(4) }} {{ p.passage }}]{% endfor %} {{ question }}"
    nearest:
      context: {query: question_vector, corpus: passage_vector, k: 2}
    outputs:
      answers:
        columns: {question: question, answer: answer}
"""


@pytest.fixture
def nearest_workspace(workspace):
    model = make_model_dir(workspace.root / "bert-model")
    (model / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": FakeEngine.VECTOR_DIMENSIONS}))
    pq.write_table(pa.table({"pid": [p for p, _ in PASSAGES], "passage": [t for _, t in PASSAGES]}), workspace.root / "passages.parquet")
    return workspace


def run(workspace, factory, dag_text=NEAREST_DAG):
    return run_dag_file(workspace.dag(dag_text), workspace.out, parse_devices("cpu:2"), console=Console(quiet=True),
                        engine_factory=factory, prefix_order=False, schedule="sequential")


def embedded(text: str) -> np.ndarray:
    return fake_vector(EngineRequest("", text, chat=False), FakeEngine.VECTOR_DIMENSIONS)


def expected_prompt(question: str, k: int = 2) -> str:
    """The answer node's prompt with the k passages numpy finds nearest the question, nearest first."""
    corpus = np.stack([embedded(t) for _, t in PASSAGES])
    similarities = corpus @ embedded(question)
    nearest = np.argsort(-similarities, kind="stable")[:k]
    notes = "".join(f"[{PASSAGES[j][0]} {round(float(similarities[j]), 4)} {PASSAGES[j][1]}]" for j in nearest)
    return f"{notes} {question}"


def answer_prompts(factory) -> dict[str, str]:
    return {r.prompt.rsplit("] ", 1)[1]: r.prompt for r in factory.requests if r.chat}


def test_a_node_reading_a_nearest_list_sees_the_k_nearest_corpus_rows_nearest_first(nearest_workspace):
    factory = FakeEngineFactory()
    result, _ = run(nearest_workspace, factory)
    assert result.nodes_failed == {}
    assert answer_prompts(factory) == {text: expected_prompt(text) for _, text in QUESTIONS}
    answers = pq.read_table(nearest_workspace.out / "answers.parquet")
    assert answers.column("row_id").to_pylist() == [q for q, _ in QUESTIONS]
    assert answers.column("answer").to_pylist() == [fake_text(EngineRequest("", expected_prompt(t))) for _, t in QUESTIONS]


def test_the_reader_of_a_nearest_list_resumes_after_a_crash_with_every_row_once_and_the_same_passages(nearest_workspace):
    asked = []

    def crash_at_the_fourth_answer(request):
        asked.append(request)
        if len(asked) == 4:
            raise DriverCrash()
        return fake_text(request)

    with pytest.raises(DriverCrash):
        run(nearest_workspace, FakeEngineFactory(answer=crash_at_the_fourth_answer))
    resumed = FakeEngineFactory()
    run(nearest_workspace, resumed)
    # the fake engine answers 3 a poll: the first three answers were committed, the fourth is asked again
    assert not [r for r in resumed.requests if not r.chat]  # no vector is computed again
    assert list(answer_prompts(resumed).values()) == [expected_prompt(QUESTIONS[3][1])]
    assert pq.read_table(nearest_workspace.out / "answers.parquet").column("answer").to_pylist() == \
        [fake_text(EngineRequest("", expected_prompt(t))) for _, t in QUESTIONS]


def test_k_changes_the_readers_fingerprint_and_leaves_the_embed_nodes_results_standing(nearest_workspace):
    before = node_fingerprints(load_dag(nearest_workspace.dag(NEAREST_DAG)))
    after = node_fingerprints(load_dag(nearest_workspace.dag(NEAREST_DAG.replace("k: 2", "k: 3"))))
    assert {name for name in before if before[name] != after[name]} == {"answer"}


@pytest.mark.parametrize("old, new, message, hint", [
    ("query: question_vector", "query: answer", "nearest.context.query names 'answer', which generates text: nearest rows are "
     "found by vectors", "name an embed node (`task: embed`), or add one that embeds 'answer''s text"),
    ("query: question_vector", "query: nothing", "nearest.context.query names 'nothing', which is not a node",
     "nodes: passage_vector, question_vector, answer"),
    ("k: 2", "k: 0", "nearest.context.k must be an integer >= 1, got 0", None),
    ("      context: {", "      answer: {", "nearest list 'answer' has the name of a node", "rename it"),
    ("        input: questions\n        prompt", "        input: passages\n        prompt",
     "node 'answer' reads nearest list 'context', whose rows are per row of input 'questions', but runs over 'passages'",
     "set `input: questions` on 'answer'"),
    ("    outputs:\n      answers:\n        columns: {question: question, answer: answer}",
     "    outputs:\n      answers:\n        columns: {question: question, passages: context}",
     "outputs.answers.columns.passages names nearest list 'context': an output column is one value a row",
     "take what a node made of it (a node whose template reads 'context'), or question_vector.vector"),
    ("        input: questions\n        prompt", "        input: questions\n        where: \"len(context) > 0\"\n        prompt",
     "nodes.answer.where reads nearest list 'context': `where:` reads texts and columns",
     "read the list in the node's template, or route on its query's input columns"),
])
def test_a_bad_nearest_list_is_refused_naming_the_key_and_the_fix(nearest_workspace, old, new, message, hint):
    assert old in NEAREST_DAG
    refused = load_refused(nearest_workspace.dag(NEAREST_DAG.replace(old, new)))
    assert (str(refused), refused.hint) == (message, hint)


def test_nearest_lists_of_two_models_vectors_are_refused(nearest_workspace):
    make_model_dir(nearest_workspace.root / "other-bert")
    dag = NEAREST_DAG.replace("passage_vector: {model: ./bert-model", "passage_vector: {model: ./other-bert")
    with pytest.raises(UserError) as refused:
        load_dag(nearest_workspace.dag(dag))
    assert str(refused.value) == ("nearest.context: 'question_vector' embeds with './bert-model' and 'passage_vector' with "
                                  "'./other-bert': vectors of two models are not comparable")


def test_k_over_the_corpus_rows_is_exit_2_at_the_checks_with_nothing_written(nearest_workspace):
    with pytest.raises(UserError) as refused:
        run(nearest_workspace, FakeEngineFactory(), NEAREST_DAG.replace("k: 2", "k: 7"))
    assert str(refused.value) == ("nearest.context.k is 7, but its corpus 'passage_vector' runs over input 'passages', "
                                  "which has 6 rows")
    assert refused.value.hint == "set k to at most 6" and not nearest_workspace.out.exists()


def test_the_vector_search_is_numpys_brute_force_with_ties_by_position_and_at_most_the_corpus():
    rng = np.random.default_rng(3)
    corpus = rng.standard_normal((40, 5)).astype(np.float32)
    corpus[7] = corpus[3] * 2  # the same direction: a tie, broken by position
    queries = np.concatenate([rng.standard_normal((5, 5)).astype(np.float32), corpus[3:4]])
    as_array = lambda m: pa.FixedSizeListArray.from_arrays(pa.array(m.reshape(-1)), 5)  # noqa: E731
    search = VectorSearch(as_array(corpus), np.arange(100, 140))
    found = search.nearest(as_array(queries), 4)
    unit = corpus / np.linalg.norm(corpus, axis=1, keepdims=True)
    cosines = (queries / np.linalg.norm(queries, axis=1, keepdims=True)) @ unit.T
    assert found.positions == [(100 + np.argsort(-c, kind="stable")[:4]).tolist() for c in cosines]
    assert found.positions[-1][:2] == [103, 107]
    assert np.allclose(found.similarities, np.sort(cosines, axis=1)[:, ::-1][:, :4], atol=1e-6)
    assert [len(p) for p in search.nearest(as_array(queries[:2]), 50).positions] == [40, 40]
    search.close()


def test_a_corpus_whose_id_column_is_its_own_row_id_column_gives_the_same_rows(nearest_workspace):
    pq.write_table(pa.table({"row_id": [p for p, _ in PASSAGES], "passage": [t for _, t in PASSAGES]}),
                   nearest_workspace.root / "passages.parquet")
    factory = FakeEngineFactory()
    result, _ = run(nearest_workspace, factory, NEAREST_DAG.replace("id_column: pid", "id_column: row_id"))
    assert result.nodes_failed == {}
    assert answer_prompts(factory) == {text: expected_prompt(text) for _, text in QUESTIONS}
