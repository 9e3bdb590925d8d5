"""Prompt token counts without an engine: the model's tokenizer, applied as the worker does."""

from __future__ import annotations

from pathlib import Path

from batchllm.engines.protocol import EngineRequest


class PromptTokenizer:
    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def token_ids(self, request: EngineRequest) -> list[int]:
        if not request.chat:
            return list(self._tokenizer.encode(request.prompt))
        messages = ([{"role": "system", "content": request.system}] if request.system else [])
        messages.append({"role": "user", "content": request.prompt})
        ids = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    def count(self, request: EngineRequest) -> int:
        return len(self.token_ids(request))
