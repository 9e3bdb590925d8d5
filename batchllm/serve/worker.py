"""Runs the queued batches, one after another, each through `openai_batch.run_batch` in a
child process (`child.py`), and moves each along its lifecycle (`batches.py`).

- validating: each new batch's file is read in a thread of its own (`validation.py`) and the
  batch becomes in_progress (queued), failed (nothing in it can run) or expired.
- in_progress: the oldest runs; its lines commit as they finish in `<data>/runs/<id>/run`.
  Told to stop (the server ends), the worker interrupts the run, which stays in_progress and
  resumes its run folder, each request computed once, when the server starts again. A run
  that crashed is started again, at most MAX_ATTEMPTS times.
- cancelling: the run is interrupted, then finished without an engine: the results file is
  written from what was committed, the other lines in the error file as `batch_cancelled`.
- finalizing: the results file is split as OpenAI splits it, lines with a response into the
  output file, lines with an error into the error file, under ids made from the batch's, so
  doing it again after a crash gives the same files.

The runner is a seam (`Runner`): the tests of the lifecycle run batches with a fake one.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from batchllm.core.errors import UserError
from batchllm.core.files import write_text_atomically
from batchllm.runtime.status import read_status
from batchllm.serve.api_errors import ApiError
from batchllm.serve.batches import BatchRecord, BatchStatus, BatchStore, InvalidTransition
from batchllm.serve.files import FileStore
from batchllm.serve.validation import Validated, validate_file

MAX_ATTEMPTS = 3
S = BatchStatus


@dataclass(frozen=True)
class RunJob:
    batch_id: str
    requests: Path
    results: Path  # the run's results file (one line per request line, in order)
    run_dir: Path
    log: Path
    partial: str | None = None  # finish from what is committed, computing nothing; the rest's lines say this


class RunHandle(Protocol):
    def poll(self) -> int | None:
        """The exit code once it ended (0 done, 1 incomplete, 2 bad input, 130 interrupted)."""
        ...

    def interrupt(self) -> None: ...

    def kill(self) -> None: ...


class Runner(Protocol):
    def start(self, job: RunJob) -> RunHandle: ...


@dataclass(frozen=True)
class RunSettings:
    """What every batch's run takes: the model mapping and run-batch's options."""
    models: Mapping[str, str]
    devices: str = "auto"
    engine: Mapping[str, Any] = field(default_factory=dict)
    store: Path | None = None


class _Child:
    def __init__(self, process: subprocess.Popen):
        self.process = process

    def poll(self) -> int | None:
        return self.process.poll()

    def interrupt(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class ChildRunner:
    """Each run in a `python -m batchllm.serve.child` process (its output in the job's log)."""

    def __init__(self, settings: RunSettings):
        self.settings = settings

    def start(self, job: RunJob) -> RunHandle:
        job.run_dir.parent.mkdir(parents=True, exist_ok=True)
        spec = job.run_dir.parent / ("partial-spec.json" if job.partial else "run-spec.json")
        write_text_atomically(spec, json.dumps({
            "requests": str(job.requests), "results": str(job.results), "run_dir": str(job.run_dir), "partial": job.partial,
            "models": dict(self.settings.models), "devices": self.settings.devices, "engine": dict(self.settings.engine),
            "store": str(self.settings.store) if self.settings.store else None}, indent=1) + "\n")
        with open(job.log, "ab") as log:
            process = subprocess.Popen([sys.executable, "-m", "batchllm.serve.child", str(spec)], stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return _Child(process)


@dataclass(frozen=True)
class Progress:
    """A running batch's progress, from its run's status file."""
    completed: int
    failed: int
    eta_s: float | None
    output_tokens_per_s: float


def output_file_id(batch_id: str, kind: str) -> str:
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


class Worker:
    def __init__(self, data: Path, batches: BatchStore, files: FileStore, runner: Runner, models: Mapping[str, str], *,
                 poll_s: float = 0.5, stop_wait_s: float = 60.0):
        self.data, self.batches, self.files, self.runner, self.models = data, batches, files, runner, models
        self.poll_s, self.stop_wait_s = poll_s, stop_wait_s
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # --- paths
    def job(self, record: BatchRecord, partial: str | None = None) -> RunJob:
        folder = self.data / "runs" / record.id
        return RunJob(record.id, self.files.content_path(record.input_file_id), folder / "results.jsonl", folder / "run",
                      folder / "run.log", partial)

    # --- life
    def start(self) -> None:
        for record in self.batches.active():
            if record.status == S.VALIDATING:
                self.validate_soon(record.id)
        self._thread = threading.Thread(target=self._loop, name="batchllm-serve-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Interrupt the running batch (it stays in_progress, resumed at the next start) and end."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.stop_wait_s + 10)

    def wake(self) -> None:
        self._wake.set()

    # --- validating
    def validate_soon(self, batch_id: str) -> None:
        threading.Thread(target=self._validate, args=(batch_id,), name=f"validate-{batch_id}", daemon=True).start()

    def _validate(self, batch_id: str) -> None:
        record = self.batches.get(batch_id)
        try:
            checked = validate_file(self.files.content_path(record.input_file_id), record.endpoint, self.models)
        except OSError as error:
            checked = Validated(0, 0, [{"code": "file_unreadable", "message": f"cannot read the input file: {error}",
                                        "param": "input_file_id", "line": None}])
        try:
            if checked.errors:
                self.batches.transition(batch_id, S.FAILED, expect=S.VALIDATING, errors=checked.errors, total=checked.total,
                                        failed=checked.total)
            elif time.time() > record.expires_at:
                self.batches.transition(batch_id, S.EXPIRED, expect=S.VALIDATING, total=checked.total)
            else:
                self.batches.transition(batch_id, S.IN_PROGRESS, expect=S.VALIDATING, total=checked.total,
                                        invalid=checked.invalid)
        except InvalidTransition:
            pass  # cancelled meanwhile
        self.wake()

    # --- cancel
    def cancel(self, batch_id: str) -> BatchRecord:
        record = self.batches.get(batch_id)
        if record.status in (S.CANCELLING, S.CANCELLED):
            return record
        try:
            record = self.batches.transition(batch_id, S.CANCELLING)
        except InvalidTransition:
            raise ApiError(400, f"cannot cancel a batch that is {record.status}", param="batch_id",
                           code="batch_not_cancellable") from None
        self.wake()
        return record

    # --- progress
    def progress(self, record: BatchRecord) -> Progress | None:
        """Live counts of a batch that runs (None: it has not started, or its run wrote no status yet)."""
        if record.status not in (S.IN_PROGRESS, S.CANCELLING):
            return None
        run_dir = self.job(record).run_dir
        if not (run_dir / ".batchllm" / "status.json").is_file():
            return None
        try:
            status = read_status(run_dir)
        except UserError:
            return None
        done = sum(node.committed - node.failed for node in status.nodes.values())
        failed = sum(node.failed for node in status.nodes.values())
        runnable = max(record.total - record.invalid, 0)
        etas = [node.eta_s for node in status.nodes.values() if node.eta_s is not None and node.committed < node.total]
        eta = status.rest_s if status.rest_s is not None else (max(etas) if etas else None)
        return Progress(min(done, runnable), min(record.invalid + failed, record.total), eta if status.state == "running" else None,
                        sum(node.output_tokens_per_s for node in status.nodes.values()))

    def counts(self, record: BatchRecord) -> tuple[int, int, int] | None:
        progress = self.progress(record)
        return None if progress is None else (record.total, progress.completed, progress.failed)

    # --- the loop
    def _loop(self) -> None:
        while not self._stopping.is_set():
            record = self._next()
            if record is None:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                self._advance(record)
            except Exception:  # a bug must not end the worker: the batch fails with its cause, the others go on
                cause = traceback.format_exc(limit=4).strip().splitlines()[-1]
                try:
                    self.batches.transition(record.id, S.FAILED, errors=[{"code": "server_error", "message": cause,
                                                                          "param": None, "line": None}])
                except InvalidTransition:
                    pass

    def _next(self) -> BatchRecord | None:
        active = [r for r in self.batches.active() if r.status != S.VALIDATING]
        unstarted_cancels = [r for r in active if r.status == S.CANCELLING and not self.job(r).run_dir.exists()]
        first = unstarted_cancels or active
        return first[0] if first else None

    def _advance(self, record: BatchRecord) -> None:
        if record.status == S.IN_PROGRESS:
            if not self.job(record).run_dir.exists() and time.time() > record.expires_at:
                self._end_unstarted(record, S.EXPIRED, "batch_expired", "the batch expired before this request ran")
            else:
                self._run(record)
        elif record.status == S.FINALIZING:
            self._finalize(record, S.COMPLETED)
        elif record.status == S.CANCELLING:
            if not self.job(record).run_dir.exists():
                self._end_unstarted(record, S.CANCELLED, "batch_cancelled", "the batch was cancelled before this request ran")
            else:
                self._run(record, partial="the batch was cancelled")

    def _run(self, record: BatchRecord, partial: str | None = None) -> None:
        job = self.job(record, partial)
        job.results.unlink(missing_ok=True)
        handle = self.runner.start(job)
        stopped = cancelled = False
        while (code := handle.poll()) is None:
            if self._stopping.is_set():
                stopped = True
                self._end(handle)
                break
            if partial is None and self.batches.get(record.id).status == S.CANCELLING:
                cancelled = True
                self._end(handle)
                break
            self._cancel_unstarted(but=record.id)
            time.sleep(self.poll_s)
        if stopped or cancelled:
            return  # stopped: resumed at the next start; cancelled: the next turn finishes it
        code = handle.poll()
        if code in (0, 1) and job.results.is_file():
            if partial is not None:
                self._finalize(record, S.CANCELLED)
                return
            try:
                record = self.batches.transition(record.id, S.FINALIZING, expect=S.IN_PROGRESS)
            except InvalidTransition:
                return  # cancelled just as it ended: the next turn finishes it as cancelled
            self._finalize(record, S.COMPLETED)
        elif code == 2:
            self._fail(record, "invalid_batch", _last_error(job.log) or "the batch cannot run")
        else:
            record = self.batches.update(record.id, attempts=record.attempts + 1)
            if record.attempts >= MAX_ATTEMPTS:
                self._fail(record, "run_failed", f"the run ended {record.attempts} times without finishing (exit {code}); "
                                                 f"last lines: {_last_error(job.log)}")

    def _end(self, handle: RunHandle) -> None:
        handle.interrupt()
        deadline = time.monotonic() + self.stop_wait_s
        while handle.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        handle.kill()

    def _cancel_unstarted(self, but: str) -> None:
        for record in self.batches.active():
            if record.id != but and record.status == S.CANCELLING and not self.job(record).run_dir.exists():
                self._end_unstarted(record, S.CANCELLED, "batch_cancelled", "the batch was cancelled before this request ran")

    def _fail(self, record: BatchRecord, code: str, message: str) -> None:
        try:
            self.batches.transition(record.id, S.FAILED, errors=[{"code": code, "message": message, "param": None, "line": None}])
        except InvalidTransition:
            pass

    def _end_unstarted(self, record: BatchRecord, status: BatchStatus, code: str, message: str) -> None:
        """A batch that never ran: each request line's error says why."""
        errors = []
        with open(self.files.content_path(record.input_file_id), "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                if raw.strip():
                    try:
                        custom_id = json.loads(raw).get("custom_id")
                    except (ValueError, AttributeError):
                        custom_id = None
                    errors.append(json.dumps({"id": f"batch_req_{hashlib.sha256(f'{record.id}:{number}'.encode()).hexdigest()[:32]}",
                                              "custom_id": custom_id if isinstance(custom_id, str) else None, "response": None,
                                              "error": {"code": code, "message": f"line {number}: {message}"}}))
        error_id = self.files.put(output_file_id(record.id, "errors"), errors, f"{record.id}_error.jsonl", "batch_output").id \
            if errors else None
        try:
            self.batches.transition(record.id, status, error_file_id=error_id, total=len(errors), completed=0, failed=len(errors))
        except InvalidTransition:
            pass

    def _finalize(self, record: BatchRecord, status: BatchStatus) -> None:
        results = self.job(record).results
        ok, failed = [], []
        usage = {"input_tokens": 0, "output_tokens": 0}
        for line in _read_lines(results):
            item = json.loads(line)
            if item.get("error") is None:
                ok.append(line)
                body_usage = (item.get("response") or {}).get("body", {}).get("usage") or {}
                usage["input_tokens"] += int(body_usage.get("prompt_tokens") or 0)
                usage["output_tokens"] += int(body_usage.get("completion_tokens") or 0)
            else:
                if status == S.CANCELLED and item["error"].get("code") == "not_completed":
                    number = item["error"]["message"].split(":", 1)[0]
                    item["error"] = {"code": "batch_cancelled", "message": f"{number}: the batch was cancelled before this request ran"}
                    line = json.dumps(item, ensure_ascii=False)
                failed.append(line)
        output_id = self.files.put(output_file_id(record.id, "output"), ok, f"{record.id}_output.jsonl", "batch_output").id \
            if ok else None
        error_id = self.files.put(output_file_id(record.id, "errors"), failed, f"{record.id}_error.jsonl", "batch_output").id \
            if failed else None
        self.batches.transition(record.id, status, output_file_id=output_id, error_file_id=error_id, total=len(ok) + len(failed),
                                completed=len(ok), failed=len(failed),
                                usage={**usage, "total_tokens": usage["input_tokens"] + usage["output_tokens"],
                                       "input_tokens_details": {"cached_tokens": 0},
                                       "output_tokens_details": {"reasoning_tokens": 0}})


def _read_lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield line.rstrip("\n")


def _last_error(log: Path) -> str:
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    errors = [line for line in lines if line.startswith(("error:", "run incomplete:"))]
    return (errors or lines or [""])[-1][:2000]
