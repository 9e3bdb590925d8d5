"""One line of an OpenAI batch request file -> the request batchllm runs, or that line's error.

A line is `{"custom_id", "method": "POST", "url", "body"}` with url `/v1/chat/completions`
(body.messages: an optional system (or developer) message and one user message, content a
string or text parts) or `/v1/completions` (body.prompt: one string). Sampling comes from
the body with OpenAI's defaults (temperature 1, top_p 1; max_tokens 16 for completions, as
OpenAI, and `DEFAULT_CHAT_MAX_TOKENS` for chat); a chat's `response_format` (`json_schema`
or `json_object`) becomes the engine's structured output, checked per line with the
engine's own grammar compiler. Invariant: every line gives exactly one
`LineRecord`; a line that cannot run has `error_code` set and says why in `error_message`,
naming its line, and never stops the others.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from batchllm.core.output_constraint import OutputConstraint
from batchllm.engines.constraints import check_constraint
from batchllm.core.errors import UserError
from batchllm.models.embedded import EMBEDDED_MODELS

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
KINDS = {CHAT_URL: "chat", COMPLETIONS_URL: "completion"}
DEFAULT_CHAT_MAX_TOKENS = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
INT64_MAX = 2**63 - 1
SAMPLING_KEYS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n")
IGNORED_KEYS = ("user", "metadata", "store")  # do not change what is generated
# Parameters batchllm does not implement, accepted only at the value that means "off".
OFF_VALUES = {"stream": (False, None), "logprobs": (False, None), "echo": (False, None), "stop": (None, [], ""),
              "frequency_penalty": (0, None), "presence_penalty": (0, None), "stream_options": (None,)}


@dataclass(frozen=True)
class LineRecord:
    line: int  # 1-based line number in the request file
    custom_id: str | None
    model: str | None  # body.model as requested
    local_model: str | None  # what it maps to: an embedded name, a directory or a hub id
    kind: str | None  # "chat" | "completion"
    system: str | None
    prompt: str | None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int | None = None
    json_schema: str | None = None  # structured output from body.response_format (JSON text)
    error_code: str | None = None
    error_message: str | None = None

    @property
    def group_key(self) -> str | None:
        """Lines with one key run in one node: model, endpoint, system or not, sampling."""
        if self.error_code is not None:
            return None
        return json.dumps([self.model, self.local_model, self.kind, self.system is not None, self.max_tokens,
                           self.temperature, self.top_p, self.seed, self.n, self.json_schema])


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
        if request.get("method", "POST") != "POST":
            raise LineError("invalid_request", f"method {request.get('method')!r} is not supported; use POST")
        url = request.get("url")
        if url not in KINDS:
            raise LineError("unsupported_url", f"url {url!r} is not supported; use {CHAT_URL} or {COMPLETIONS_URL}")
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
        _check_keys(body, kind)
        system, prompt = _chat_messages(body) if kind == "chat" else (None, _completion_prompt(body))
        default_max = DEFAULT_CHAT_MAX_TOKENS if kind == "chat" else DEFAULT_COMPLETION_MAX_TOKENS
        max_key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
        return LineRecord(
            line, custom_id, model, local, kind, system, prompt,
            max_tokens=_integer(body, max_key, default_max, 1),
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
            seed=_integer(body, "seed", None, 0),
            n=_integer(body, "n", 1, 1),
            json_schema=_response_format(body) if kind == "chat" else None,
        )
    except LineError as error:
        return LineRecord(line, custom_id, model, None, None, None, None, error_code=error.code,
                          error_message=f"line {line}: {error.message}")


def _check_keys(body: dict, kind: str) -> None:
    content_key = "messages" if kind == "chat" else "prompt"
    for key, value in body.items():
        if key in ("model", content_key, *SAMPLING_KEYS, *IGNORED_KEYS) or (key == "response_format" and kind == "chat"):
            continue
        if key in OFF_VALUES and any(_same(value, off) for off in OFF_VALUES[key]):
            continue
        if key == "max_completion_tokens" and kind != "chat":
            raise LineError("unsupported_parameter", "body.max_completion_tokens is for /v1/chat/completions; use max_tokens")
        raise LineError("unsupported_parameter", f"body.{key} = {_short(value)} is not supported "
                                                 f"(batchllm takes {', '.join(SAMPLING_KEYS)})")


def _same(value: object, off: object) -> bool:
    """JSON equality that keeps false and 0 apart."""
    return value == off and isinstance(value, bool) == isinstance(off, bool) and (value is None) == (off is None)


def _chat_messages(body: dict) -> tuple[str | None, str]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise LineError("invalid_request", "body.messages must be a list of message objects")
    roles = [m.get("role") for m in messages]
    if roles not in (["user"], ["system", "user"], ["developer", "user"]):
        raise LineError("unsupported_body", f"body.messages has roles {roles}; batchllm runs an optional system message "
                                            "and one user message")
    texts = [_content(m.get("content"), k) for k, m in enumerate(messages)]
    return (texts[0] if len(texts) == 2 else None), texts[-1]


def _content(content: object, index: int) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise LineError("unsupported_body", f"body.messages[{index}].content must be a string or text parts, got {_short(content)}")


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


def _completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise LineError("unsupported_body", f"body.prompt must be one string, got {_short(prompt)}")
    return prompt


def _integer(body: dict, key: str, default: int | None, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= INT64_MAX:
        raise LineError("invalid_request", f"body.{key} must be an integer in [{minimum}, 2**63), got {_short(value)}")
    return value


def _number(body: dict, key: str, default: float, low: float, high: float, *, open_low: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (low < value if open_low else low <= value) and value <= high
    if not ok:
        bounds = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        raise LineError("invalid_request", f"body.{key} must be a number in {bounds}, got {_short(value)}")
    return float(value)


def _short(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
