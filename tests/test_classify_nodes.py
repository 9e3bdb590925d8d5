"""`task: classify` nodes on a scripted engine: the label as text (templates and `where:` read it),
the probabilities as a vector in the journal (exactly once across a crash) and the outputs, and
the models the checks refuse. The real engine's probabilities against vLLM's own `LLM.classify`
are in test_real_embeddings.py."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchllm.core.errors import UserError
from batchllm.core.requests import EngineRequest, ModelTask
from batchllm.dag.loader import load_dag
from batchllm.engines.devices import parse_devices
from batchllm.io.dag_checks import check_dag
from batchllm.models.model_kind import ModelKind
from batchllm.runtime.launch import run_dag_file
from tests.conftest import QUESTIONS, make_model_dir
from tests.fakes import DriverCrash, FakeEngineFactory, fake_probs

LABELS = ("negative", "neutral", "positive")
CLASSIFY_DAG = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      mood:
        model: ./classifier
        task: classify
        prompt: "{{ question }}"
      cheer:
        model: ./tiny-model
        where: "mood = 'negative'"
        prompt: "Cheer {{ question }} ({{ mood }})"
    outputs:
      moods:
        columns: {question: question, mood: mood, probs: mood.probs, cheer: cheer}
"""


@pytest.fixture
def classify_workspace(workspace):
    model = make_model_dir(workspace.root / "classifier")
    (model / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"], "hidden_size": 8,
                                                   "id2label": {str(k): label for k, label in enumerate(LABELS)}}))
    return workspace


def run(workspace, factory, dag_text=CLASSIFY_DAG):
    return run_dag_file(workspace.dag(dag_text), workspace.out, parse_devices("cpu:2"), console=Console(quiet=True),
                        engine_factory=factory, prefix_order=False, schedule="sequential")


def expected(question: str) -> tuple[str, list[float]]:
    probs = fake_probs(EngineRequest("", question, chat=False), len(LABELS))
    return LABELS[int(probs.argmax())], probs.tolist()


def test_the_label_is_the_text_downstream_reads_and_the_probabilities_a_typed_list(classify_workspace):
    factory = FakeEngineFactory()
    result, _ = run(classify_workspace, factory)
    assert result.nodes_failed == {}
    assert [e.config.task for e in factory.started] == [ModelTask.CLASSIFY, ModelTask.GENERATE]
    moods = pq.read_table(classify_workspace.out / "moods.parquet")
    assert moods.schema.field("probs").type == pa.list_(pa.float32(), len(LABELS))
    assert moods.schema.field("mood").type == pa.string()
    rows = {row["row_id"]: row for row in moods.to_pylist()}
    for question_id, text in QUESTIONS:
        label, probs = expected(text)
        assert rows[question_id]["mood"] == label
        np.testing.assert_allclose(rows[question_id]["probs"], probs, rtol=1e-6)
        assert rows[question_id]["cheer"] == (f"<Cheer {text} ({label})>" if label == "negative" else None)
    cheered = [r.prompt for r in factory.requests if r.prompt.startswith("Cheer ")]
    assert len(cheered) == sum(expected(text)[0] == "negative" for _, text in QUESTIONS) >= 1


def test_a_classify_node_killed_mid_run_resumes_with_every_row_once(classify_workspace):
    dag = CLASSIFY_DAG.split("      cheer:")[0] + "    outputs:\n      moods:\n        columns: {mood: mood, probs: mood.probs}\n"
    with pytest.raises(DriverCrash):
        run(classify_workspace, FakeEngineFactory(crash_after_results=2), dag)
    resumed = FakeEngineFactory()
    run(classify_workspace, resumed, dag)
    assert len(resumed.requests) == len(QUESTIONS) - 2
    moods = pq.read_table(classify_workspace.out / "moods.parquet").to_pylist()
    assert [(m["mood"], pytest.approx(m["probs"])) for m in moods] == [expected(text) for _, text in QUESTIONS]


def test_a_models_labels_come_from_id2label_in_id_order_else_num_labels(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["XForSequenceClassification"],
                                                      "id2label": {"1": "yes", "0": "no", "2": "maybe"}}))
    assert ModelKind.of(tmp_path).labels == ("no", "yes", "maybe")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["XForSequenceClassification"], "num_labels": 2}))
    assert ModelKind.of(tmp_path).labels == ("LABEL_0", "LABEL_1")


@pytest.mark.parametrize(("model", "config", "message"), [
    ("./tiny-model", None, "node 'mood' classifies, but model './tiny-model' (LlamaForCausalLM): it has no classification head"),
    ("./classifier", {"architectures": ["BertForSequenceClassification"]},
     "node 'mood' classifies, but model './classifier' (BertForSequenceClassification): its config names no labels"),
])
def test_a_classify_node_on_a_model_without_labelled_head_is_refused(classify_workspace, model, config, message):
    (classify_workspace.root / "tiny-model" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    if config is not None:
        (classify_workspace.root / "classifier" / "config.json").write_text(json.dumps(config))
    dag = load_dag(classify_workspace.dag(CLASSIFY_DAG.replace("model: ./classifier", f"model: {model}")))
    with pytest.raises(UserError) as refused:
        check_dag(dag, classify_workspace.root / "home")
    assert str(refused.value).startswith(message)
    assert "nodes.mood.model" in refused.value.where and "ForSequenceClassification" in refused.value.hint


def test_a_generation_or_embed_node_on_a_classifier_is_told_to_classify(classify_workspace):
    for extra in ("", "        task: embed\n"):
        text = CLASSIFY_DAG.split("      cheer:")[0].replace("        task: classify\n", extra)
        with pytest.raises(UserError) as refused:
            check_dag(load_dag(classify_workspace.dag(text)), classify_workspace.root / "home")
        assert refused.value.hint.startswith("set `task: classify` on the node")
