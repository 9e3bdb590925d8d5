"""Node fingerprints change with what decides results, and only with that."""

from __future__ import annotations

from batchllm.dag.loader import load_dag
from batchllm.runtime.fingerprint import node_fingerprints
from tests.conftest import ENSEMBLE_DAG


def test_a_node_moved_in_the_file_keeps_its_fingerprint_and_a_changed_prompt_does_not(workspace):
    before = node_fingerprints(load_dag(workspace.dag(ENSEMBLE_DAG)))
    moved = node_fingerprints(load_dag(workspace.dag("\n\n# a comment\n" + ENSEMBLE_DAG, "moved.yaml")))
    assert moved == before
    changed = node_fingerprints(load_dag(workspace.dag(ENSEMBLE_DAG.replace('"B {{ question }}"', '"B2 {{ question }}"'), "b.yaml")))
    assert changed["a"] == before["a"] and changed["b"] != before["b"] and changed["judge"] != before["judge"]


def test_the_order_of_a_merge_decides_the_readers_fingerprint(workspace):
    dag = """
        inputs:
          questions: {path: questions.parquet, id_column: id}
        merges:
          answer: [%s]
        nodes:
          a: {model: ./tiny-model, prompt: "A {{ question }}"}
          b: {model: ./tiny-model, prompt: "B {{ question }}"}
          judge: {model: ./tiny-model, prompt: "J {{ answer }}"}
    """
    ab = node_fingerprints(load_dag(workspace.dag(dag % "a, b", "ab.yaml")))
    ba = node_fingerprints(load_dag(workspace.dag(dag % "b, a", "ba.yaml")))
    assert ab["a"] == ba["a"] and ab["judge"] != ba["judge"]


def test_sampling_keys_added_later_leave_earlier_runs_resumable_and_count_once_set(workspace):
    from batchllm.runtime.fingerprint import _decisive_fields

    before = node_fingerprints(load_dag(workspace.dag(ENSEMBLE_DAG)))
    assert _decisive_fields(load_dag(workspace.dag(ENSEMBLE_DAG)).nodes["a"])["sampling"] == {  # what earlier versions hashed
        "max_tokens": 128, "temperature": 0.0, "top_p": 1.0, "seed": None, "n": 1}
    for key, value in [("stop", "['###']"), ("repetition_penalty", "1.2"), ("logprobs", "true"), ("top_k", "5")]:
        text = ENSEMBLE_DAG.replace('prompt: "A {{ question }}"', f'prompt: "A {{{{ question }}}}"\n        sampling: {{{key}: {value}}}')
        changed = node_fingerprints(load_dag(workspace.dag(text, f"{key}.yaml")))
        assert changed["a"] != before["a"] and changed["b"] == before["b"], key


def test_a_nodes_images_decide_its_fingerprint_and_the_nodes_without_any_keep_theirs(workspace):
    from batchllm.runtime.fingerprint import _decisive_fields

    before = node_fingerprints(load_dag(workspace.dag(ENSEMBLE_DAG)))
    assert "image_dir" not in _decisive_fields(load_dag(workspace.dag(ENSEMBLE_DAG)).nodes["a"])  # earlier runs stay resumable
    shown = node_fingerprints(load_dag(workspace.dag(ENSEMBLE_DAG.replace('prompt: "A {{ question }}"',
                                                                          'prompt: "A {{ question }}"\n        images: "{{ id }}"'), "i.yaml")))
    assert shown["a"] != before["a"] and shown["b"] == before["b"]
