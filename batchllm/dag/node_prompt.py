"""What a node sends the model for one (row, step), compiled once and rendered per row: the
one definition that the runtime (requests), the checks (a dry render) and the planner
(prompt sizes) share.

A node gives its chat in one of three shapes:
- `prompt:` (and an optional `system:`): one user message, a template each;
- `messages:` as a list of `{role, content}`, each content a template: a few-shot chat, say;
- `messages:` as one expression, `"{{ conversation }}"`: a list of `{role, content}` read
  from a column (or built from several), so a stored conversation continues where it stops.
Roles are system, user and assistant (developer is read as system, as OpenAI does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from batchllm.core.errors import UserError
from batchllm.core.images import ImageSource, row_images
from batchllm.core.requests import Message
from batchllm.dag.model import MessageTemplate, NodeSpec
from batchllm.dag.templates import PromptTemplate, bare_expression, compile_expression, compile_template, render_checked

ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}


@dataclass(frozen=True)
class RenderedPrompt:
    prompt: str  # the user message ("" when `messages` holds the chat)
    system: str | None
    messages: tuple[Message, ...] | None
    pair: str | None = None  # a score node's second text
    images: tuple[ImageSource, ...] = ()  # before the user message's text

    @property
    def text(self) -> str:
        """All the text the model reads, without the chat template (for sizes and prefixes)."""
        if self.messages is not None:
            return "".join(content for _, content in self.messages)
        return (self.system or "") + self.prompt + (self.pair or "")


class NodePrompt:
    def __init__(self, node: NodeSpec):
        self.node = node
        where = f"nodes.{node.name}"
        self._conversation = None
        self._turns: tuple[tuple[str, PromptTemplate], ...] | None = None
        self._prompt = self._system = self._pair = None
        if isinstance(node.messages, str):
            self._conversation = compile_expression(node.messages, where=f"{where}.messages")
        elif node.messages is not None:
            self._turns = tuple((m.role, compile_template(m.content, where=f"{where}.messages[{k}].content", first_line=None))
                                for k, m in enumerate(node.messages))
        else:
            self._prompt = compile_template(node.prompt, where=f"{where}.prompt", first_line=None)
            self._system = compile_template(node.system, where=f"{where}.system", first_line=None) if node.system else None
            self._pair = compile_template(node.pair, where=f"{where}.pair", first_line=None) if node.pair is not None else None
        self._images = tuple(compile_expression(source, where=f"{where}.images") for source in node.images)
        self._image_dir = Path(node.image_dir)

    def render(self, context: dict[str, object], *, where: str) -> RenderedPrompt:
        rendered = self._render_text(context, where=where)
        if not self._images:
            return rendered
        images = tuple(source for image in self._images
                       for source in row_images(image.evaluate(context, where=f"{where}.images"), self._image_dir))
        return RenderedPrompt(rendered.prompt, rendered.system, rendered.messages, rendered.pair, images)

    def _render_text(self, context: dict[str, object], *, where: str) -> RenderedPrompt:
        if self._conversation is not None:
            return RenderedPrompt("", None, conversation_of(self._conversation.evaluate(context, where=where), where=where))
        if self._turns is not None:
            return RenderedPrompt("", None, tuple((role, render_checked(t, context, where=f"{where}.messages[{k}]"))
                                                  for k, (role, t) in enumerate(self._turns)))
        assert self._prompt is not None
        system = render_checked(self._system, context, where=f"{where}.system") if self._system else None
        pair = render_checked(self._pair, context, where=f"{where}.pair") if self._pair else None
        return RenderedPrompt(render_checked(self._prompt, context, where=f"{where}.prompt"), system, None, pair)


def message_templates(value: object, where: str) -> tuple[MessageTemplate, ...] | str:
    """A DAG's `messages:` value -> its templates, or its expression; ValueError saying what is wrong."""
    if isinstance(value, str):
        expression = bare_expression(value)
        if expression is None:
            raise ValueError(f"{where} must be a list of {{role, content}} or one expression such as \"{{{{ conversation }}}}\", "
                             f"got {value!r}")
        return expression
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list of {{role, content}} or one expression, got {value!r}")
    turns = []
    for k, item in enumerate(value):
        if not isinstance(item, Mapping) or set(item) != {"role", "content"} or not isinstance(item["content"], str):
            raise ValueError(f"{where}[{k}] must be {{role: ..., content: \"a template\"}}, got {item!r}")
        role = ROLE_ALIASES.get(item["role"], item["role"])
        if role not in ROLES:
            raise ValueError(f"{where}[{k}].role is {item['role']!r}; roles are {', '.join(ROLES)}")
        turns.append(MessageTemplate(role, item["content"]))
    return tuple(turns)


def conversation_of(value: object, *, where: str) -> tuple[Message, ...]:
    """A row's conversation -> messages; UserError naming the row when it is not one."""
    if hasattr(value, "tolist"):  # a NumPy array from a list column
        value = value.tolist()
    problem = None
    messages = []
    if not isinstance(value, (list, tuple)) or not value:
        problem = f"a non-empty list of {{role, content}}, got {str(value)[:80]!r}"
    else:
        for k, item in enumerate(value):
            role = ROLE_ALIASES.get(cast(str, item.get("role")), item.get("role")) if isinstance(item, Mapping) else None
            content = item.get("content") if isinstance(item, Mapping) else None
            if role not in ROLES or not isinstance(content, str):
                problem = f"its item {k} to be {{role: one of {', '.join(ROLES)}, content: text}}, got {str(item)[:80]!r}"
                break
            messages.append((role, content))
    if problem:
        raise UserError(f"the conversation must be {problem}", where=where,
                        hint="give `messages:` a list column of structs {role, content}")
    return tuple(messages)

