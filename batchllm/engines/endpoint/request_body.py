"""An engine request as the body of an OpenAI-compatible call, and a streamed answer back
into an `EngineResult`.

Chat requests go to `/chat/completions` (the server applies its own chat template: the same
model files give the same tokens as a local engine), raw prompts to `/completions`. A request's
images go as content parts before its text (an unreadable one: ImageUnreadable, a ValueError,
that row's error). Keys
OpenAI has are sent under their names, the others (vLLM's and SGLang's) in the body too;
a key at its default is left out, so a plain OpenAI-compatible server sees a plain request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from batchllm.core.images import data_uri
from batchllm.core.requests import EngineRequest, EngineResult, FinishReason, TokenLogprob
from batchllm.core.sampling import request_seed

FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def request_body(request: EngineRequest, served_model: str, server_kind: str, priority: int | None) -> dict:
    """`served_model`: the base's name on the server; a request with an adapter names the adapter (as a
    server with LoRA modules serves each under its own name)."""
    s = request.sampling
    # vLLM's continuous usage: every chunk says how many tokens it carries (the guard counts one gap per token)
    usage = {"include_usage": True, **({"continuous_usage_stats": True} if server_kind == "vllm" else {})}
    body: dict = {"model": request.adapter or served_model, "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
                  "n": s.n, "stream": True, "stream_options": usage}
    if request.chat and request.images:  # OpenAI's content parts: each image as its URL or a data: URI of its bytes
        body["messages"] = request.content_parts(lambda k: {"type": "image_url", "image_url": {"url": data_uri(request.images[k - 1], k)}})
    elif request.chat:
        body["messages"] = request.chat_messages()
    else:
        body["prompt"] = request.prompt
    if s.seed is not None:
        body["seed"] = request_seed(s.seed, request.request_id)
    if s.stop:
        body["stop"] = list(s.stop)
    for key, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0), ("top_k", 0),
                         ("min_p", 0.0), ("ignore_eos", False), ("min_tokens", 0)):
        if getattr(s, key) != default:
            body[key] = getattr(s, key)
    if s.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in s.logit_bias}
    if s.logprobs:
        if request.chat:
            body["logprobs"], body["top_logprobs"] = True, s.top_logprobs
        else:
            body["logprobs"] = s.top_logprobs
    if request.output is not None:
        body.update(_structured(request, server_kind))
    if priority is not None:
        body["priority"] = priority
    return body


def _structured(request: EngineRequest, server_kind: str) -> dict:
    """The output constraint as the server takes it: vLLM's `structured_outputs`, SGLang's own
    keys, OpenAI's `response_format` for a JSON schema elsewhere."""
    output = request.output
    assert output is not None
    if server_kind == "vllm":
        key = {"choices": "choice", "json_schema": "json", "regex": "regex"}[output.kind]
        value = list(output.choices) if output.choices else (json.loads(output.json_schema) if output.json_schema else output.regex)
        return {"structured_outputs": {key: value}}
    if server_kind == "sglang" and output.regex is not None:
        return {"regex": output.regex}
    if server_kind == "sglang" and output.choices:
        return {"regex": "(" + "|".join(_escaped(c) for c in output.choices) + ")"}
    if output.json_schema is not None:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": json.loads(output.json_schema)}}}
    raise ValueError(f"a {output.kind} output needs a vLLM or SGLang server; this one is {server_kind!r}")


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


@dataclass
class StreamedAnswer:
    """What the chunks of one streamed call add up to."""

    n: int
    pieces: list[list[str]] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int | None = None  # from the usage chunk

    def __post_init__(self) -> None:
        self.pieces = [[] for _ in range(self.n)]
        self.finish = [None] * self.n

    def add(self, chunk: dict) -> int:
        """One chunk (as a dict); how many output tokens it carried (by the server's running count
        when it sends one with every chunk, with text or not; else 1 for a chunk with text)."""
        text = False
        for choice in chunk.get("choices") or ():
            index = int(choice.get("index", 0))
            if index >= self.n:
                continue
            piece = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
            if piece:
                self.pieces[index].append(piece)
                text = True
            if choice.get("finish_reason"):
                self.finish[index] = choice["finish_reason"]
            if index == 0 and choice.get("logprobs"):
                self.logprobs.extend(_token_logprobs(choice["logprobs"]))
        usage = chunk.get("usage")
        before = self.output_tokens
        if usage:
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.output_tokens = int(usage.get("completion_tokens") or 0)
        if not text:  # a token with no text of its own yet (part of a character, the end of the answer) is a token too, when
            # the server counts as it goes: left out, the next chunk's gap spans two steps as one (3.5 % of vLLM's chunks here)
            return max(0, (self.output_tokens or 0) - before) if usage and before is not None else 0
        return max(1, (self.output_tokens or 0) - (before or 0)) if usage else 1

    def result(self, request: EngineRequest) -> EngineResult:
        reason = FINISH_REASONS.get(self.finish[0] or "", FinishReason.STOP)
        texts = tuple("".join(p) for p in self.pieces)
        output_tokens = self.output_tokens if self.output_tokens is not None else sum(len(p) for p in self.pieces)
        return EngineResult(request.request_id, texts, self.prompt_tokens, output_tokens, reason,
                            logprobs=tuple(self.logprobs) if request.sampling.logprobs else None)


def _token_logprobs(logprobs: dict) -> list[TokenLogprob]:
    """Chat's `logprobs.content[]`, or completions' parallel lists."""
    if logprobs.get("content") is not None:
        return [TokenLogprob(item["token"], float(item["logprob"]),
                             tuple((t["token"], float(t["logprob"])) for t in item.get("top_logprobs") or ()))
                for item in logprobs["content"]]
    tokens, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    return [TokenLogprob(token, float(value if value is not None else 0.0),
                         tuple(sorted(((t, float(v)) for t, v in (top or {}).items()), key=lambda tv: -tv[1])))
            for token, value, top in zip(tokens, values, tops)]
