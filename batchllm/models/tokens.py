"""Prompt token ids without an engine: the model's tokenizer, applied as the worker does.

`token_ids_many` tokenizes a batch in one call of the fast (Rust) tokenizer. A chat
prompt is the chat template rendered around the user message; the template is rendered
once per system text around a sentinel, and used as a frame (`before + message + after`)
only when it proved to place the message verbatim; otherwise each prompt is rendered by
`apply_chat_template` itself. Either way the ids equal `apply_chat_template(...,
tokenize=True)`, which also tokenizes the rendered text without adding special tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from batchllm.engines.protocol import EngineRequest

_SENTINEL = "\ue000batchllm-message\ue001"
_PROBE = "A probe: two  spaces,\na new line and {braces}."
_MAX_FRAMES = 1024  # distinct system texts whose frames are kept


def _messages(system: str | None, content: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]


class PromptTokenizer:
    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self._frames: dict[str | None, tuple[str, str] | None] = {}

    def _render(self, system: str | None, content: str) -> str:
        return self._tokenizer.apply_chat_template(_messages(system, content), add_generation_prompt=True, tokenize=False)

    def _frame(self, system: str | None) -> tuple[str, str] | None:
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
        frame = self._frame(request.system)
        return frame[0] + request.prompt + frame[1] if frame else self._render(request.system, request.prompt)

    def token_ids_many(self, requests: Sequence[EngineRequest]) -> list[list[int]]:
        chat = [r for r in requests if r.chat]
        ids: dict[int, list[int]] = {}
        if chat:
            encoded = self._tokenizer([self.prompt_text(r) for r in chat], add_special_tokens=False)["input_ids"]
            ids.update((id(r), list(e)) for r, e in zip(chat, encoded))
        plain = [r for r in requests if not r.chat]
        if plain:
            encoded = self._tokenizer([r.prompt for r in plain], add_special_tokens=True)["input_ids"]
            ids.update((id(r), list(e)) for r, e in zip(plain, encoded))
        return [ids[id(r)] for r in requests]

    def token_ids(self, request: EngineRequest) -> list[int]:
        return self.token_ids_many([request])[0]

    def count(self, request: EngineRequest) -> int:
        return len(self.token_ids(request))
