"""What one failed attempt of a call to a server means, as data (`judge_failure`); the endpoint
engine applies it (`http_engine`).

- The request's own fault (a 4xx other than 408, 409 and 429, before the stream or as a code
  inside it: vLLM checks sampling parameters after the stream has begun): that row's error.
- The server's fault that every row would meet (401, 403, 404: a key refused, a model gone): the
  engine fails, and its rows run again elsewhere.
- A server that answered and failed (a 500, an error inside the stream) `MAX_FAILED_ANSWERS`
  times: that row's error.
- Anything else (the connection, a timeout, 408/409/429, 502-504, a stream cut short): sent
  again after a backoff, unless the server has been down for longer than the engine allows.

Invariant: a judgement depends only on the error and the answers that failed before it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import openai

RETRY_STATUSES = frozenset({408, 409, 429})  # and every 5xx
SERVER_FAULTS = frozenset({401, 403, 404})  # a key refused, a model gone: the engine fails (its rows run again), not the row
MAX_FAILED_ANSWERS = 5  # attempts of one request that the server answered and failed (a 500, an error inside the stream)


class Next(enum.Enum):
    ROW_FAILS = "the row's error"
    ENGINE_FAILS = "the engine fails"
    RETRY = "send it again"


@dataclass(frozen=True)
class Judgement:
    next: Next
    why: str  # the row's error, the engine's failure, or the cause a retry names if the server stays down
    failed_answers: int  # the server's failed answers to this request so far, this one included


def judge_failure(error: Exception, failed_answers: int) -> Judgement:
    """What the failed attempt `error` means, `failed_answers` of the request's attempts having failed
    on an answer of the server's before it."""
    import openai  # imported already by the client whose call failed (a run without servers never loads it)

    if isinstance(error, openai.APIStatusError):  # an HTTP error status before the stream
        status, message = error.status_code, _message(error)
        if status in SERVER_FAULTS:
            return Judgement(Next.ENGINE_FAILS, f"{status}: {message}", failed_answers)
        if status < 500 and status not in RETRY_STATUSES:
            return Judgement(Next.ROW_FAILS, f"the server refused it ({status}): {message}", failed_answers)
        cause = f"{status}: {message}"
        if status != 500:  # 502-504: the server is away (the engine's down timer), 408/409/429: busy
            return Judgement(Next.RETRY, cause, failed_answers)
        failed_answers += 1  # the server failed on this request
        if failed_answers >= MAX_FAILED_ANSWERS:
            return Judgement(Next.ROW_FAILS, f"the server failed on it {failed_answers} times: {cause}", failed_answers)
        return Judgement(Next.RETRY, cause, failed_answers)
    if isinstance(error, (openai.APIConnectionError, openai.APITimeoutError)):
        return Judgement(Next.RETRY, f"{type(error).__name__}: {error}", failed_answers)
    failed_answers += 1  # an error inside the stream (vLLM checks sampling there), a stream cut short
    refused = _in_stream_refusal(error)
    if refused or failed_answers >= MAX_FAILED_ANSWERS:
        why = refused or f"{type(error).__name__}: {error} ({failed_answers} attempts)"
        return Judgement(Next.ROW_FAILS, f"the server refused it: {why}", failed_answers)
    return Judgement(Next.RETRY, f"{type(error).__name__}: {error}", failed_answers)


def _in_stream_refusal(error: Exception) -> str | None:
    """The server's words when an error inside the stream is the request's own fault (a 4xx
    code in the error event: vLLM checks sampling parameters after the stream has begun)."""
    body = getattr(error, "body", None)
    inner = body.get("error", body) if isinstance(body, dict) else None
    if not isinstance(inner, dict):
        return None
    code = inner.get("code")
    if isinstance(code, int) and 400 <= code < 500 and code not in RETRY_STATUSES:
        return f"({code}) {inner.get('message') or error}"
    return None


def _message(error: openai.APIStatusError) -> str:
    body = error.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if body.get("message"):
            return str(body["message"])
    return str(error.message)
