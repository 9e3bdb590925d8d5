"""The bodies of pooling lines: a `/v1/embeddings` line's inputs, a `/score` line's pairs (vLLM's names
for its two sides; 1:1, 1:N or N:N) and a `/rerank` line's query, documents and `top_n`; each with
its other keys checked (only what changes nothing, or a parameter at its "off" value)."""

from __future__ import annotations

from batchllm.openai_batch.line_errors import EMBEDDINGS_URL, IGNORED_KEYS, RERANK_URL, SCORE_URL, LineError, same, short

EMBEDDING_KEYS = ("model", "input", *IGNORED_KEYS)
EMBEDDING_OFF_VALUES: dict[str, tuple[object, ...]] = {"encoding_format": ("float", None), "dimensions": (None,),
                                                       "truncate_prompt_tokens": (None,)}


def embedding_inputs(body: dict) -> list[str]:
    """An embedding line's input texts (its other keys checked)."""
    for key, value in body.items():
        if key in EMBEDDING_KEYS or (key in EMBEDDING_OFF_VALUES and any(same(value, off) for off in EMBEDDING_OFF_VALUES[key])):
            continue
        raise LineError("unsupported_parameter", f"body.{key} = {short(value)} is not supported on {EMBEDDINGS_URL} lines "
                                                 "(batchllm takes model and input, and encoding_format float)")
    return _texts(body.get("input"), "input")


SCORE_PAIRS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))  # vLLM's names
SCORE_OFF_VALUES: dict[str, tuple[object, ...]] = {"truncate_prompt_tokens": (None,), "use_activation": (None,)}


def score_pairs(body: dict) -> tuple[tuple[str, str | None], ...]:
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


def rerank(body: dict) -> tuple[tuple[tuple[str, str | None], ...], int | None]:
    """A rerank line's (query, document) pairs and how many of the best it returns (None: all)."""
    _check_pooling_keys(body, ("query", "documents", "top_n"), RERANK_URL, "model, query, documents and top_n")
    query = body.get("query")
    if not isinstance(query, str):
        raise LineError("unsupported_body", f"body.query must be a string, got {short(query)}")
    top_n = body.get("top_n", 0)
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
        raise LineError("invalid_request", f"body.top_n must be an integer >= 0 (0: every document), got {short(top_n)}")
    return tuple((query, text) for text in _texts(body.get("documents"), "documents")), top_n or None


def _check_pooling_keys(body: dict, names: tuple[str, ...], url: str, takes: str) -> None:
    for key, value in body.items():
        if key in ("model", *names, *IGNORED_KEYS) or (key in SCORE_OFF_VALUES and any(same(value, off) for off in SCORE_OFF_VALUES[key])):
            continue
        raise LineError("unsupported_parameter", f"body.{key} = {short(value)} is not supported on {url} lines (batchllm takes {takes})")


def _texts(value: object, name: str) -> list[str]:
    """A pooling body's texts: a string, or a non-empty list of strings (token ids are not taken)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(text, str) for text in value):
        return value
    raise LineError("unsupported_body", f"body.{name} must be a string or a non-empty list of strings, got {short(value)}")
