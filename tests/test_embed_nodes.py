"""`task: embed` nodes on a scripted engine: what the loader accepts and refuses, the vector's
way through the journal (binary, exactly once across a crash), the node file and the output
columns. The real engine's vectors against vLLM's own are in test_real_engine.py."""

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
from batchllm.io.journal_records import ResultRecord
from batchllm.io.node_journal import ResultJournal
from batchllm.models.model_kind import ModelKind
from batchllm.runtime.launch import run_dag_file
from tests.conftest import QUESTIONS, make_model_dir
from tests.fakes import DriverCrash, FakeEngine, FakeEngineFactory, fake_vector

EMBED_DAG = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      embed:
        model: ./bert-model
        task: embed
        prompt: "query: {{ question }}"
    outputs:
      vectors:
        columns: {question: question, vector: embed, tokens: embed.num_prompt_tokens}
"""


@pytest.fixture
def embed_workspace(workspace):
    model = make_model_dir(workspace.root / "bert-model")
    (model / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": FakeEngine.VECTOR_DIMENSIONS}))
    return workspace


def run(workspace, factory, dag_text=EMBED_DAG, schedule="sequential"):
    return run_dag_file(workspace.dag(dag_text), workspace.out, parse_devices("cpu:2"), console=Console(quiet=True),
                        engine_factory=factory, prefix_order=False, schedule=schedule)


def expected_vector(question: str) -> list[float]:
    return fake_vector(EngineRequest("", f"query: {question}", chat=False), FakeEngine.VECTOR_DIMENSIONS).tolist()


def test_an_embed_node_writes_one_float32_vector_a_row_to_its_node_file_and_output(embed_workspace):
    factory = FakeEngineFactory()
    run(embed_workspace, factory)
    assert [engine.config.task for engine in factory.started] == [ModelTask.EMBED]
    assert all(not r.chat and r.prompt.startswith("query: ") for r in factory.requests)  # plain text, no chat template
    vectors = pq.read_table(embed_workspace.out / "vectors.parquet")
    assert vectors.schema.field("vector").type == pa.list_(pa.float32(), FakeEngine.VECTOR_DIMENSIONS)
    assert vectors.column("row_id").to_pylist() == [q for q, _ in QUESTIONS]
    assert vectors.column("vector").to_pylist() == [expected_vector(text) for _, text in QUESTIONS]
    node = pq.read_table(embed_workspace.out / "nodes" / "embed.parquet")
    assert node.schema.field("vector").type == pa.list_(pa.float32(), FakeEngine.VECTOR_DIMENSIONS)
    assert node.column("text").to_pylist() == [""] * len(QUESTIONS) and set(node.column("num_output_tokens").to_pylist()) == {0}


def test_a_planned_run_of_an_embed_node_runs_node_by_node_for_want_of_a_cost_model(embed_workspace):
    result, _ = run(embed_workspace, FakeEngineFactory(), schedule="plan")
    assert result.report.method == "sequential" and result.nodes_failed == {}


def pooling_profile(root, model: str):
    """A pooling model's profile as `batchllm profile` writes one (prefill steps only, every answer one token), filed for
    `model` on this machine's hardware name."""
    from batchllm.costmodel.latency import StepLatencyModel
    from batchllm.costmodel.lengths import LengthDistribution
    from batchllm.costmodel.profile import ModelFacts, Profile, ShapeProfile
    from batchllm.engines.devices import hardware_name
    from batchllm.engines.hardware import this_machine

    latency = StepLatencyModel(0.004, 2e-5, 1e-9, 0.0, 0.0)
    shapes = {key: ShapeProfile(3.0, 256 * 256, latency, 0.05) for key in ("w1-tp1", "w2-tp1")}
    engine = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "block_size_tokens": 16, "max_model_len": 256, "task": "embed"}
    profile = Profile("measured", hardware_name("cpu"), model, engine, ModelFacts(22_000_000, 6, 384, 12, 12, 256), shapes,
                      LengthDistribution.fit([1] * 4, [True] * 4), identity=this_machine("cpu"))
    profile.save(root / hardware_name("cpu") / model)
    return root


