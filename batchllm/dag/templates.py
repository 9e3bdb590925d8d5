"""Prompt templates: Jinja2 in a sandbox, with the names each template reads.

Templates come from DAG files, which may be shared, so they run in an immutable
sandbox and are also checked statically: no attribute or item whose name starts
with an underscore (the way into Python internals) is allowed at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import jinja2
from jinja2 import meta, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from batchllm.core.errors import UserError

_ENVIRONMENT = ImmutableSandboxedEnvironment(
    undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=False
)


@dataclass(frozen=True)
class PromptTemplate:
    source: str
    compiled: jinja2.Template
    names: frozenset[str]
    # A template of only text and `{{ name }}` renders as text + str(value) joined, which is
    # what Jinja renders for it (no autoescape, strict undefined), without its per-call
    # context set-up: (is_name, text or name) per part. None: render with Jinja.
    parts: tuple[tuple[bool, str], ...] | None = None

    def render(self, context: dict[str, object]) -> str:
        if self.parts is None:
            return self.compiled.render(context)
        pieces = []
        for is_name, text in self.parts:
            if not is_name:
                pieces.append(text)
            elif text in context:
                pieces.append(str(context[text]))
            else:
                raise jinja2.exceptions.UndefinedError(f"'{text}' is undefined")
        return "".join(pieces)


def _simple_parts(tree: nodes.Template) -> tuple[tuple[bool, str], ...] | None:
    """The parts of a template that is only text and plain variable outputs, else None."""
    if not all(isinstance(node, nodes.Output) for node in tree.body):
        return None
    parts = []
    for output in cast("list[nodes.Output]", tree.body):  # all Output, checked above
        for node in output.nodes:
            if isinstance(node, nodes.TemplateData):
                parts.append((False, node.data))
            elif isinstance(node, nodes.Name) and node.ctx == "load":
                parts.append((True, node.name))
            else:
                return None
    return tuple(parts)


def compile_template(source: str, *, where: str, first_line: int | None) -> PromptTemplate:
    """Parse and check a template; `first_line` is its first line in the DAG file."""
    try:
        tree = _ENVIRONMENT.parse(source)
    except jinja2.TemplateSyntaxError as exc:
        line = f", line {first_line + exc.lineno - 1}" if first_line else ""
        raise UserError(
            f"template syntax error: {exc.message}",
            where=f"{where}{line}",
            hint="check the {{ }} and {% %} pairs of the template",
        ) from None
    for node in tree.find_all((nodes.Getattr, nodes.Getitem)):
        key = node.attr if isinstance(node, nodes.Getattr) else getattr(cast(nodes.Getitem, node).arg, "value", None)
        if isinstance(key, str) and key.startswith("_"):
            line = f", line {first_line + node.lineno - 1}" if first_line else ""
            raise UserError(
                f"template reaches the private attribute {key!r}, which is not allowed",
                where=f"{where}{line}",
                hint="templates may read input columns and upstream outputs only",
            )
    return PromptTemplate(
        source=source,
        compiled=_ENVIRONMENT.from_string(tree),
        names=frozenset(meta.find_undeclared_variables(tree)),
        parts=_simple_parts(tree),
    )


def render_checked(template: PromptTemplate, context: dict[str, object], *, where: str) -> str:
    """Render, turning template runtime errors into user errors."""
    try:
        return template.render(context)
    except jinja2.exceptions.SecurityError as exc:
        raise UserError(f"template blocked by the sandbox: {exc}", where=where) from None
    except jinja2.exceptions.UndefinedError as exc:
        raise UserError(f"template error: {exc.message}", where=where) from None
    except (TypeError, ValueError, ArithmeticError, jinja2.TemplateError) as exc:
        raise UserError(f"template failed to render: {exc}", where=where) from None


@dataclass(frozen=True)
class ExpressionTemplate:
    """One Jinja expression (`conversation`, `few_shot + turns`): a value, not text."""

    source: str
    names: frozenset[str]
    compiled: object

    def evaluate(self, context: dict[str, object], *, where: str) -> object:
        try:
            return self.compiled(**context)  # type: ignore[operator]  # `compiled` is held as object: a Jinja compiled expression, callable
        except jinja2.exceptions.UndefinedError as exc:
            raise UserError(f"expression error: {exc.message}", where=where) from None
        except (jinja2.exceptions.SecurityError, TypeError, ValueError, ArithmeticError, jinja2.TemplateError) as exc:
            raise UserError(f"expression failed: {exc}", where=where) from None


def compile_expression(source: str, *, where: str) -> ExpressionTemplate:
    """Parse and check an expression as `compile_template` checks a template."""
    template = compile_template("{{ " + source + " }}", where=where, first_line=None)
    try:
        compiled = _ENVIRONMENT.compile_expression(source, undefined_to_none=False)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"expression syntax error: {exc.message}", where=where) from None
    return ExpressionTemplate(source, template.names, compiled)


def bare_expression(text: str) -> str | None:
    """The expression of a value written as exactly one `{{ ... }}` and nothing else, else None."""
    text = text.strip()
    if not (text.startswith("{{") and text.endswith("}}")) or text.count("{{") != 1:
        return None
    return text[2:-2].strip()
