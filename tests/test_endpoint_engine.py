"""The endpoint engine against a scripted OpenAI-compatible server on 127.0.0.1 (the standard
library's HTTP server, started and stopped by each test): streamed answers, retries, a row's
own error, the server's fault."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from batchllm.core.requests import EngineRequest, FinishReason
from batchllm.engines.endpoint import http_engine
from batchllm.engines.endpoint.http_engine import EndpointEngine, endpoint_config
from batchllm.engines.endpoint.server_check import Endpoint
from batchllm.engines.engine import EngineFailed


class Script:
    """What the server answers, by the user message: a list of statuses to go through (200 streams)."""

    def __init__(self, plan: dict[str, list[int]]):
        self.plan, self.calls, self.ids = plan, {}, []


def handler_for(script: Script):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:  # /metrics: none (the guard works from its own requests)
            self.send_response(404)
            self.end_headers()

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["messages"][-1]["content"]
            script.ids.append(self.headers.get("X-Request-Id"))
            k = script.calls.get(prompt, 0)
            script.calls[prompt] = k + 1
            statuses = script.plan.get(prompt, [200])
            status = statuses[min(k, len(statuses) - 1)]
            if status != 200:
                payload = json.dumps({"error": {"message": f"scripted {status}", "code": status}}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunks = [{"choices": [{"index": 0, "delta": {"content": "Hel"}}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
                      {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
                      {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}]
            for chunk in chunks:
                base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
                self.wfile.write(f"data: {json.dumps({**base, **chunk})}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


@pytest.fixture
def server():
    servers = []

    def start(plan: dict[str, list[int]]) -> tuple[str, Script]:
        script = Script(plan)
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(script))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}/v1", script

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def engine_for(url: str) -> EndpointEngine:
    return EndpointEngine(endpoint_config("", Endpoint(url, "m", None, None, 8, "openai", None, None), 0))


def results_of(engine: EndpointEngine, count: int, timeout_s: float = 30.0) -> dict:
    found, deadline = {}, time.monotonic() + timeout_s
    while len(found) < count:
        assert time.monotonic() < deadline, f"only {len(found)} of {count} results"
        found.update({r.request_id: r for r in engine.poll(0.2)})
    return found


def test_answers_stream_in_and_retries_and_row_errors_end_each_request_once(server, monkeypatch):
    monkeypatch.setattr(http_engine, "BACKOFF_S", (0.01,))
    url, script = server({"flaky": [503, 200], "bad": [400], "crashes": [500]})
    engine = engine_for(url)
    try:
        engine.submit([EngineRequest(1, "fine"), EngineRequest(2, "flaky"), EngineRequest(3, "bad"), EngineRequest(4, "crashes")])
        found = results_of(engine, 4)
    finally:
        engine.stop()
    assert found[1].texts == ("Hello",) and found[1].finish_reason is FinishReason.STOP
    assert (found[1].num_prompt_tokens, found[1].num_output_tokens) == (3, 2)
    assert found[2].texts == ("Hello",) and script.calls["flaky"] == 2  # a 503, then sent again
    assert found[3].is_error and found[3].error == "the server refused it (400): scripted 400" and script.calls["bad"] == 1
    assert found[4].is_error and script.calls["crashes"] == http_engine.MAX_FAILED_ANSWERS
    assert "batchllm-2-0" in script.ids and "batchllm-2-1" in script.ids  # one id per attempt, the same on a resume
    assert engine.poll(0.0) == []  # nothing answered twice


def test_a_refused_key_is_the_servers_fault_and_fails_the_engine(server):
    url, _ = server({"any": [401]})
    engine = engine_for(url)
    try:
        engine.submit([EngineRequest(1, "any")])
        deadline = time.monotonic() + 30
        with pytest.raises(EngineFailed, match="401"):
            while time.monotonic() < deadline:
                engine.poll(0.2)
    finally:
        engine.stop()
    assert not any(t.name == f"endpoint {url}" for t in threading.enumerate())  # stop ends the engine's thread