def test_with_a_profile_an_embed_node_is_planned_like_any_node_beside_a_generation_node(embed_workspace, profiles):
    pooling_profile(profiles, "bert-model")
    dag = EMBED_DAG.replace("    outputs:", """      answer:
        model: ./tiny-model
        prompt: "{{ question }}"
    outputs:""")
    from batchllm.planner.plan_file import plan_dag_file

    report = plan_dag_file(embed_workspace.dag(dag), "cpu:2", profiles_root=profiles)
    assert {name for stage in report.chosen.stages for name in stage.plans} == {"embed", "answer"}
    embed = report.problem.nodes["embed"]
    assert embed.requests == len(QUESTIONS) and report.chosen.total_s > 0
    result, _ = run_dag_file(embed_workspace.dag(dag), embed_workspace.out, parse_devices("cpu:2"), console=Console(quiet=True),
                             engine_factory=FakeEngineFactory(), prefix_order=False, schedule="plan", profiles_root=profiles)
    assert result.report.method == "plan" and result.nodes_failed == {}
    assert pq.read_table(embed_workspace.out / "vectors.parquet").column("vector").to_pylist() == \
        [expected_vector(text) for _, text in QUESTIONS]


def test_a_pooling_node_runs_no_pilot_its_answers_have_no_length_to_learn(embed_workspace, profiles):
    pooling_profile(profiles, "bert-model")
    rows = 300  # a pilot's worth: 64 rows of 300
    pq.write_table(pa.table({"id": [f"r{k}" for k in range(rows)], "question": [f"Question {k}?" for k in range(rows)]}),
                   embed_workspace.root / "questions.parquet")
    dag = EMBED_DAG.replace("    outputs:", "      answer:\n        model: ./tiny-model\n        prompt: \"{{ question }}\"\n    outputs:")
    console = Console(record=True, width=300)
    run_dag_file(embed_workspace.dag(dag), embed_workspace.out, parse_devices("cpu:2"), console=console,
                 engine_factory=FakeEngineFactory(), prefix_order=False, schedule="plan", profiles_root=profiles)
    pilots = [line for line in console.export_text().splitlines() if "pilot: " in line]
    assert [line[line.index("pilot: "):] for line in pilots] == [
        "pilot: 64 random rows of answer first (21.3% of 300), to learn its answer lengths; then the rest is planned on them"]


def test_an_embed_node_killed_mid_run_resumes_with_every_row_once_and_the_same_vectors(embed_workspace):
    with pytest.raises(DriverCrash):
        run(embed_workspace, FakeEngineFactory(crash_after_results=2))
    resumed = FakeEngineFactory()
    run(embed_workspace, resumed)
    assert len(resumed.requests) == len(QUESTIONS) - 2  # the two committed before the crash are not asked again
    vectors = pq.read_table(embed_workspace.out / "vectors.parquet").column("vector").to_pylist()
    assert vectors == [expected_vector(text) for _, text in QUESTIONS]


def test_the_journal_keeps_vectors_as_float32_bytes_through_reopening_and_compaction(tmp_path):
    folder = tmp_path / "journal"
    vectors = [np.array([0.1, -2.5, 3e-8], np.float32), np.array([1, 2, 3], np.float32)]
    journal = ResultJournal(folder, "print", "embed", vector_dimensions=3)
    journal.append_many([ResultRecord(k, 0, ("",), 4, 0, "stop", None, v) for k, v in enumerate(vectors)])
    journal.close()
    line = (folder / "tail-000000.jsonl").read_text().splitlines()[0]
    assert '"vector_f32": "' in line and "0.1" not in line  # base64 of the bytes, not decimal text
    reopened = ResultJournal(folder, "print", "embed", vector_dimensions=3)
    assert reopened.damage == [] and reopened.stats().committed == 2
    reopened.compact()
    segment = pq.read_table(folder / "seg-000000.parquet")
    assert segment.schema.field("vector").type == pa.list_(pa.float32(), 3)
    assert [np.array(v, np.float32).tobytes() for v in segment.column("vector").to_pylist()] == [v.tobytes() for v in vectors]


