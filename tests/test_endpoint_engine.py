"""The endpoint engine against a scripted OpenAI-compatible server on 127.0.0.1 (the standard
library's HTTP server, started and stopped by each test): streamed answers, retries, a row's
own error, the server's fault."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from batchllm.core.endpoint import Endpoint
from batchllm.core.requests import EngineRequest, FinishReason
from batchllm.engines.endpoint import http_engine
from batchllm.engines.endpoint.attempt_failure import MAX_FAILED_ANSWERS
from batchllm.engines.endpoint.guard_targets import GuardChange, GuardReading
from batchllm.engines.endpoint.http_engine import EndpointEngine, endpoint_config
from batchllm.engines.engine import EngineFailed


class Script:
    """What the server answers, by the user message: a list of statuses to go through (200 streams).
    A message starting "slow" streams SLOW_CHUNKS pieces SLOW_GAP_S apart; `streams` counts the
    streams open now and `peak_since_mark` the most open at once since `mark()`."""

    def __init__(self, plan: dict[str, list[int]]):
        self.plan, self.calls, self.ids = plan, {}, []
        self.lock, self.streams, self.peak_since_mark = threading.Lock(), 0, 0

    def mark(self) -> None:
        with self.lock:
            self.peak_since_mark = self.streams


SLOW_CHUNKS, SLOW_GAP_S = 30, 0.1
STALL_S = 1.5


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
            if prompt.startswith("slow"):
                self.stream_slowly(script)
                return
            if prompt.startswith("stall"):  # a token, then nothing for STALL_S, then the last one
                self.stream_slowly(script, chunks=2, gap_s=STALL_S)
                return
            chunks = [{"choices": [{"index": 0, "delta": {"content": "Hel"}}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
                      {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
                      {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}]
            for chunk in chunks:
                base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
                self.wfile.write(f"data: {json.dumps({**base, **chunk})}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def stream_slowly(self, script: Script, chunks: int = SLOW_CHUNKS, gap_s: float = SLOW_GAP_S) -> None:
            with script.lock:
                script.streams += 1
                script.peak_since_mark = max(script.peak_since_mark, script.streams)
            base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
            try:
                for k in range(chunks):
                    last = k == chunks - 1
                    chunk = {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "length" if last else None}],
                             "usage": {"prompt_tokens": 3, "completion_tokens": k + 1}}
                    self.wfile.write(f"data: {json.dumps({**base, **chunk})}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(gap_s)
                self.wfile.write(b"data: [DONE]\n\n")
            except OSError:  # the client closed the stream: vLLM aborts the request
                pass
            finally:
                with script.lock:
                    script.streams -= 1

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


def engine_for(url: str, guard=None) -> EndpointEngine:
    return EndpointEngine(endpoint_config("", Endpoint(url, "m", None, None, 8, "openai", None, None), 0), guard=guard)


def results_of(engine: EndpointEngine, count: int, timeout_s: float = 30.0) -> dict:
    found, deadline = {}, time.monotonic() + timeout_s
    while len(found) < count:
        assert time.monotonic() < deadline, f"only {len(found)} of {count} results"
        found.update({r.request_id: r for r in engine.poll(0.2)})
    return found


def test_answers_stream_in_and_retries_and_row_errors_end_each_request_once(server, monkeypatch):
    monkeypatch.setattr(http_engine, "BACKOFF_S", (0.01,))
    url, script = server({"flaky": [503, 200], "bad": [400], "crashes": [500]})
    engine = engine_for(url, SetGuard(4))  # all four at once (the runtime sends no more than the guard allows)
    try:
        engine.submit([EngineRequest(1, "fine"), EngineRequest(2, "flaky"), EngineRequest(3, "bad"), EngineRequest(4, "crashes")])
        found = results_of(engine, 4)
    finally:
        engine.stop()
    assert found[1].texts == ("Hello",) and found[1].finish_reason is FinishReason.STOP
    assert (found[1].num_prompt_tokens, found[1].num_output_tokens) == (3, 2)
    assert found[2].texts == ("Hello",) and script.calls["flaky"] == 2  # a 503, then sent again
    assert found[3].is_error and found[3].error == "the server refused it (400): scripted 400" and script.calls["bad"] == 1
    assert found[4].is_error and script.calls["crashes"] == MAX_FAILED_ANSWERS
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


class SetGuard:
    """The test's stand-in for the latency guard: allows what the test set, sees nothing."""

    def __init__(self, allowed: int, changes: list | None = None):
        self.value, self.told, self.silences = allowed, [], []  # told: the in-flight counts it was given
        self.pending = list(changes or [])  # what `changes` gives, once

    def changes(self) -> list:
        taken, self.pending = self.pending, []
        return taken

    def allowed(self, now_s: float, in_flight: int) -> int:
        self.told.append(in_flight)
        return self.value

    def observe_server(self, snapshot) -> None:
        pass

    def observe_own(self, now_s: float, ttft_s, token_gaps_s) -> None:
        pass

    def observe_silence(self, now_s: float, silent_s: float) -> None:
        self.silences.append(silent_s)


