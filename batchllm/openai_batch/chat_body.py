"""A `/v1/chat/completions` line's messages (any sequence of system, developer, user and assistant
messages; content a string or text parts; image_url parts in the one user message of a [system,]
user chat) and its `response_format`, checked with the engine's own grammar compiler."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from batchllm.core.errors import UserError
from batchllm.core.output_constraint import OutputConstraint
from batchllm.core.requests import Message
from batchllm.engines.constraints import check_constraint
from batchllm.models.embedded import EMBEDDED_MODELS
from batchllm.models.model_kind import ModelKind
from batchllm.openai_batch.line_errors import LineError, short

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_messages(body: dict) -> tuple[str | None, str, tuple[Message, ...] | None, tuple[str, ...] | None]:
    """(system, user message, None, its images) for a chat of an optional system message and one
    user message (the common shape, which shares its chat frame); else ("", None, the messages,
    None): images only in that one user message."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise LineError("invalid_request", "body.messages must be a non-empty list of message objects")
    roles = [m.get("role") for m in messages]
    for k, role in enumerate(roles):
        if role not in CHAT_ROLES:
            raise LineError("unsupported_body", f"body.messages[{k}].role is {short(role)}; batchllm runs "
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
        raise LineError("unsupported_body", f"body.messages[{index}].content must be a string or content parts, got {short(content)}")
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
            raise LineError("unsupported_body", f"body.messages[{index}].content[{k}] must be a text or image_url part, got {short(part)}")
    return "".join(texts), tuple(images)


@lru_cache(maxsize=64)
def sees_images(local_model: str) -> bool:
    """Whether a local model takes images: an embedded one does not; a directory, if its config has
    a vision_config; a hub id is taken as it is (the engine says)."""
    if local_model in EMBEDDED_MODELS:
        return False
    folder = Path(local_model)
    return ModelKind.of(folder).sees_images if (folder / "config.json").is_file() else True


def response_format(body: dict) -> str | None:
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
        raise LineError("invalid_request", f"body.response_format = {short(spec)} is not one of {{type: text}}, "
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
