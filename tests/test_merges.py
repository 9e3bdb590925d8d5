"""Merging routes: `merges:` names whichever branch answered a row; `validate` warns about a
node that reads exclusive routes directly."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from batchllm.cli import app
from batchllm.core.errors import UserError
from batchllm.dag.loader import load_dag
from batchllm.dag.warnings import dag_warnings

ROUTED = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      route: {model: ./tiny-model, prompt: "{{ question }}"}
      tech:
        model: ./tiny-model
        where: "route = 'code'"
        prompt: "T {{ question }}"
      general:
        model: ./tiny-model
        where: "route <> 'code'"
        prompt: "G {{ question }}"
      judge:
        model: ./tiny-model
        prompt: "%s"
%s"""
MERGES = """    merges:
      answer: [tech, general]
    outputs:
      judged: {columns: {answer: answer, answer_tokens: answer.num_output_tokens, verdict: judge}}
"""


def test_a_merge_reads_its_members_as_upstream_nodes(workspace):
    dag = load_dag(workspace.dag(ROUTED % ("J {{ answer }}", MERGES)))
    judge = dag.nodes["judge"]
    assert dag.merges == {"answer": ("tech", "general")}
    assert judge.upstream == ("general", "tech") and judge.merges_read == ("answer",) and judge.columns_used == ()
    assert dag.topological_order() == ["route", "tech", "general", "judge"]
    assert dag.outputs["judged"].columns["answer"].node == "answer"
    assert dag_warnings(dag) == []


def test_reading_both_routes_directly_is_warned_about_with_the_fix(workspace):
    path = workspace.dag(ROUTED % ("J {{ tech }} {{ general }}", ""))
    assert dag_warnings(load_dag(path)) == [
        f"{path}, line 13: node 'judge' reads 'general' and 'tech', routes with their own `where:`; it runs only on rows "
        "where all of them answered, which may be none. To read whichever answered, merge them: "
        "`merges: {answer: [general, tech]}` and read `{{ answer }}`"]
    with pytest.MonkeyPatch.context() as patch:  # the warning comes before the engine check (tested in test_model_checks)
        patch.setattr("batchllm.engines.settings_check.check_engine_settings", lambda dag, home, kind: None)
        result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 0 and "warning: " in result.output and "merges: {answer: [general, tech]}" in result.output


@pytest.mark.parametrize("merges, message", [
    ("    merges:\n      answer: [tech]\n", "merges.answer must be a list of two or more different node names, got ['tech']"),
    ("    merges:\n      answer: [tech, tehc]\n", "merges.answer names 'tehc', which is not a node. Fix: did you mean 'tech'?"),
    ("    merges:\n      judge: [tech, general]\n", "merge name 'judge' is also a node"),
])
def test_bad_merges_are_refused(workspace, merges, message):
    with pytest.raises(UserError) as error:
        load_dag(workspace.dag(ROUTED % ("J {{ question }}", merges)))
    assert message in error.value.paragraph()