def test_the_guards_changes_go_to_the_engines_log_one_line_each_with_the_time_in_utc(server, tmp_path):
    url, _ = server({})
    reading = GuardReading(2, 0.21, 0.031, 0.25, 0.04, "server metrics", "slow start")
    log = tmp_path / "logs" / "engine-m-endpoint0.log"
    config = endpoint_config("", Endpoint(url, "m", None, None, 8, "openai", None, None), 0, str(log))
    engine = EndpointEngine(config, guard=SetGuard(2, [GuardChange(time.monotonic() - 1.0, 1, reading, "grow", 1, 0.0)]))
    engine.stop()
    header, line = log.read_text().splitlines()
    assert header == f"the latency guard of {url}: each change of its phase or allowance"
    at, text = line.split(" UTC  ")
    assert abs(dt.datetime.strptime(at, "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=dt.UTC) - dt.datetime.now(dt.UTC)) < dt.timedelta(seconds=30)
    assert text == ("slow start: in flight <= 1 -> 2 (grow); on the server 1 batch, 0 online; "
                    "online p99 TTFT 0.21 s (target 0.25), inter-token 31 ms (target 40)")


def wait_until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def guarded_engine(server, monkeypatch):
    """(engine, its stand-in guard, the server's script) for slow streams, scraped every 0.1 s."""
    monkeypatch.setattr(http_engine, "SCRAPE_S", 0.1)
    monkeypatch.setattr(http_engine, "HELD_POLL_S", 0.05)

    def start(allowed: int) -> tuple[EndpointEngine, SetGuard, Script]:
        url, script = server({})
        guard = SetGuard(allowed)
        return engine_for(url, guard), guard, script

    return start


def test_a_cut_aborts_the_youngest_calls_at_once_and_sends_them_again_when_allowed(guarded_engine):
    engine, guard, script = guarded_engine(3)
    try:
        for request_id in (1, 2, 3):  # 1 is the oldest
            engine.submit([EngineRequest(request_id, f"slow {request_id}")])
            wait_until(lambda: script.streams == request_id)  # noqa: B023  called in this iteration only
        guard.value = 1  # a cut: 2 and 3 go back, 1 runs on
        wait_until(lambda: script.streams == 1, timeout_s=2.0)  # within a few scrapes, long before 1's stream ends
        script.mark()
        time.sleep(0.5)
        assert script.peak_since_mark == 1  # held: not sent again while the guard allows one
        guard.value = 3
        found = results_of(engine, 3)
    finally:
        engine.stop()
    assert {r: (found[r].texts, found[r].finish_reason) for r in found} == {r: (("a" * SLOW_CHUNKS,), FinishReason.LENGTH)
                                                                           for r in (1, 2, 3)}
    assert sorted(script.ids) == ["batchllm-1-0", "batchllm-2-0", "batchllm-2-1", "batchllm-3-0", "batchllm-3-1"]
    assert engine.poll(0.0) == []  # nothing answered twice


def test_the_guard_is_told_how_long_a_decoding_stream_has_gone_without_a_token(guarded_engine):
    """A stalled server shows in the batch's own streams before any answer ends: the guard hears of
    it at each scrape, and of none once the stream moved on."""
    engine, guard, script = guarded_engine(1)
    try:
        engine.submit([EngineRequest(1, "stall 1")])
        found = results_of(engine, 1)
        assert 1.0 <= max(guard.silences) <= STALL_S + 0.5  # scraped every 0.1 s during the 1.5 s stall
        wait_until(lambda: guard.silences[-1] == 0.0, timeout_s=2.0)  # the stream ended: nothing decoding
    finally:
        engine.stop()
    assert found[1].texts == ("aa",)


def test_requests_held_by_a_cut_end_with_a_stop_and_leave_nothing_counted(guarded_engine):
    engine, guard, script = guarded_engine(2)
    engine.submit([EngineRequest(1, "slow 1"), EngineRequest(2, "slow 2")])
    wait_until(lambda: script.streams == 2)
    guard.value = 0  # both go back and wait
    wait_until(lambda: script.streams == 0, timeout_s=2.0)
    engine.stop()
    engine.in_flight_limit()
    assert guard.told[-1] == 0  # on the server: none, and none held any more
    assert engine.poll(0.0) == []
