"""Prompt token ids without an engine: the model's tokenizer, applied as the worker does.

`token_ids_many` tokenizes a batch in one call of the fast (Rust) tokenizer. A chat
prompt is the chat template rendered around the user message; the template is rendered
once per system text around a sentinel, and used as a frame (`before + message + after`)
only when it proved to place the message verbatim; otherwise each prompt is rendered by
`apply_chat_template` itself. Either way the ids equal `apply_chat_template(...,
tokenize=True)`, which also tokenizes the rendered text without adding special tokens.

Stitching (the fast tokenizer only): the tokenizer cuts its input at its added (special)
tokens first and tokenizes each piece apart. So when a frame's `before` holds a special
token and its `after` starts with one, and no added token could match across those
boundaries (none strips the whitespace beside it, none contains the boundary tokens),
the ids are `ids(before up to its last special token)` + `ids(the rest of before +
message)` + `ids(after)`: the two fixed parts are tokenized once per frame, and each prompt
costs only its own text. A frame is stitched only when that equality also held on probes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, NoReturn, cast

from batchllm.core.requests import EngineRequest
from batchllm.models.model_kind import ModelKind

if TYPE_CHECKING:
    import jinja2
    import tokenizers

_SENTINEL = "\ue000batchllm-message\ue001"
_PROBE = "  A probe: two  spaces,\na new line, {braces} and <tags>.  \n"  # a template that trims or escapes fails it
_MAX_FRAMES = 1024  # distinct system texts whose frames are kept
_STITCH_PROBES = ("", "x", " leading space", "\n\nnew lines\n", "trailing  ", _PROBE)


class _Stitch(NamedTuple):
    """A frame cut at special tokens: ids = head_ids + ids(tail + message) + after_ids."""
    head_ids: list[int]
    tail: str
    after_ids: list[int]


def _messages(system: str | None, content: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]


class _RustTokenizer:
    """The model's fast tokenizer (tokenizer.json) and chat template, without importing
    transformers (whose import alone takes seconds): the template rendered as transformers
    renders it (Jinja2 sandbox, trim_blocks, lstrip_blocks, loop controls, the special
    tokens and `raise_exception` in scope)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, template: jinja2.Template, special_tokens: dict[str, str]):
        self._tokenizer, self._template, self._special = tokenizer, template, special_tokens
        self._cut_tokens = _cut_tokens(list(tokenizer.get_added_tokens_decoder().values()))

    @classmethod
    def load(cls, model_dir: Path) -> _RustTokenizer | None:
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

        def raise_exception(message: str) -> NoReturn:
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

    def stitch(self, before: str, after: str) -> _Stitch | None:
        """The frame cut at special tokens (see the module's docstring), or None."""
        head_end = max((before.rfind(t) + len(t) for t in self._cut_tokens if t in before), default=-1)
        if head_end < 0 or not any(after.startswith(t) for t in self._cut_tokens):
            return None
        head_ids, after_ids = self.encode([before[:head_end], after], add_special_tokens=False)
        stitch = _Stitch(head_ids, before[head_end:], after_ids)
        probes = self.encode([before + p + after for p in _STITCH_PROBES], add_special_tokens=False)
        pieces = self.encode([stitch.tail + p for p in _STITCH_PROBES], add_special_tokens=False)
        if any(whole != head_ids + piece + after_ids for whole, piece in zip(probes, pieces)):
            return None
        return stitch


def _cut_tokens(added: list) -> list[str]:
    """Added tokens (`tokenizers.AddedToken`) the input is cut at with nothing beside them
    changed, and that no other added token contains (so no match can span a cut)."""
    plain = [t.content for t in added if not (t.lstrip or t.rstrip or t.single_word or t.normalized)]
    contents = [t.content for t in added]
    return [t for t in plain if t and not any(t in other and t != other for other in contents)]


class _TransformersTokenizer:
    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def render(self, messages: list[dict[str, str]]) -> str:
        return cast(str, self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))  # tokenize=False: text

    def encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [list(e) for e in self._tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


class PromptTokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self._tokenizer = _RustTokenizer.load(model_dir) or _TransformersTokenizer(model_dir)
        kind = ModelKind.of(model_dir)
        self.image_token = kind.image_token  # a vision-language model's placeholder, one per image
        self.image_tokens = kind.image_tokens  # what a placeholder expands to (None: no vision model)
        self._frames: dict[str | None, tuple[str, str] | None] = {}
        self._stitches: dict[str | None, _Stitch | None] = {}

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

    def stitch(self, system: str | None) -> _Stitch | None:
        """The frame of `system` cut for stitching (see the module's docstring), or None."""
        if system in self._stitches:
            return self._stitches[system]
        frame = self.frame(system)
        stitch = self._tokenizer.stitch(*frame) if frame and isinstance(self._tokenizer, _RustTokenizer) else None
        if len(self._stitches) < _MAX_FRAMES:
            self._stitches[system] = stitch
        return stitch

    def prompt_text(self, request: EngineRequest) -> str:
        """The text the model reads: the chat template applied, or the raw prompt. A request's
        images are placeholders in it, one `image_token` each (the engine's processor expands them)."""
        if not request.chat:
            return request.prompt
        if request.images:
            return self._image_prompt_text(request)
        if request.messages is not None:  # a conversation: rendered whole
            return self._tokenizer.render(request.chat_messages())
        frame = self.frame(request.system)
        return frame[0] + request.prompt + frame[1] if frame else self._render(request.system, request.prompt)

    def _image_prompt_text(self, request: EngineRequest) -> str:
        """The chat template given the user message as content parts (images, then text); a template
        that takes text only (no placeholder per image in what it renders): the placeholders before
        the text, a line each, as vLLM places them for such templates."""
        before = self._tokenizer.render(request.chat_messages()).count(self.image_token)
        try:
            rendered = self._tokenizer.render(request.content_parts(lambda k: {"type": "image"}))
        except Exception:  # noqa: BLE001  a template that takes text only fails on a list of parts
            rendered = ""
        if rendered.count(self.image_token) - before == len(request.images) and request.prompt in rendered:
            return rendered
        placeholders = "\n".join([self.image_token] * len(request.images))
        return self._tokenizer.render(request._replace(prompt=f"{placeholders}\n{request.prompt}", images=()).chat_messages())

    def token_ids_many(self, requests: Sequence[EngineRequest]) -> list[list[int]]:
        chat = [(r, None if r.messages is not None or r.images else self.stitch(r.system)) for r in requests if r.chat]
        ids: dict[int, list[int]] = {}
        if chat:
            texts = [stitch.tail + r.prompt if stitch else self.prompt_text(r) for r, stitch in chat]
            encoded = self._tokenizer.encode(texts, add_special_tokens=False)
            ids.update((id(r), stitch.head_ids + e + stitch.after_ids if stitch else e) for (r, stitch), e in zip(chat, encoded))
        plain = [r for r in requests if not r.chat]
        if plain:
            encoded = self._tokenizer.encode([r.prompt for r in plain], add_special_tokens=True)
            ids.update((id(r), e) for r, e in zip(plain, encoded))
        return [ids[id(r)] for r in requests]

    def token_ids(self, request: EngineRequest) -> list[int]:
        return self.token_ids_many([request])[0]

    def count(self, request: EngineRequest) -> int:
        return len(self.token_ids(request))

