"""What a failed attempt of a call to a server means: the row's error, the engine's failure, or a retry."""

from __future__ import annotations

import httpx
import openai
import pytest

from batchllm.engines.endpoint.attempt_failure import MAX_FAILED_ANSWERS, Judgement, Next, judge_failure

REQUEST = httpx.Request("POST", "http://127.0.0.1:8000/v1/chat/completions")


def status_error(code: int, message: str = "scripted") -> openai.APIStatusError:
    body = {"error": {"message": message}}
    return openai.APIStatusError(message, response=httpx.Response(code, request=REQUEST, json=body), body=body)


class StreamError(Exception):
    """An error event inside a stream, as the OpenAI client raises it (its body: the event's)."""

    def __init__(self, body: dict):
        super().__init__(str(body))
        self.body = body


@pytest.mark.parametrize("code, judgement", [
    (401, Judgement(Next.ENGINE_FAILS, "401: scripted", 0)),  # a key refused: every row would meet it
    (404, Judgement(Next.ENGINE_FAILS, "404: scripted", 0)),
    (400, Judgement(Next.ROW_FAILS, "the server refused it (400): scripted", 0)),  # the request's own fault
    (422, Judgement(Next.ROW_FAILS, "the server refused it (422): scripted", 0)),
    (429, Judgement(Next.RETRY, "429: scripted", 0)),  # busy: again, and no answer of the server's failed
    (408, Judgement(Next.RETRY, "408: scripted", 0)),
    (503, Judgement(Next.RETRY, "503: scripted", 0)),  # away: the engine's down timer decides
    (500, Judgement(Next.RETRY, "500: scripted", 1)),  # it failed on the request: counted
])
def test_a_status_before_the_stream_is_the_rows_the_engines_or_a_retry(code, judgement):
    assert judge_failure(status_error(code), 0) == judgement


def test_the_servers_failed_answers_end_the_row_at_the_fifth():
    assert judge_failure(status_error(500), MAX_FAILED_ANSWERS - 2) == Judgement(Next.RETRY, "500: scripted", MAX_FAILED_ANSWERS - 1)
    assert judge_failure(status_error(500), MAX_FAILED_ANSWERS - 1) == Judgement(
        Next.ROW_FAILS, f"the server failed on it {MAX_FAILED_ANSWERS} times: 500: scripted", MAX_FAILED_ANSWERS)
    assert judge_failure(RuntimeError("cut short"), MAX_FAILED_ANSWERS - 1) == Judgement(
        Next.ROW_FAILS, f"the server refused it: RuntimeError: cut short ({MAX_FAILED_ANSWERS} attempts)", MAX_FAILED_ANSWERS)


def test_a_lost_connection_is_a_retry_that_counts_no_failed_answer():
    judgement = judge_failure(openai.APIConnectionError(request=REQUEST), 3)
    assert judgement.next is Next.RETRY and judgement.failed_answers == 3 and judgement.why.startswith("APIConnectionError: ")
    assert judge_failure(openai.APITimeoutError(request=REQUEST), 0).next is Next.RETRY


def test_an_error_inside_the_stream_with_a_4xx_code_is_the_rows_and_any_other_one_a_counted_retry():
    refused = StreamError({"error": {"code": 400, "message": "temperature must be >= 0"}})
    assert judge_failure(refused, 0) == Judgement(Next.ROW_FAILS, "the server refused it: (400) temperature must be >= 0", 1)
    busy = StreamError({"error": {"code": 429, "message": "try later"}})
    assert judge_failure(busy, 0).next is Next.RETRY and judge_failure(busy, 0).failed_answers == 1
    assert judge_failure(RuntimeError("the stream ended without a finish reason"), 0) == Judgement(
        Next.RETRY, "RuntimeError: the stream ended without a finish reason", 1)
