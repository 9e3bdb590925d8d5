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
input or pair (`items`). Invariant: every line gives exactly one `LineRecord`; a line that cannot run has
`error_code` set and says why in `error_message`, naming its line, and never stops the others.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from batchllm.core.errors import UserError
from batchllm.core.output_constraint import OutputConstraint
from batchllm.core.requests import Message
from batchllm.core.sampling import SAMPLING_KEYS, SamplingError, SamplingSpec, sampling_from, sampling_mapping
from batchllm.engines.constraints import check_constraint
from batchllm.models.embedded import EMBEDDED_MODELS
from batchllm.models.model_kind import ModelKind
from batchllm.openai_batch.batch_dag import POOLING_TASKS
from batchllm.openai_batch.model_map import split_local

CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, SCORE_URL, RERANK_URL = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                                                                    "/score", "/rerank")
KINDS = {CHAT_URL: "chat", COMPLETIONS_URL: "completion", EMBEDDINGS_URL: "embedding", SCORE_URL: "score", "/v1/score": "score",
         RERANK_URL: "rerank", "/v1/rerank": "rerank", "/v2/rerank": "rerank"}
ITEM_SEPARATOR = "\x1f"  # a pooling line's requests are `custom_id<US>k`: no custom_id may hold it
DEFAULT_CHAT_MAX_TOKENS = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
BODY_SAMPLING_KEYS = (*SAMPLING_KEYS, "max_completion_tokens")
IGNORED_KEYS = ("user", "metadata", "store")  # do not change what is generated
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


class LineError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


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
            return LineRecord(line, custom_id, model, local, kind, None, None, items=tuple((text, None) for text in _embedding_inputs(body)))
        if kind == "score":
            return LineRecord(line, custom_id, model, local, kind, None, None, items=_score_pairs(body))
        if kind == "rerank":
            items, top_n = _rerank(body)
            return LineRecord(line, custom_id, model, local, kind, None, None, items=items, top_n=top_n)
        _check_keys(body, kind)
        messages = images = None
        if kind == "chat":
            system, prompt, messages, images = _chat_messages(body)
        else:
            system, prompt = None, _completion_prompt(body)
        if images and not _sees_images(split_local(local)[0]):
            raise LineError("invalid_request", f"body.messages holds images, but model {model!r} ({local}) sees none: its config has "
                                               "no vision_config; map the model to a vision-language model")
        return LineRecord(line, custom_id, model, local, kind, system, prompt, messages, _sampling(body, kind),
                          json_schema=_response_format(body) if kind == "chat" else None, images=images)
    except LineError as error:
        return LineRecord(line, custom_id, model, None, None, None, None, error_code=error.code,
                          error_message=f"line {line}: {error.message}")


