"""Templates of only text and `{{ name }}` render without Jinja's per-call set-up, to the
same text and with the same undefined-name error; anything else renders with Jinja."""

from __future__ import annotations

import jinja2
import pytest

from batchllm.dag.templates import compile_template

CONTEXT = {"question": "why?", "a": "A", "b": "B", "x": 1, "y": 2.5, "none": None, "items": ["p", "q"]}


@pytest.mark.parametrize("source, simple", [
    ("{{ question }}", True), ("Q: {{ question }}\nA: {{ a }} | {{ b }}\n", True), ("plain", True), ("{{ x }}{{ y }}", True),
    ("{{ items }}", True), ("{{ a | upper }}", False), ("{% if a %}x{% endif %}", False), ("{{ none }}", False),
])
def test_the_fast_path_renders_what_jinja_renders(source, simple):
    template = compile_template(source, where="t", first_line=None)
    assert (template.parts is not None) == simple
    assert template.render(CONTEXT) == template.compiled.render(CONTEXT)


def test_an_undefined_name_is_the_same_error_on_both_paths():
    template = compile_template("Hi {{ missing }}", where="t", first_line=None)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="'missing' is undefined"):
        template.render({})
    with pytest.raises(jinja2.exceptions.UndefinedError, match="'missing' is undefined"):
        template.compiled.render({})
