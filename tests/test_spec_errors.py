"""Broken DAGs and inputs: exit code 2, a one-paragraph message saying what/where/fix, nothing written."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchllm.cli import app

runner = CliRunner()


def run_cli(workspace, dag_text: str):
    dag = workspace.dag(dag_text)
    result = runner.invoke(app, ["run", str(dag), "--out", str(workspace.out), "--devices", "cpu:1"])
    return result, " ".join(result.output.split())


def assert_refused(result, message: str, workspace) -> None:
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not workspace.out.exists(), "nothing may be written for a bad DAG"


NODE = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      answer:
        model: ./tiny-model
        prompt: "%s"
"""


def test_cycle_is_refused_with_the_cycle_named(workspace):
    result, text = run_cli(workspace, """
        inputs:
          questions: {path: questions.parquet}
        nodes:
          first:
            model: ./tiny-model
            prompt: "{{ second }}"
          second:
            model: ./tiny-model
            prompt: "{{ first }}"
    """)
    assert_refused(result, "the nodes form a cycle: first -> second -> first", workspace)
    assert "dag.yaml, line 4" in text


def test_unknown_column_names_the_node_and_lists_columns(workspace):
    result, text = run_cli(workspace, NODE % "{{ questoin }}")
    assert_refused(result, "the template or `where` reads 'questoin', which is neither a node nor a column of input 'questions'", workspace)
    assert "nodes.answer" in text and "columns of 'questions': id, question, row_id" in text


def test_bad_yaml_gives_the_line(workspace):
    result, text = run_cli(workspace, "inputs:\n  questions: {path: [unclosed\nnodes: {}\n")
    assert_refused(result, "invalid YAML", workspace)
    assert "line 3" in text


def test_missing_input_file(workspace):
    result, _ = run_cli(workspace, (NODE % "{{ question }}").replace("questions.parquet", "nope.parquet"))
    assert_refused(result, "nope.parquet' does not exist", workspace)


def test_missing_dag_file(tmp_path):
    result = runner.invoke(app, ["run", str(tmp_path / "absent.yaml"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "absent.yaml' does not exist" in result.output
    assert not (tmp_path / "o").exists()


def test_empty_data_set(workspace):
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "question": pa.array([], pa.string())}), workspace.root / "questions.parquet")
    result, _ = run_cli(workspace, NODE % "{{ question }}")
    assert_refused(result, "questions.parquet' has no rows", workspace)


def test_non_string_prompt_column(workspace):
    pq.write_table(pa.table({"id": ["a", "b"], "question": [1, 2]}), workspace.root / "questions.parquet")
    result, _ = run_cli(workspace, NODE % "{{ question }}")
    assert_refused(result, "column 'question' of input 'questions' has type int64, but prompt columns must be strings", workspace)


def test_template_syntax_error_gives_the_line(workspace):
    result, text = run_cli(workspace, NODE % "{{ question ")
    assert_refused(result, "template syntax error", workspace)
    assert "nodes.answer.prompt, line 6" in text


@pytest.mark.parametrize("template", [
    "{{ question.__class__.__mro__ }}",
    "{{ question['__class__'] }}",
    "{{ cycler.__init__.__globals__ }}",
])
def test_template_reaching_python_internals(workspace, template):
    result, _ = run_cli(workspace, NODE % template)
    assert_refused(result, "template reaches the private attribute", workspace)


def test_sandbox_blocks_unsafe_calls_at_render_time(workspace):
    result, _ = run_cli(workspace, NODE % "{{ question.format.__self__ }}")
    assert_refused(result, "private attribute '__self__'", workspace)
    result, _ = run_cli(workspace, NODE % "{{ [].append(1) }}")
    assert_refused(result, "template blocked by the sandbox", workspace)


def test_unknown_model(workspace):
    result, _ = run_cli(workspace, (NODE % "{{ question }}").replace("./tiny-model", "no-such-model"))
    assert_refused(result, "unknown model 'no-such-model'", workspace)


def test_unknown_key_suggests_the_right_one(workspace):
    result, _ = run_cli(workspace, (NODE % "{{ question }}") + "        promt: x\n")
    assert_refused(result, "unknown key 'promt' in nodes.answer. Fix: did you mean 'prompt'?", workspace)


def test_bad_sampling_value_is_quoted(workspace):
    result, _ = run_cli(workspace, (NODE % "{{ question }}") + "        sampling: {max_tokens: -5}\n")
    assert_refused(result, "nodes.answer.sampling.max_tokens must be a positive integer, got -5", workspace)


def test_bad_where_predicate(workspace):
    result, _ = run_cli(workspace, (NODE % "{{ question }}") + "        where: \"no_such_column = 'x'\"\n")
    assert_refused(result, "the SQL predicate \"no_such_column = 'x'\" failed in DuckDB", workspace)


def test_where_cannot_read_files(workspace):
    result, _ = run_cli(workspace, (NODE % "{{ question }}") + "        where: \"(SELECT count(*) FROM read_csv('/etc/passwd')) > 0\"\n")
    assert_refused(result, "failed in DuckDB", workspace)


def test_duplicate_row_ids(workspace):
    pq.write_table(pa.table({"id": ["a", "a"], "question": ["x", "y"]}), workspace.root / "questions.parquet")
    result, _ = run_cli(workspace, NODE % "{{ question }}")
    assert_refused(result, "id_column 'id' has duplicate values", workspace)


def test_iterate_over_a_non_list_column(workspace):
    result, _ = run_cli(workspace, """
        inputs:
          questions: {path: questions.parquet, id_column: id}
        nodes:
          chain:
            model: ./tiny-model
            iterate: {over: question}
            prompt: "{{ item }}"
    """)
    assert_refused(result, "iterate.over column 'question' has type string, but must be a list of strings", workspace)


def test_bad_device_spec(workspace):
    dag = workspace.dag(NODE % "{{ question }}")
    result = runner.invoke(app, ["run", str(dag), "--out", str(workspace.out), "--devices", "tpu:3"])
    assert result.exit_code == 2
    assert "bad device spec 'tpu:3'" in result.output
    assert not workspace.out.exists()


def test_validate_accepts_a_good_dag(workspace):
    from batchllm.models.embedded import SMOLLM2_135M
    from tests.conftest import ENSEMBLE_DAG

    shutil.copy(SMOLLM2_135M.config_dir() / "config.json", workspace.root / "tiny-model")  # a config vLLM's own check accepts
    result = runner.invoke(app, ["validate", str(workspace.dag(ENSEMBLE_DAG))])
    assert result.exit_code == 0, result.output
    assert result.output.endswith("dag.yaml: ok (3 nodes: a, b, judge)\n")