def _check_keys(body: dict, kind: str) -> None:
    content_key = "messages" if kind == "chat" else "prompt"
    for key, value in body.items():
        if key in OFF_VALUES and any(_same(value, off) for off in OFF_VALUES[key]):
            continue
        if kind != "chat" and key in ("logprobs", "top_logprobs"):
            raise LineError("unsupported_parameter", f"body.{key} is supported on {CHAT_URL} lines only")
        if key in ("model", content_key, *BODY_SAMPLING_KEYS, *IGNORED_KEYS) or (key == "response_format" and kind == "chat"):
            continue
        if key == "max_completion_tokens" and kind != "chat":
            raise LineError("unsupported_parameter", "body.max_completion_tokens is for /v1/chat/completions; use max_tokens")
        raise LineError("unsupported_parameter", f"body.{key} = {_short(value)} is not supported "
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


def _same(value: object, off: object) -> bool:
    """JSON equality that keeps false and 0 apart."""
    return value == off and isinstance(value, bool) == isinstance(off, bool) and (value is None) == (off is None)


def _chat_messages(body: dict) -> tuple[str | None, str, tuple[Message, ...] | None, tuple[str, ...] | None]:
    """(system, user message, None, its images) for a chat of an optional system message and one
    user message (the common shape, which shares its chat frame); else ("", None, the messages,
    None): images only in that one user message."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise LineError("invalid_request", "body.messages must be a non-empty list of message objects")
    roles = [m.get("role") for m in messages]
    for k, role in enumerate(roles):
        if role not in CHAT_ROLES:
            raise LineError("unsupported_body", f"body.messages[{k}].role is {_short(role)}; batchllm runs "
                                                f"{', '.join(CHAT_ROLES)} messages")
    single = roles in (["user"], ["system", "user"], ["developer", "user"])
    parts = [_content(m.get("content"), k, images_here=single and k == len(messages) - 1) for k, m in enumerate(messages)]
    texts = [text for text, _ in parts]
    if single:
        return (texts[0] if len(texts) == 2 else None), texts[-1], None, parts[-1][1] or None
    return None, "", tuple((CHAT_ROLES[role], text) for role, text in zip(roles, texts)), None


def _content(content: object, index: int, images_here: bool) -> tuple[str, tuple[str, ...]]:
    """A message's text (a string, or its text parts joined) and its image_url parts' URLs (in the
    one user message of a [system,] user chat only: they go before its text)."""
    if isinstance(content, str):
        return content, ()
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise LineError("unsupported_body", f"body.messages[{index}].content must be a string or content parts, got {_short(content)}")
    texts, images = [], []
    for k, part in enumerate(content):
        if part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif part.get("type") == "image_url" and images_here:
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise LineError("invalid_request", f"body.messages[{index}].content[{k}].image_url.url must be a non-empty string")
            images.append(url)
        elif part.get("type") == "image_url":
            raise LineError("unsupported_body", f"body.messages[{index}].content[{k}] is an image: batchllm takes images in the one user "
                                                "message of a chat of [system,] user")
        else:
            raise LineError("unsupported_body", f"body.messages[{index}].content[{k}] must be a text or image_url part, got {_short(part)}")
    return "".join(texts), tuple(images)


@lru_cache(maxsize=64)
def _sees_images(local_model: str) -> bool:
    """Whether a local model takes images: an embedded one does not; a directory, if its config has
    a vision_config; a hub id is taken as it is (the engine says)."""
    if local_model in EMBEDDED_MODELS:
        return False
    folder = Path(local_model)
    return ModelKind.of(folder).sees_images if (folder / "config.json").is_file() else True


def _response_format(body: dict) -> str | None:
    """body.response_format -> a JSON schema (text) for the engine, or None for free text."""
    spec = body.get("response_format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = '{"type": "object"}'
    elif kind == "json_schema" and isinstance(spec.get("json_schema"), dict) and isinstance(spec["json_schema"].get("schema"), dict):
        schema = json.dumps(spec["json_schema"]["schema"])
    else:
        raise LineError("invalid_request", f"body.response_format = {_short(spec)} is not one of {{type: text}}, "
                                           "{type: json_object}, {type: json_schema, json_schema: {name, schema}}")
    problem = _schema_problem(schema)
    if problem is not None:
        raise LineError("invalid_request", f"body.response_format: {problem}")
    return schema


@lru_cache(maxsize=256)
def _schema_problem(schema: str) -> str | None:
    """Why the engine cannot use this schema, or None (compiled once per distinct schema)."""
    try:
        check_constraint(OutputConstraint(json_schema=schema), where="body.response_format")
    except UserError as error:
        return str(error)
    return None


EMBEDDING_KEYS = ("model", "input", *IGNORED_KEYS)
EMBEDDING_OFF_VALUES: dict[str, tuple[object, ...]] = {"encoding_format": ("float", None), "dimensions": (None,),
                                                       "truncate_prompt_tokens": (None,)}


def _embedding_inputs(body: dict) -> list[str]:
    """An embedding line's input texts (its other keys checked)."""
    for key, value in body.items():
        if key in EMBEDDING_KEYS or (key in EMBEDDING_OFF_VALUES and any(_same(value, off) for off in EMBEDDING_OFF_VALUES[key])):
            continue
        raise LineError("unsupported_parameter", f"body.{key} = {_short(value)} is not supported on {EMBEDDINGS_URL} lines "
                                                 "(batchllm takes model and input, and encoding_format float)")
    return _texts(body.get("input"), "input")


SCORE_PAIRS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))  # vLLM's names
SCORE_OFF_VALUES: dict[str, tuple[object, ...]] = {"truncate_prompt_tokens": (None,), "use_activation": (None,)}


def _score_pairs(body: dict) -> tuple[tuple[str, str | None], ...]:
    """A score line's pairs, as vLLM pairs its two sides: one text with each of the other side's
    (1:1, 1:N), or the two lists item by item (N:N); its other keys checked."""
    names = next((pair for pair in SCORE_PAIRS if pair[0] in body and pair[1] in body),
                 next((pair for pair in SCORE_PAIRS if pair[0] in body or pair[1] in body), SCORE_PAIRS[0]))
    _check_pooling_keys(body, names, SCORE_URL, f"model and its two sides: {names[0]} and {names[1]}")
    first, second = _texts(body.get(names[0]), names[0]), _texts(body.get(names[1]), names[1])
    if len(first) == 1:
        return tuple((first[0], text) for text in second)
    if len(first) != len(second):
        raise LineError("invalid_request", f"body.{names[0]} has {len(first)} texts and body.{names[1]} {len(second)}: "
                                           "score 1:1, 1:N or N:N texts")
    return tuple(zip(first, second))


def _rerank(body: dict) -> tuple[tuple[tuple[str, str | None], ...], int | None]:
    """A rerank line's (query, document) pairs and how many of the best it returns (None: all)."""
    _check_pooling_keys(body, ("query", "documents", "top_n"), RERANK_URL, "model, query, documents and top_n")
    query = body.get("query")
    if not isinstance(query, str):
        raise LineError("unsupported_body", f"body.query must be a string, got {_short(query)}")
    top_n = body.get("top_n", 0)
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
        raise LineError("invalid_request", f"body.top_n must be an integer >= 0 (0: every document), got {_short(top_n)}")
    return tuple((query, text) for text in _texts(body.get("documents"), "documents")), top_n or None


def _check_pooling_keys(body: dict, names: tuple[str, ...], url: str, takes: str) -> None:
    for key, value in body.items():
        if key in ("model", *names, *IGNORED_KEYS) or (key in SCORE_OFF_VALUES and any(_same(value, off) for off in SCORE_OFF_VALUES[key])):
            continue
        raise LineError("unsupported_parameter", f"body.{key} = {_short(value)} is not supported on {url} lines (batchllm takes {takes})")


def _texts(value: object, name: str) -> list[str]:
    """A pooling body's texts: a string, or a non-empty list of strings (token ids are not taken)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(text, str) for text in value):
        return value
    raise LineError("unsupported_body", f"body.{name} must be a string or a non-empty list of strings, got {_short(value)}")


def _completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise LineError("unsupported_body", f"body.prompt must be one string, got {_short(prompt)}")
    return prompt


def _short(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
