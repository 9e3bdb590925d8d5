"""Prompt token ids without an engine: the model's tokenizer, applied as the worker does.

`token_ids_many` tokenizes a batch in one call of the fast (Rust) tokenizer. A chat
prompt is the chat template rendered around the user message; the template is rendered
once per system text around a sentinel, and used as a frame (`before + message + after`)
only when it proved to place the message verbatim; otherwise each prompt is rendered by
`apply_chat_template` itself. Either way the ids equal `apply_chat_template(...,
tokenize=True)`, which also tokenizes the rendered text without adding special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from batchllm.engines.protocol import EngineRequest

_SENTINEL = "\ue000batchllm-message\ue001"
_PROBE = "  A probe: two  spaces,\na new line, {braces} and <tags>.  \n"  # a template that trims or escapes fails it
_MAX_FRAMES = 1024  # distinct system texts whose frames are kept


def _messages(system: str | None, content: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]


class _RustTokenizer:
    """The model's fast tokenizer (tokenizer.json) and chat template, without importing
    transformers (whose import alone takes seconds): the template rendered as transformers
    renders it (Jinja2 sandbox, trim_blocks, lstrip_blocks, loop controls, the special
    tokens and `raise_exception` in scope)."""

    def __init__(self, tokenizer, template, special_tokens: dict[str, str]):
        self._tokenizer, self._template, self._special = tokenizer, template, special_tokens

    @classmethod
    def load(cls, model_dir: Path) -> "_RustTokenizer | None":
        """None when the directory lacks what the fast path needs (transformers then loads it)."""
        files = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
        if not all(f.is_file() for f in files):
            return None
        config = json.loads(files[1].read_text())
        template = config.get("chat_template")
        if (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text()
        if not isinstance(template, str):
            return None
        import jinja2
        import tokenizers
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        environment.globals["raise_exception"] = raise_exception
        special = {k: (v["content"] if isinstance(v, dict) else v) for k, v in config.items()
                   if k.endswith("_token") and isinstance(v, (str, dict))}
        return cls(tokenizers.Tokenizer.from_file(str(files[0])), environment.from_string(template), special)

    def render(self, messages: list[dict[str, str]]) -> str:
        return self._template.render(messages=messages, add_generation_prompt=True, tools=None, documents=None, **self._special)

    def encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)  # no offsets: faster
        return [e.ids for e in encode(texts, add_special_tokens=add_special_tokens)]


class _TransformersTokenizer:
    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def render(self, messages: list[dict[str, str]]) -> str:
        return self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [list(e) for e in self._tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


class PromptTokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self._tokenizer = _RustTokenizer.load(model_dir) or _TransformersTokenizer(model_dir)
        self._frames: dict[str | None, tuple[str, str] | None] = {}

    @property
    def loads_without_transformers(self) -> bool:
        return isinstance(self._tokenizer, _RustTokenizer)

    def _render(self, system: str | None, content: str) -> str:
        return self._tokenizer.render(_messages(system, content))

    def frame(self, system: str | None) -> tuple[str, str] | None:
        """(before, after) the user message, or None when the template does not place it verbatim."""
        if system in self._frames:
            return self._frames[system]
        rendered = self._render(system, _SENTINEL)
        frame = None
        if rendered.count(_SENTINEL) == 1:
            before, after = rendered.split(_SENTINEL)
            if self._render(system, _PROBE) == before + _PROBE + after:
                frame = (before, after)
        if len(self._frames) < _MAX_FRAMES:
            self._frames[system] = frame
        return frame

    def prompt_text(self, request: EngineRequest) -> str:
        """The text the model reads: the chat template applied, or the raw prompt."""
        if not request.chat:
            return request.prompt
        frame = self.frame(request.system)
        return frame[0] + request.prompt + frame[1] if frame else self._render(request.system, request.prompt)

    def token_ids_many(self, requests: Sequence[EngineRequest]) -> list[list[int]]:
        chat = [r for r in requests if r.chat]
        ids: dict[int, list[int]] = {}
        if chat:
            encoded = self._tokenizer.encode([self.prompt_text(r) for r in chat], add_special_tokens=False)
            ids.update((id(r), e) for r, e in zip(chat, encoded))
        plain = [r for r in requests if not r.chat]
        if plain:
            encoded = self._tokenizer.encode([r.prompt for r in plain], add_special_tokens=True)
            ids.update((id(r), e) for r, e in zip(plain, encoded))
        return [ids[id(r)] for r in requests]

    def token_ids(self, request: EngineRequest) -> list[int]:
        return self.token_ids_many([request])[0]

    def count(self, request: EngineRequest) -> int:
        return len(self.token_ids(request))
