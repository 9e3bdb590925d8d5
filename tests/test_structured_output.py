"""Structured output: a node's `output:` constraint, parsed, checked against what the
engine's backend compiles, and carried to the engine's sampling parameters."""

from __future__ import annotations

import json

import pytest

from batchllm.dag.loader import load_dag
from batchllm.dag.model import OutputConstraint
from batchllm.engines.constraints import check_constraint
from batchllm.errors import UserError

DAG = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      route:
        model: ./tiny-model
        prompt: "{{ question }}"
        output: %s
"""


def test_choices_json_schema_and_regex_are_parsed(workspace):
    route = load_dag(workspace.dag(DAG % "{choices: [code, other]}")).nodes["route"]
    assert route.output == OutputConstraint(choices=("code", "other")) and route.output.kind == "choices"
    route = load_dag(workspace.dag(DAG % "{regex: '[0-9]+'}")).nodes["route"]
    assert route.output == OutputConstraint(regex="[0-9]+")
    schema = "{json_schema: {type: object, properties: {label: {type: string}}, required: [label]}}"
    route = load_dag(workspace.dag(DAG % schema)).nodes["route"]
    assert json.loads(route.output.json_schema) == {"type": "object", "properties": {"label": {"type": "string"}},
                                                    "required": ["label"]}


@pytest.mark.parametrize("body, message", [
    ("{choices: [a], regex: x}", "nodes.route.output must name exactly one of choices, json_schema, regex, got 2"),
    ("{}", "nodes.route.output must name exactly one of choices, json_schema, regex, got 0"),
    ("{choices: []}", "nodes.route.output.choices must be a non-empty list of non-empty strings, got []"),
    ("{choices: [a, a]}", "nodes.route.output.choices lists ['a', 'a'], with a choice twice"),
    ("{pattern: x}", "unknown key 'pattern' in nodes.route.output"),
])
def test_bad_output_constraints_are_refused_with_the_line(workspace, body, message):
    with pytest.raises(UserError) as error:
        load_dag(workspace.dag(DAG % body))
    assert message in error.value.paragraph() and "line 7" in error.value.paragraph()


def test_a_regex_the_engine_cannot_compile_is_refused_before_the_run():
    with pytest.raises(UserError, match=r"the engine cannot use the regex '\(ab'"):
        check_constraint(OutputConstraint(regex="(ab"), where="nodes.route")


def test_a_json_schema_the_engine_cannot_compile_is_refused_before_the_run():
    with pytest.raises(UserError, match='the engine cannot use this JSON schema: Unsupported type "nonsense"'):
        check_constraint(OutputConstraint(json_schema='{"type": "nonsense"}'), where="nodes.route")
    with pytest.raises(UserError, match="must describe an object with `properties`"):
        check_constraint(OutputConstraint(json_schema='{"type": "string"}'), where="nodes.route")


def test_good_constraints_pass_the_check():
    check_constraint(OutputConstraint(regex="(yes|no)"), where="x")
    check_constraint(OutputConstraint(choices=("a", "b")), where="x")
    check_constraint(OutputConstraint(json_schema='{"type": "object", "properties": {"n": {"type": "integer"}}}'), where="x")


def test_the_constraint_becomes_vllms_structured_output_parameters():
    from batchllm.engines.vllm_stepper import _structured

    params = _structured(OutputConstraint(choices=("code", "other")))
    assert params.choice == ["code", "other"] and params.json is None and params.regex is None
    params = _structured(OutputConstraint(json_schema='{"type": "object"}'))
    assert params.json == '{"type": "object"}' and params.choice is None
    assert _structured(None) is None
