"""Inputs and outputs at URIs a pyarrow filesystem opens; `file://` stands in for s3:// here
(same code path: FileSystem.from_uri, copy_files), so no credentials or network are needed."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchllm.core.errors import UserError
from batchllm.dag.loader import load_dag
from batchllm.engines.devices import DeviceSet
from batchllm.runtime.launch import run_dag_file
from tests.conftest import QUESTIONS
from tests.fakes import FakeEngineFactory

DAG = """
    inputs:
      questions: {path: "%s", id_column: id}
    nodes:
      a:
        model: ./tiny-model
        prompt: "A {{ question }}"
    outputs:
      answers:
        columns: {question: question, answer: a}
        copy_to: "%s"
"""


def run(workspace, dag_text: str):
    return run_dag_file(workspace.dag(dag_text), workspace.out, DeviceSet("cpu", (0, 1)), console=Console(quiet=True),
                        engine_factory=FakeEngineFactory(), prefix_order=False, schedule="sequential")


@pytest.fixture
def bucket(tmp_path):
    """A folder standing for a bucket, with the questions as JSON lines."""
    folder = tmp_path / "bucket"
    (folder / "in").mkdir(parents=True)
    (folder / "in" / "questions.jsonl").write_text("".join(json.dumps({"id": q, "question": t}) + "\n" for q, t in QUESTIONS))
    return folder


def test_an_input_at_a_uri_is_fetched_once_and_outputs_are_copied_to_theirs(workspace, bucket, isolated_home):
    dag = DAG % (f"file://{bucket}/in/questions.jsonl", f"file://{bucket}/out/answers.parquet")
    assert load_dag(workspace.dag(dag)).inputs["questions"].uri == f"file://{bucket}/in/questions.jsonl"
    run(workspace, dag)
    copied = pq.read_table(bucket / "out" / "answers.parquet")
    assert copied == pq.read_table(workspace.out / "answers.parquet")
    assert copied.column("answer").to_pylist() == [f"<A {t}>" for _, t in QUESTIONS]
    fetched = list((isolated_home / "remote").iterdir())
    assert len(fetched) == 1 and (fetched[0] / "questions.jsonl").is_file()
    run(workspace, dag)  # nothing changed remotely: not fetched again, and the run resumes (nothing to do)
    assert list((isolated_home / "remote").iterdir()) == fetched


def test_a_changed_remote_file_is_fetched_again_and_is_new_data(workspace, bucket, isolated_home):
    dag = DAG % (f"file://{bucket}/in/questions.jsonl", f"file://{bucket}/out/answers.parquet")
    run(workspace, dag)
    with open(bucket / "in" / "questions.jsonl", "a") as handle:
        handle.write(json.dumps({"id": "q5", "question": "One more?"}) + "\n")
    with pytest.raises(UserError, match="different version of node 'a'"):
        run(workspace, dag)
    assert len(list((isolated_home / "remote").iterdir())) == 2


def test_a_folder_of_parquet_files_at_a_uri(workspace, bucket):
    pq.write_table(pq.read_table(workspace.root / "questions.parquet"), bucket / "in" / "part-0.parquet")
    (bucket / "in" / "questions.jsonl").unlink()
    run(workspace, DAG % (f"file://{bucket}/in", f"file://{bucket}/out/answers.parquet"))
    assert pq.read_table(bucket / "out" / "answers.parquet").num_rows == len(QUESTIONS)


@pytest.mark.parametrize("uri, message", [
    ("file:///nowhere/questions.jsonl", "input 'file:///nowhere/questions.jsonl' does not exist"),
    ("nosuch://bucket/questions.jsonl", "cannot open 'nosuch://bucket/questions.jsonl'"),
])
def test_a_bad_input_uri_is_exit_2_before_anything_is_written(workspace, uri, message):
    with pytest.raises(UserError, match=message) as error:
        run(workspace, DAG % (uri, "file:///tmp/unused.parquet"))
    assert error.value.where.endswith("inputs.questions.path")
    assert not workspace.out.exists()


@pytest.mark.parametrize("target, message", [
    ("{bucket}/in/questions.jsonl/answers.parquet", r"copy_to '.*' cannot be written: '.*questions.jsonl' is a file, not a folder"),
    ("{bucket}/in", r"copy_to '.*/in' is a folder"),
    ("nosuch://bucket/answers.parquet", "cannot open 'nosuch://bucket/answers.parquet'"),
])
def test_a_bad_copy_to_is_exit_2_before_anything_runs(workspace, bucket, target, message):
    uri = target.format(bucket=f"file://{bucket}")
    with pytest.raises(UserError, match=message) as error:
        run(workspace, DAG % (f"file://{bucket}/in/questions.jsonl", uri))
    assert error.value.where.endswith("outputs.answers.copy_to")
    assert not workspace.out.exists()


def test_a_copy_to_folder_that_does_not_exist_yet_is_accepted_and_made(workspace, bucket):
    run(workspace, DAG % (f"file://{bucket}/in/questions.jsonl", f"file://{bucket}/new/deeper/answers.parquet"))
    assert pq.read_table(bucket / "new" / "deeper" / "answers.parquet").num_rows == len(QUESTIONS)