def test_a_journal_line_whose_vector_has_the_wrong_size_is_set_aside_and_its_unit_runs_again(tmp_path):
    folder = tmp_path / "journal"
    journal = ResultJournal(folder, "print", "embed", vector_dimensions=3)
    journal.append_many([ResultRecord(0, 0, ("",), 4, 0, "stop", None, np.ones(3, np.float32)),
                         ResultRecord(1, 0, ("",), 4, 0, "stop", None, np.ones(2, np.float32))])
    journal.close()
    reopened = ResultJournal(folder, "print", "embed", vector_dimensions=3)
    assert reopened.stats().committed == 1
    assert reopened.damage == [f"{folder / 'tail-000000.jsonl'}: 1 damaged line(s) set aside in tail-000000.jsonl.damaged: "
                               "line 2 (a vector of 2 floats, not 3); their units run again"]


def test_the_vector_size_comes_from_sentence_transformers_files_else_the_hidden_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": 384}))
    assert ModelKind.of(tmp_path) == ModelKind(("BertModel",), 384) and not ModelKind.of(tmp_path).generates
    (tmp_path / "2_Dense").mkdir()
    (tmp_path / "2_Dense" / "config.json").write_text(json.dumps({"in_features": 384, "out_features": 128}))
    (tmp_path / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Transformer", "path": ""},
                                                       {"type": "sentence_transformers.models.Dense", "path": "2_Dense"}]))
    assert ModelKind.of(tmp_path).vector_dimensions == 128
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 576}))
    assert ModelKind.of(tmp_path).generates


@pytest.mark.parametrize("body, message", [
    ("        system: Be brief.\n",
     "nodes.embed.system: an embed node embeds its prompt as plain text, so `system:` does not apply"),
    ("        sampling: {max_tokens: 8}\n",
     "nodes.embed.sampling: an embed node embeds its prompt as plain text, so `sampling:` does not apply"),
])
def test_an_embed_node_with_a_generation_key_is_refused(embed_workspace, body, message):
    with pytest.raises(UserError) as refused:
        load_dag(embed_workspace.dag(EMBED_DAG.replace("        task: embed\n", "        task: embed\n" + body)))
    assert str(refused.value) == message
    assert refused.value.hint == "drop `" + message.split("`")[1] + "` from nodes.embed, or make it a generation node (task: generate)"


def test_a_template_that_reads_an_embed_nodes_vector_as_text_is_refused(embed_workspace):
    dag = EMBED_DAG.replace("    outputs:", "      answer:\n        model: ./tiny-model\n        prompt: \"{{ embed }}\"\n    outputs:")
    with pytest.raises(UserError) as refused:
        load_dag(embed_workspace.dag(dag))
    assert str(refused.value) == "node 'answer' reads 'embed' as text, but 'embed' is an embed node: its result is a vector"


def test_an_unknown_task_and_a_text_field_of_an_embed_node_are_refused(embed_workspace):
    with pytest.raises(UserError) as refused:
        load_dag(embed_workspace.dag(EMBED_DAG.replace("task: embed", "task: rerank")))
    assert str(refused.value) == "nodes.embed.task must be generate, embed, score or classify, got 'rerank'"
    with pytest.raises(UserError) as refused:
        load_dag(embed_workspace.dag(EMBED_DAG.replace("vector: embed,", "vector: embed.text,")))
    assert str(refused.value) == "outputs.vectors.columns.vector: 'embed.text' names unknown field 'text'"
    assert refused.value.hint == "fields: vector, num_prompt_tokens, finish_reason"


def test_a_merge_of_an_embed_node_and_a_generation_node_is_refused(embed_workspace):
    dag = EMBED_DAG.replace("    outputs:", "      answer:\n        model: ./tiny-model\n        prompt: \"{{ question }}\"\n"
                                           "    merges:\n      either: [embed, answer]\n    outputs:")
    with pytest.raises(UserError) as refused:
        load_dag(embed_workspace.dag(dag))
    assert str(refused.value) == "merges.either joins embed and generate nodes: a row's result would be a vector or a text"
    assert refused.value.hint == "merge nodes of one task"


def test_a_generation_node_on_an_embedding_only_model_is_exit_2_at_the_checks(embed_workspace):
    dag = EMBED_DAG.replace("        task: embed\n", "").replace("vector: embed,", "vector: embed.text,")
    with pytest.raises(UserError) as refused:
        run(embed_workspace, FakeEngineFactory(), dag)
    assert str(refused.value) == ("node 'embed' generates text, but model './bert-model' (BertModel) has no language-model head: "
                                  "it embeds only")
    assert refused.value.hint == "set `task: embed` on the node, or give it a generation model"
    assert not embed_workspace.out.exists()
