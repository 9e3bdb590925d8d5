"""What a length model reads of a request: its text as the user wrote it (the last user
turn and the system text, not the chat template's rendering), where it came from and its
settings, and how much of a conversation came before that turn. One builder, `LengthPrompt.of`, for the planner's sample rows and the runtime's
requests alike."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

from batchllm.core.requests import EngineRequest
from batchllm.core.text_tokens import estimated_tokens


@dataclass(frozen=True)
class LengthPrompt:
    """What the length model reads of a request: its text as the user wrote it (not the chat
    template's rendering), its settings, and how long the conversation before it was."""

    last_user: str  # the last user turn (a prompt node: its rendered prompt)
    system: str = ""
    template: str = ""  # where the request came from (a DAG node, a batch file's model), a feature of its own
    prompt_tokens: int = 0
    max_tokens: int = 256
    temperature: float = 0.0
    history_chars: int | None = 0  # characters of the turns before the last user turn (None: not recorded)

    @classmethod
    def of(cls, request: EngineRequest, template: str, prompt_tokens: int | None = None) -> LengthPrompt:
        """The one way a request becomes what the length model reads (the planner's sample
        rows and the runtime's requests alike); `prompt_tokens` when counted elsewhere, else
        its token ids', else estimated from its characters. A request on a LoRA adapter has the
        adapter's name in its template: `node+adapter`."""
        turns = request.chat_messages() if request.chat or request.messages else [{"role": "user", "content": request.prompt}]
        users = [t["content"] for t in turns if t["role"] == "user"]
        system = "\n".join(t["content"] for t in turns if t["role"] in ("system", "developer"))
        last = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=len(turns))
        history = sum(len(t["content"]) for t in turns[:last] if t["role"] not in ("system", "developer"))
        if request.adapter is not None:  # an adapter's answers are its own: the template is apart from its base's
            template = f"{template}+{PurePath(request.adapter).name}"
        if prompt_tokens is None:
            prompt_tokens = (len(request.prompt_token_ids) if request.prompt_token_ids is not None
                             else round(estimated_tokens(sum(len(t["content"]) for t in turns))))
        return cls(users[-1] if users else request.prompt, system, template, int(prompt_tokens), request.max_tokens,
                   float(request.sampling.temperature), history)
