"""One line of an OpenAI batch request file -> the request batchllm runs, or that line's error.

A line is `{"custom_id", "method": "POST", "url", "body"}` with url `/v1/chat/completions`
(body.messages: any sequence of system, developer, user and assistant messages, content a
string or text parts; image_url parts in the one user message of a [system,] user chat, shown
before its text, for a vision-language model) or `/v1/completions` (body.prompt: one string). Sampling comes from
the body (core.sampling: OpenAI's names, and vLLM's where only vLLM has the parameter) with
OpenAI's defaults (temperature 1, top_p 1; max_tokens 16 for completions, as OpenAI, and
`DEFAULT_CHAT_MAX_TOKENS` for chat); a chat's `logprobs`/`top_logprobs` keep each output
token's log probability; a chat's `response_format` (`json_schema` or `json_object`)
becomes the engine's structured output, checked per line with the engine's own grammar
compiler. A `/v1/embeddings` line (body.input: a string or a list of them; `encoding_format`
float) runs in an embed node, a `/score` line (vLLM's: text_1/text_2, queries/documents,
queries/items or data_1/data_2, each a string or a list: 1:1, 1:N or N:N pairs) and a `/rerank`
line (a query and its documents; `top_n`) in a score node (dag.node_task), one request per
input or pair (`items`). A chat's body is read in `chat_body`, a pooling line's in `pooling_body`. Invariant: every line gives exactly one `LineRecord`; a line that cannot run has
`error_code` set and says why in `error_message`, naming its line, and never stops the others.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from batchllm.core.requests import Message
from batchllm.core.sampling import SAMPLING_KEYS, SamplingError, SamplingSpec, sampling_from, sampling_mapping
from batchllm.models.embedded import EMBEDDED_MODELS
from batchllm.openai_batch.batch_dag import POOLING_TASKS
from batchllm.openai_batch.chat_body import chat_messages, response_format, sees_images
from batchllm.openai_batch.line_errors import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    IGNORED_KEYS,
    RERANK_URL,
    SCORE_URL,
    LineError,
    same,
    short,
)
from batchllm.openai_batch.model_map import split_local
from batchllm.openai_batch.pooling_body import embedding_inputs, rerank, score_pairs

KINDS = {CHAT_URL: "chat", COMPLETIONS_URL: "completion", EMBEDDINGS_URL: "embedding", SCORE_URL: "score", "/v1/score": "score",
         RERANK_URL: "rerank", "/v1/rerank": "rerank", "/v2/rerank": "rerank"}
ITEM_SEPARATOR = "\x1f"  # a pooling line's requests are `custom_id<US>k`: no custom_id may hold it
DEFAULT_CHAT_MAX_TOKENS = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
BODY_SAMPLING_KEYS = (*SAMPLING_KEYS, "max_completion_tokens")
# Parameters batchllm does not implement, accepted only at the value that means "off".
OFF_VALUES: dict[str, tuple[object, ...]] = {"stream": (False, None), "echo": (False, None), "stream_options": (None,), "logprobs": (False, None, 0),
              "stop": (None, [], "")}


@dataclass(frozen=True)
class LineRecord:
    line: int  # 1-based line number in the request file
    custom_id: str | None
    model: str | None  # body.model as requested
    local_model: str | None  # what it maps to: an embedded name, a directory or a hub id
    kind: str | None  # "chat" | "completion" | "embedding" | "score" | "rerank"
    system: str | None
    prompt: str | None  # the one user message, or the completion prompt ("" when `messages` holds the chat); None: a pooling line
    messages: tuple[Message, ...] | None = None  # a chat that is more than [system,] user
    sampling: SamplingSpec | None = None
    json_schema: str | None = None  # structured output from body.response_format (JSON text)
    error_code: str | None = None
    error_message: str | None = None
    # a pooling line's requests in order, each (text, its pair's second text or None): one per input of an
    # embedding line, per pair of a score line, per document of a rerank line (the query first in each)
    items: tuple[tuple[str, str | None], ...] | None = None
    top_n: int | None = None  # a rerank line's: the best this many results (None: all)
    images: tuple[str, ...] | None = None  # a chat's image_url parts (data: URIs, URLs), shown before its user message's text

    @property
    def shape(self) -> str:
        """How the chat is given: "messages", "system" (+ prompt) or "prompt"."""
        return "messages" if self.messages is not None else "system" if self.system is not None else "prompt"

    @property
    def group_key(self) -> str | None:
        """Lines with one key run in one node: model, endpoint, chat shape, sampling, response format."""
        if self.error_code is not None:
            return None
        sampling = sampling_mapping(self.sampling) if self.sampling is not None else None  # an embedding samples nothing
        return json.dumps([self.model, self.local_model, self.kind, self.shape, sampling, self.json_schema, bool(self.images)])


def parse_line(text: str, line: int, models: Mapping[str, str]) -> LineRecord:
    """`models`: body.model -> local model; an embedded model's own name needs no entry."""
    custom_id = model = None
    try:
        try:
            request = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LineError("invalid_json", f"not valid JSON: {exc.msg} at column {exc.colno}") from None
        if not isinstance(request, dict):
            raise LineError("invalid_request", f"a request line must be a JSON object, got {type(request).__name__}")
        custom_id = request.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            custom_id = None
            raise LineError("invalid_request", "custom_id must be a non-empty string")
        if ITEM_SEPARATOR in custom_id:
            raise LineError("invalid_request", "custom_id must not hold the control character U+001F")
        if request.get("method", "POST") != "POST":
            raise LineError("invalid_request", f"method {request.get('method')!r} is not supported; use POST")
        url = request.get("url")
        if url not in KINDS:
            raise LineError("unsupported_url", f"url {url!r} is not supported; use {CHAT_URL}, {COMPLETIONS_URL}, {EMBEDDINGS_URL}, "
                                               f"{SCORE_URL} or {RERANK_URL}")
        body = request.get("body")
        if not isinstance(body, dict):
            raise LineError("invalid_request", "body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            model = None
            raise LineError("invalid_request", "body.model must be a non-empty string")
        local = models.get(model, model if model in EMBEDDED_MODELS else None)
        if local is None:
            raise LineError("model_not_found", f"model {model!r} is not mapped to a local model; map it with --model {model}=<local model>")
        kind = KINDS[url]
        if kind in POOLING_TASKS and split_local(local)[1] is not None:
            raise LineError("invalid_request", f"model {model!r} is mapped to a LoRA adapter, which applies to chat and completion "
                                               f"lines, not to {url} lines")
        if kind == "embedding":
            return LineRecord(line, custom_id, model, local, kind, None, None, items=tuple((text, None) for text in embedding_inputs(body)))
        if kind == "score":
            return LineRecord(line, custom_id, model, local, kind, None, None, items=score_pairs(body))
        if kind == "rerank":
            items, top_n = rerank(body)
            return LineRecord(line, custom_id, model, local, kind, None, None, items=items, top_n=top_n)
        _check_keys(body, kind)
        messages = images = None
        if kind == "chat":
            system, prompt, messages, images = chat_messages(body)
        else:
            system, prompt = None, _completion_prompt(body)
        if images and not sees_images(split_local(local)[0]):
            raise LineError("invalid_request", f"body.messages holds images, but model {model!r} ({local}) sees none: its config has "
                                               "no vision_config; map the model to a vision-language model")
        return LineRecord(line, custom_id, model, local, kind, system, prompt, messages, _sampling(body, kind),
                          json_schema=response_format(body) if kind == "chat" else None, images=images)
    except LineError as error:
        return LineRecord(line, custom_id, model, None, None, None, None, error_code=error.code,
                          error_message=f"line {line}: {error.message}")


def _check_keys(body: dict, kind: str) -> None:
    content_key = "messages" if kind == "chat" else "prompt"
    for key, value in body.items():
        if key in OFF_VALUES and any(same(value, off) for off in OFF_VALUES[key]):
            continue
        if kind != "chat" and key in ("logprobs", "top_logprobs"):
            raise LineError("unsupported_parameter", f"body.{key} is supported on {CHAT_URL} lines only")
        if key in ("model", content_key, *BODY_SAMPLING_KEYS, *IGNORED_KEYS) or (key == "response_format" and kind == "chat"):
            continue
        if key == "max_completion_tokens" and kind != "chat":
            raise LineError("unsupported_parameter", "body.max_completion_tokens is for /v1/chat/completions; use max_tokens")
        raise LineError("unsupported_parameter", f"body.{key} = {short(value)} is not supported "
                                                 f"(batchllm takes {', '.join(BODY_SAMPLING_KEYS)})")


def _sampling(body: dict, kind: str) -> SamplingSpec:
    defaults = SamplingSpec(max_tokens=DEFAULT_CHAT_MAX_TOKENS if kind == "chat" else DEFAULT_COMPLETION_MAX_TOKENS, temperature=1.0)
    values = {key: body.get(key) for key in SAMPLING_KEYS}
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        values["max_tokens"] = body["max_completion_tokens"]
    if values.get("stop") == "" or values.get("stop") == []:
        values["stop"] = None
    if values.get("logprobs") == 0 and not isinstance(values.get("logprobs"), bool):
        values["logprobs"] = None
    try:
        return sampling_from(values, defaults)
    except SamplingError as error:
        key = "max_completion_tokens" if error.key == "max_tokens" and body.get("max_completion_tokens") is not None else error.key
        raise LineError("invalid_request", f"body.{error.message.replace(error.key, key, 1)}") from None


def _completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise LineError("unsupported_body", f"body.prompt must be one string, got {short(prompt)}")
    return prompt
