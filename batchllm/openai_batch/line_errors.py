"""What every reader of a request line's body shares: the urls a line may name, the keys that change
nothing generated, and `LineError`, a line's error code (OpenAI's words) and message."""

from __future__ import annotations

import json

CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, SCORE_URL, RERANK_URL = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                                                                    "/score", "/rerank")
IGNORED_KEYS = ("user", "metadata", "store")  # do not change what is generated


class LineError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def same(value: object, off: object) -> bool:
    """JSON equality that keeps false and 0 apart."""
    return value == off and isinstance(value, bool) == isinstance(off, bool) and (value is None) == (off is None)


def short(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
