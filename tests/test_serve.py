"""`batchllm serve`: OpenAI's Files and Batches API over run-batch.

Fast tests (unmarked): the lifecycle's state machine, and the HTTP layer through FastAPI's
TestClient and the official `openai` client, with a fake runner in place of run-batch's child
process. Real-engine tests (marked `engine`) start `batchllm serve` as a process on a free
port and drive it with the official client: see the second half.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from batchllm.serve.api_errors import ApiError
from batchllm.serve.app import create_app, open_service
from batchllm.serve.batches import BatchStatus, BatchStore, InvalidTransition
from batchllm.serve.files import Limits
from batchllm.serve.runner import JobBatch, RunJob

S = BatchStatus


def chat(custom_id: str, text: str, model: str = "smollm2-135m", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8, **body}}


def jsonl(lines: list) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


# --- a fake runner: writes run-batch's results file, one line at a time, as the test lets it

class FakeRun:
    def __init__(self, job: RunJob, gate: threading.Semaphore | None, committed: dict[str, int]):
        self.job, self.gate, self.committed = job, gate, committed
        self.code: int | None = None
        self.interrupted = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        self.job.run_dir.mkdir(parents=True, exist_ok=True)
        self.code = max(self._run_batch(batch) for batch in self.job.batches) if not self.interrupted.is_set() else 130

    def _run_batch(self, batch: JobBatch) -> int:
        lines = [raw for raw in batch.requests.read_bytes().splitlines() if raw.strip()]
        done = self.committed.get(batch.batch_id, 0)
        if self.job.partial is None:
            while done < len(lines):
                if self.gate is not None:
                    while not self.gate.acquire(timeout=0.05):
                        if self.interrupted.is_set():
                            return 130
                if self.interrupted.is_set():
                    return 130
                done += 1
                self.committed[batch.batch_id] = done
        out = []
        for k, raw in enumerate(lines, start=1):
            try:
                line = json.loads(raw)
            except ValueError:
                out.append({"id": f"r{k}", "custom_id": None, "response": None,
                            "error": {"code": "invalid_json", "message": f"line {k}: not valid JSON"}})
                continue
            if line["body"]["model"] not in ("gpt-x", "smollm2-135m"):  # run-batch's own check of each line
                out.append({"id": f"r{k}", "custom_id": line["custom_id"], "response": None,
                            "error": {"code": "model_not_found", "message": f"line {k}: unknown model"}})
            elif k > done:
                out.append({"id": f"r{k}", "custom_id": line["custom_id"], "response": None,
                            "error": {"code": "not_completed", "message": f"line {k}: no result yet: {self.job.partial}"}})
            else:
                out.append({"id": f"r{k}", "custom_id": line["custom_id"], "error": None, "response": {
                    "status_code": 200, "request_id": f"q{k}", "body": {
                        "id": f"c{k}", "object": "chat.completion", "created": 1, "model": line["body"]["model"],
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}}})
        batch.results.write_text("".join(json.dumps(line) + "\n" for line in out))
        return 1 if done < len(lines) else 0

    def poll(self) -> int | None:
        return self.code

    def interrupt(self) -> None:
        self.interrupted.set()

    def kill(self) -> None:
        while self.code is None:
            time.sleep(0.01)


class FakeRunner:
    """Runs lines as the test releases them (`gate`; None: all at once)."""

    def __init__(self, gate: threading.Semaphore | None = None):
        self.gate, self.committed, self.started = gate, {}, []

    def start(self, job: RunJob) -> FakeRun:
        self.started.append(job)
        return FakeRun(job, self.gate, self.committed)


def wait_for(predicate, timeout_s: float = 10.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def served(tmp_path):
    """A service on a fake runner, as a TestClient (the worker runs while the client is open)."""
    from fastapi.testclient import TestClient

    runner = FakeRunner()

    def start(api_key: str | None = None, limits: Limits = Limits(), gate: threading.Semaphore | None = None) -> TestClient:
        runner.gate = gate
        service = open_service(tmp_path / "data", runner, {"gpt-x": "smollm2-135m"}, limits=limits, api_key=api_key, poll_s=0.01,
                               gather_s=0.3)
        client = TestClient(create_app(service))
        client.__enter__()
        clients.append(client)
        return client

    clients: list = []
    start.runner = runner  # type: ignore[attr-defined]
    yield start
    for client in clients:
        client.__exit__(None, None, None)


def upload(client, data: bytes, name: str = "in.jsonl", purpose: str = "batch"):
    return client.post("/v1/files", files={"file": (name, data)}, data={"purpose": purpose})


def create(client, file_id: str, endpoint: str = "/v1/chat/completions", **extra):
    return client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h", **extra})


def until_status(client, batch_id: str, statuses: tuple[str, ...], timeout_s: float = 10.0) -> dict:
    return wait_for(lambda: (b := client.get(f"/v1/batches/{batch_id}").json())["status"] in statuses and b, timeout_s,
                    f"{batch_id} to be {statuses}")


# --- the state machine

def test_a_batch_moves_only_along_the_lifecycle_and_its_record_survives_a_restart(tmp_path):
    store = BatchStore(tmp_path)
    record = store.create("file-1", "/v1/chat/completions", "24h", {"k": "v"})
    assert record.status == S.VALIDATING and record.expires_at == record.created_at + 86_400
    with pytest.raises(InvalidTransition):
        store.transition(record.id, S.COMPLETED)
    store.transition(record.id, S.IN_PROGRESS, total=3)
    with pytest.raises(InvalidTransition):
        store.transition(record.id, S.IN_PROGRESS)
    with pytest.raises(InvalidTransition):
        store.transition(record.id, S.FINALIZING, expect=S.VALIDATING)
    store.transition(record.id, S.FINALIZING)
    done = store.transition(record.id, S.COMPLETED, completed=3)
    with pytest.raises(InvalidTransition):
        store.transition(record.id, S.CANCELLING)
    again = BatchStore(tmp_path).get(record.id)
    assert again == done and again.status is S.COMPLETED
    body = again.to_object()
    assert {"in_progress_at", "finalizing_at", "completed_at"} <= {k for k, v in body.items() if k.endswith("_at") and v}
    assert body["request_counts"] == {"total": 3, "completed": 3, "failed": 0} and body["metadata"] == {"k": "v"}
    assert [r.id for r in BatchStore(tmp_path).active()] == []


def test_a_batch_object_validates_against_the_openai_clients_model(tmp_path):
    from openai.types import Batch

    store = BatchStore(tmp_path)
    record = store.transition(store.create("file-1", "/v1/embeddings", "24h", None).id, S.FAILED,
                              errors=[{"code": "empty_file", "message": "no lines", "param": None, "line": None}])
    batch = Batch.model_validate(record.to_object())
    assert batch.status == "failed" and batch.errors.data[0].code == "empty_file"


# --- the HTTP layer with a fake runner

def test_files_upload_list_get_content_and_delete(served):
    client = served()
    body = jsonl([chat("a", "hi"), chat("b", "ho")])
    made = upload(client, body).json()
    assert made["object"] == "file" and made["bytes"] == len(body) and made["purpose"] == "batch" and made["filename"] == "in.jsonl"
    assert client.get(f"/v1/files/{made['id']}").json() == made
    assert client.get(f"/v1/files/{made['id']}/content").content == body
    listed = client.get("/v1/files").json()
    assert listed["object"] == "list" and [f["id"] for f in listed["data"]] == [made["id"]] and listed["has_more"] is False
    assert client.delete(f"/v1/files/{made['id']}").json() == {"id": made["id"], "object": "file", "deleted": True}
    missing = client.get(f"/v1/files/{made['id']}")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("limits, data, status, code", [
    (Limits(max_file_bytes=100), b"x" * 101, 413, "file_too_large"),
    (Limits(max_file_lines=2), b"a\nb\nc", 400, "too_many_lines"),
    (Limits(max_stored_bytes=10), b"0123456789a", 413, "storage_limit_exceeded"),
])
def test_uploads_past_a_limit_are_refused_in_openais_error_shape_and_leave_nothing(served, tmp_path, limits, data, status, code):
    client = served(limits=limits)
    refused = upload(client, data)
    assert refused.status_code == status
    assert refused.json()["error"]["code"] == code and refused.json()["error"]["param"] == "file"
    assert client.get("/v1/files").json()["data"] == []
    assert list((tmp_path / "data" / "files").iterdir()) == []


def test_requests_the_service_refuses_get_openais_error_shape(served):
    client = served()
    file_id = upload(client, jsonl([chat("a", "hi")])).json()["id"]
    for response, param in [(upload(client, b"x\n", purpose="fine-tune"), "purpose"),
                            (client.post("/v1/files", data={"purpose": "batch"}), "file"),
                            (create(client, file_id, endpoint="/v1/moderations"), "endpoint"),
                            (create(client, file_id, completion_window="1h"), "completion_window"),
                            (create(client, "file-nope"), "input_file_id"),
                            (create(client, file_id, metadata={"k": "v" * 513}), "metadata"),
                            (client.get("/v1/batches", params={"limit": 0}), "limit")]:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    for response in (client.get("/v1/batches/batch_nope"), client.get("/v1/nothing-here")):
        assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_without_the_right_key_every_route_is_401_and_the_page_takes_the_key_as_basic_auth(served):
    client = served(api_key="s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + "eDp3cm9uZw=="}):
        for response in (client.get("/v1/files", headers=headers), client.post("/v1/batches", json={}, headers=headers),
                         client.get("/", headers=headers)):
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/", headers={"Authorization": "Bearer wrong"}).headers["www-authenticate"].startswith("Basic")
    assert client.get("/v1/files", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/", auth=("anyone", "s3cret")).status_code == 200


def test_the_openai_client_uploads_creates_polls_and_downloads(served):
    from openai import OpenAI

    client = served(api_key="k")
    openai = OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client, max_retries=0)
    lines = [chat("a", "hi", model="gpt-x"), "{not json", chat("b", "ho", model="gpt-unknown"), chat("c", "hey")]
    uploaded = openai.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    batch = openai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    batch = wait_for(lambda: (b := openai.batches.retrieve(batch.id)).status == "completed" and b, what="completed")
    assert batch.request_counts.total == 4 and batch.request_counts.completed == 2 and batch.request_counts.failed == 2
    output = [json.loads(line) for line in openai.files.content(batch.output_file_id).text.splitlines()]
    errors = [json.loads(line) for line in openai.files.content(batch.error_file_id).text.splitlines()]
    assert [line["custom_id"] for line in output] == ["a", "c"] and all(line["error"] is None for line in output)
    assert [line["error"]["code"] for line in errors] == ["invalid_json", "model_not_found"]
    assert batch.usage.input_tokens == 6 and batch.usage.output_tokens == 2
    assert [b.id for b in openai.batches.list()] == [batch.id]
    assert openai.files.retrieve(batch.output_file_id).purpose == "batch_output"


def test_list_pages_with_after_and_limit_newest_first(served):
    client = served()
    file_id = upload(client, jsonl([chat("a", "hi")])).json()["id"]
    ids = []
    for _ in range(3):
        ids.append(create(client, file_id).json()["id"])
        time.sleep(1.01)  # created_at has seconds
    first = client.get("/v1/batches", params={"limit": 2}).json()
    assert [b["id"] for b in first["data"]] == ids[::-1][:2] and first["has_more"] is True
    rest = client.get("/v1/batches", params={"limit": 2, "after": first["last_id"]}).json()
    assert [b["id"] for b in rest["data"]] == [ids[0]] and rest["has_more"] is False


def test_a_file_that_cannot_run_fails_with_its_line_errors(served):
    client = served()
    for lines, codes, numbers in [([b"{not json", chat("x", "hi", model="nope")], ["invalid_json", "model_not_found"], [1, 2]),
                                  ([b"", b"  "], ["empty_file"], [None]),
                                  ([chat("a", "hi"), {**chat("b", "x"), "url": "/v1/completions"}], ["mismatched_endpoint"], [2])]:
        raw = b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)
        batch = create(client, upload(client, raw).json()["id"]).json()
        failed = until_status(client, batch["id"], ("failed",))
        assert [e["code"] for e in failed["errors"]["data"]] == codes
        assert [e["line"] for e in failed["errors"]["data"]] == numbers


def test_cancel_mid_batch_keeps_the_finished_lines(served):
    gate = threading.Semaphore(0)
    client = served(gate=gate)
    batch = create(client, upload(client, jsonl([chat(f"r{k}", "hi") for k in range(5)])).json()["id"]).json()
    until_status(client, batch["id"], ("in_progress",))
    wait_for(lambda: served.runner.started, what="the run to start")
    gate.release(2)
    wait_for(lambda: served.runner.committed.get(batch["id"]) == 2, what="two lines")
    cancelling = client.post(f"/v1/batches/{batch['id']}/cancel").json()
    assert cancelling["status"] in ("cancelling", "cancelled")
    done = until_status(client, batch["id"], ("cancelled",))
    assert done["cancelling_at"] and done["cancelled_at"]
    output = client.get(f"/v1/files/{done['output_file_id']}/content").text.splitlines()
    errors = [json.loads(line) for line in client.get(f"/v1/files/{done['error_file_id']}/content").text.splitlines()]
    assert [json.loads(line)["custom_id"] for line in output] == ["r0", "r1"]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(f"r{k}", "batch_cancelled") for k in (2, 3, 4)]
    assert done["request_counts"] == {"total": 5, "completed": 2, "failed": 3}
    again = client.post(f"/v1/batches/{batch['id']}/cancel")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


def test_a_queued_batch_cancelled_before_it_runs_ends_without_a_run_and_an_ended_one_cannot_be_cancelled(served):
    gate = threading.Semaphore(0)
    client = served(gate=gate)
    file_id = upload(client, jsonl([chat("a", "hi"), chat("b", "ho")])).json()["id"]
    first = create(client, file_id).json()
    until_status(client, first["id"], ("in_progress",))
    wait_for(lambda: served.runner.started, what="the first run")
    second = create(client, file_id).json()
    until_status(client, second["id"], ("in_progress",))
    client.post(f"/v1/batches/{second['id']}/cancel")
    cancelled = until_status(client, second["id"], ("cancelled",))
    assert cancelled["output_file_id"] is None and cancelled["request_counts"]["failed"] == 2
    assert [[b.batch_id for b in job.batches] for job in served.runner.started] == [[first["id"]]]
    gate.release(2)
    until_status(client, first["id"], ("completed",))
    refused = client.post(f"/v1/batches/{first['id']}/cancel")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "batch_not_cancellable"
    assert client.delete(f"/v1/files/{file_id}").status_code == 200


def members(job: RunJob) -> list[tuple[str, str]]:
    return [(b.batch_id, b.prefix) for b in job.batches]


def test_batches_created_in_a_row_run_as_one_group_and_each_gets_its_own_files(served):
    client = served()
    a = create(client, upload(client, jsonl([chat("a1", "hi"), chat("a2", "ho")])).json()["id"]).json()
    b = create(client, upload(client, jsonl([chat("b1", "hi", model="smollm2-135m")])).json()["id"]).json()
    done = [until_status(client, batch["id"], ("completed",)) for batch in (a, b)]
    assert [members(job) for job in served.runner.started] == [[(a["id"], "b1_"), (b["id"], "b2_")]]
    job = served.runner.started[0]
    assert job.run_dir == job.run_dir.parent / "run" and job.run_dir.parent.name == a["id"]  # the group is named after its first
    outputs = [[json.loads(line)["custom_id"] for line in client.get(f"/v1/files/{d['output_file_id']}/content").text.splitlines()]
               for d in done]
    assert outputs == [["a1", "a2"], ["b1"]]
    assert [d["request_counts"] for d in done] == [{"total": 2, "completed": 2, "failed": 0}, {"total": 1, "completed": 1, "failed": 0}]


def test_a_batch_created_while_a_group_runs_waits_for_the_next_group(served):
    gate = threading.Semaphore(0)
    client = served(gate=gate)
    a = create(client, upload(client, jsonl([chat("a1", "hi")])).json()["id"]).json()
    wait_for(lambda: served.runner.started, what="the first group")
    b = create(client, upload(client, jsonl([chat("b1", "hi")])).json()["id"]).json()
    gate.release(2)
    for batch in (a, b):
        until_status(client, batch["id"], ("completed",))
    assert [members(job) for job in served.runner.started] == [[(a["id"], "")], [(b["id"], "")]]


def test_cancelling_one_batch_of_a_group_keeps_its_finished_lines_and_the_others_resume_without_recomputing(served):
    gate = threading.Semaphore(0)
    client = served(gate=gate)
    a = create(client, upload(client, jsonl([chat(f"a{k}", "hi") for k in range(3)])).json()["id"]).json()
    b = create(client, upload(client, jsonl([chat(f"b{k}", "hi") for k in range(2)])).json()["id"]).json()
    wait_for(lambda: served.runner.started, what="the group")
    gate.release(2)
    wait_for(lambda: served.runner.committed.get(a["id"]) == 2, what="two lines of the first batch")
    client.post(f"/v1/batches/{a['id']}/cancel")
    cancelled = until_status(client, a["id"], ("cancelled",))
    assert cancelled["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    gate.release(5)
    completed = until_status(client, b["id"], ("completed",))
    assert completed["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    group, partial, resumed = served.runner.started
    assert members(group) == [(a["id"], "b1_"), (b["id"], "b2_")]
    assert (members(partial), partial.partial) == ([(a["id"], "b1_")], "the batch was cancelled")
    assert members(resumed) == [(b["id"], "b2_")] and resumed.run_dir == group.run_dir  # same folder, same node names
    assert served.runner.committed == {a["id"]: 2, b["id"]: 2}


def test_a_server_stopped_mid_batch_resumes_it_when_started_again_and_keeps_every_file(served):
    gate = threading.Semaphore(0)
    client = served(gate=gate)
    batch = create(client, upload(client, jsonl([chat(f"r{k}", "hi") for k in range(4)])).json()["id"]).json()
    wait_for(lambda: served.runner.started, what="the run")
    gate.release(1)
    wait_for(lambda: served.runner.committed.get(batch["id"]) == 1, what="a line")
    client.__exit__(None, None, None)  # the server stops: the run is interrupted, the batch stays in progress
    again = served(gate=None)
    resumed = until_status(again, batch["id"], ("completed",))
    assert resumed["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    assert len(served.runner.started) == 2 and again.get(f"/v1/files/{resumed['input_file_id']}").status_code == 200


def test_the_page_shows_each_batch_with_a_progress_bar_and_links(served):
    client = served()
    batch = create(client, upload(client, jsonl([chat("a", "hi")])).json()["id"]).json()
    until_status(client, batch["id"], ("completed",))
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert 'http-equiv="refresh"' in html and "<progress" in html and batch["id"] in html and "completed" in html
    assert f"/v1/files/{batch['input_file_id']}/content" in html
    assert "max-width:80ch" in html  # the layout is one column of 80 characters


def test_an_api_error_carries_openais_fields():
    assert ApiError(400, "m", param="p", code="c").body() == {"error": {"message": "m", "type": "invalid_request_error",
                                                                         "param": "p", "code": "c"}}


# --- the real service: `batchllm serve` as a process, the real engine, the official client, a real browser
#
# One server for the module, started with two batches queued at once: a chat batch (A) and an embeddings
# batch of another model (B). Created in a row, they run as one group (one DAG, planned together); the
# tests below look at each as it ends. Later tests make their own: a longer chat batch to cancel (C), and
# one (K) whose server is killed with -9 while it runs.

REPO = Path(__file__).resolve().parent.parent
MODEL_HOME = REPO / ".batchllm-home"  # the embedded models as `make test` prepares them
KEY_ENV, KEY = "BATCHLLM_TEST_SERVE_KEY", "test-key-7f3a"
engine = pytest.mark.engine


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServeProcess:
    def __init__(self, data: Path, port: int, log: Path):
        self.data, self.port, self.log = data, port, log
        self.process = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import os
        import subprocess
        import sys
        import urllib.request

        env = {**os.environ, "BATCHLLM_HOME": str(MODEL_HOME), KEY_ENV: KEY}
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", "from batchllm.cli import main; main()", "serve", "--data", str(self.data),
                 "--port", str(self.port), "--api-key-env", KEY_ENV, "--devices", "cpu:1", "--engine", "max_num_seqs=4",
                 "--model", "gpt-4o-mini=smollm2-135m", "--model", "text-embedding-3-small=minilm-l6", "--no-reuse"],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        self.stop(kill=True)
        raise AssertionError(f"the server did not answer in 90 s: {self.log.read_text()[-3000:]}")

    def stop(self, kill: bool = False) -> None:
        import os
        import signal

        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.process.wait(timeout=90)
        except Exception:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


def chats(prefix: str, count: int, max_tokens: int) -> bytes:
    return jsonl([chat(f"{prefix}{k}", f"Write a short sentence about the number {k}.", model="gpt-4o-mini", max_tokens=max_tokens,
                       temperature=0) for k in range(count)])


EMBEDDINGS = jsonl([{"custom_id": f"e{k}", "method": "POST", "url": "/v1/embeddings",
                     "body": {"model": "text-embedding-3-small", "input": text}}
                    for k, text in enumerate(["A man is eating food.", ["The sky is blue.", "Grass is green."], "Hello."])])


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from openai import OpenAI

    root = tmp_path_factory.mktemp("serve")
    server = ServeProcess(root / "data", free_port(), root / "server.log")
    server.start()
    client = OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    batches = {}
    for name, data, endpoint in [("A", chats("a", 6, 24), "/v1/chat/completions"), ("B", EMBEDDINGS, "/v1/embeddings")]:
        uploaded = client.files.create(file=(f"{name}.jsonl", data), purpose="batch")
        batches[name] = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h",
                                              metadata={"name": name}).id
    yield {"server": server, "client": client, "batches": batches, "root": root}
    server.stop()


def poll(client, batch_id: str, until, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        assert batch.status not in ("completed", "failed", "cancelled", "expired") or until(batch), f"{what}: it ended {batch}"
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}: {client.batches.retrieve(batch_id)}")


def dump_dom(url: str) -> str:
    import shutil
    import subprocess

    done = subprocess.run([shutil.which("chromium") or "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", url],
                          capture_output=True, text=True, timeout=60)
    return done.stdout


@engine
def test_the_page_in_a_real_browser_shows_a_running_batch_and_then_its_completion(service):
    import shutil

    if shutil.which("chromium") is None:
        pytest.skip("Debian's chromium is not installed (make test installs it with apt-get where it can)")
    client, batch_id, port = service["client"], service["batches"]["A"], service["server"].port
    url = f"http://page:{KEY}@127.0.0.1:{port}/"
    poll(client, batch_id, lambda b: b.status == "in_progress", 120, "A in progress")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        html = dump_dom(url)
        block = html[html.find(f'id="{batch_id}"'):][:2000]
        if "in_progress" in block and "<progress" in block:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"the page never showed {batch_id} running: {html[-3000:]}")
    assert "ETA" in block and "/v1/files/" in block
    poll(client, batch_id, lambda b: b.status == "completed", 400, "A completed")
    block = (html := dump_dom(url))[html.find(f'id="{batch_id}"'):][:2000]
    assert 'class="status completed"' in block and 'value="6" max="6"' in block and "output" in block


@engine
def test_the_openai_client_runs_a_batch_and_every_output_line_validates_against_vllms_models(service):
    from vllm.entrypoints.launchers.run_batch import BatchRequestOutput
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    client = service["client"]
    batch = poll(client, service["batches"]["A"], lambda b: b.status == "completed", 600, "A completed")
    assert batch.request_counts.total == batch.request_counts.completed == 6 and batch.error_file_id is None
    lines = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in lines] == [f"a{k}" for k in range(6)]
    for line in lines:
        BatchRequestOutput.model_validate(line)
        body = ChatCompletionResponse.model_validate(line["response"]["body"])
        assert body.choices[0].message.content.strip()
    assert batch.usage.output_tokens == sum(line["response"]["body"]["usage"]["completion_tokens"] for line in lines)


@engine
def test_a_batch_of_another_model_queued_with_it_completes_too(service):
    client = service["client"]
    batch = poll(client, service["batches"]["B"], lambda b: b.status == "completed", 600, "B completed")
    lines = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in lines] == ["e0", "e1", "e2"]
    vectors = [item["embedding"] for line in lines for item in line["response"]["body"]["data"]]
    assert len(vectors) == 4 and {len(v) for v in vectors} == {384}
    assert client.batches.retrieve(service["batches"]["A"]).status == "completed"
    # created in a row, A and B ran as one group: one DAG in one run folder, planned together
    group = json.loads((service["root"] / "data" / "runs" / service["batches"]["A"] / "members.json").read_text())
    assert group["prefixes"] == {service["batches"]["A"]: "b1_", service["batches"]["B"]: "b2_"}


@engine
def test_cancel_mid_batch_ends_cancelled_with_the_finished_lines_kept(service):
    client = service["client"]
    batch_id = client.batches.create(input_file_id=client.files.create(file=("C.jsonl", chats("c", 40, 64)), purpose="batch").id,
                                     endpoint="/v1/chat/completions", completion_window="24h").id
    poll(client, batch_id, lambda b: b.status == "in_progress" and b.request_counts.completed >= 1, 600, "C's first lines")
    client.batches.cancel(batch_id)
    batch = poll(client, batch_id, lambda b: b.status == "cancelled", 240, "C cancelled")
    kept = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    cut = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert kept and cut, (len(kept), len(cut))
    assert sorted(line["custom_id"] for line in kept + cut) == sorted(f"c{k}" for k in range(40))
    assert all(line["response"]["status_code"] == 200 for line in kept)
    assert {line["error"]["code"] for line in cut} == {"batch_cancelled"}
    assert batch.request_counts.completed == len(kept) and batch.request_counts.failed == len(cut)


@engine
def test_a_file_nothing_in_which_can_run_fails_with_its_line_errors(service):
    client = service["client"]
    bad = b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions"}\n{not json\n' + \
        jsonl([chat("y", "hi", model="no-such-model")])
    batch = client.batches.create(input_file_id=client.files.create(file=("bad.jsonl", bad), purpose="batch").id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    batch = poll(client, batch.id, lambda b: b.status == "failed", 60, "the bad batch failed")
    assert [(e.line, e.code) for e in batch.errors.data] == [(1, "invalid_request"), (2, "invalid_json"), (3, "model_not_found")]


@engine
def test_a_wrong_key_is_401_in_openais_error_shape(service):
    import openai

    wrong = openai.OpenAI(base_url=f"{service['server'].url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.batches.list()
    assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
    assert KEY not in (service["root"] / "server.log").read_text()
    assert not any(KEY in path.read_text(errors="replace") for path in (service["root"] / "data").rglob("*") if path.is_file())


@engine
def test_kill_9_of_the_server_mid_batch_then_a_restart_completes_it_with_every_request_once(service):
    from batchllm.io.node_journal import read_records

    client, server = service["client"], service["server"]
    batch_id = client.batches.create(input_file_id=client.files.create(file=("K.jsonl", chats("k", 16, 48)), purpose="batch").id,
                                     endpoint="/v1/chat/completions", completion_window="24h").id
    before = poll(client, batch_id, lambda b: b.status != "in_progress" or b.request_counts.completed >= 2, 900, "K's first lines")
    assert before.status == "in_progress", before
    server.stop(kill=True)
    run_dir = service["root"] / "data" / "runs" / batch_id / "run"
    status = json.loads((run_dir / ".batchllm" / "status.json").read_text())
    deadline = time.monotonic() + 30  # the run's process dies with the server
    while Path(f"/proc/{status['pid']}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{status['pid']}").exists(), "the batch's run outlived the killed server"
    server.start()
    batch = poll(client, batch_id, lambda b: b.status == "completed", 600, "K completed after the restart")
    lines = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(f"k{k}" for k in range(16)) and batch.error_file_id is None
    rows = [row for folder in (run_dir / ".batchllm" / "journal").iterdir() for row in read_records(folder).column("row").to_pylist()]
    assert sorted(rows) == sorted(set(rows)) and len(rows) == 16  # each request committed once
    earlier = client.batches.retrieve(service["batches"]["A"])  # what ended before the kill is all there
    assert earlier.status == "completed" and client.files.content(earlier.output_file_id).text.count("\n") == 6
