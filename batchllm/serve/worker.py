"""Runs the queued batches and moves each along its lifecycle (`batches.py`): the batches
queued together run as one group (`run_groups.py`), one DAG in one run folder, through
`openai_batch.run_batches` in a child process (`runner.py`, `child.py`), so the planner runs
their models side by side.

- validating: each new batch's file is read in a thread of its own (`validation.py`) and the
  batch becomes in_progress (queued), failed (nothing in it can run) or expired. A new group
  is made once `gather_s` passed since the newest batch was created, so batches a client creates
  in a row run together.
- in_progress: a started group runs until its members end; else the queued batches make a new
  group. Lines commit as they finish in the group's run folder. Told to stop (the server
  ends), the worker interrupts the run, which stays in_progress and resumes its run folder,
  each request computed once, when the server starts again. A run that crashed is started
  again, at most MAX_ATTEMPTS times.
- cancelling: the group's run is interrupted; the cancelled batch is finished without an
  engine (its results file written from what was committed, the other lines in the error
  file as `batch_cancelled`), then the group's other batches resume.
- finalizing: the results file is split as OpenAI splits it (`outcome.py`).
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchllm.core.errors import UserError
from batchllm.runtime.status import read_status
from batchllm.serve.api_errors import ApiError
from batchllm.serve.batches import BatchRecord, BatchStatus, BatchStore, InvalidTransition
from batchllm.serve.files import FileStore
from batchllm.serve.outcome import Outcome, split_results, unstarted_errors
from batchllm.serve.run_groups import MAX_BATCHES, RunGroup, RunGroups
from batchllm.serve.runner import RunHandle, Runner
from batchllm.serve.validation import Validated, validate_file

MAX_ATTEMPTS = 3
S = BatchStatus


@dataclass(frozen=True)
class Progress:
    """A running batch's progress, from its run's status file."""
    completed: int
    failed: int
    eta_s: float | None
    output_tokens_per_s: float


class Worker:
    def __init__(self, data: Path, batches: BatchStore, files: FileStore, runner: Runner, models: Mapping[str, str], *,
                 poll_s: float = 0.5, stop_wait_s: float = 60.0, gather_s: float = 1.0):
        self.data, self.batches, self.files, self.runner, self.models = data, batches, files, runner, models
        self.poll_s, self.stop_wait_s, self.gather_s = poll_s, stop_wait_s, gather_s
        self.groups = RunGroups(data / "runs")
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # --- life
    def start(self) -> None:
        for record in self.batches.active():
            if record.status == S.VALIDATING:
                self.validate_soon(record.id)
        self._thread = threading.Thread(target=self._loop, name="batchllm-serve-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Interrupt the running group (its batches stay in_progress, resumed at the next start) and end."""
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
        if record.status not in (S.IN_PROGRESS, S.CANCELLING) or record.run_id is None:
            return None
        run_dir = self.groups.run_dir(record.run_id)
        if not (run_dir / ".batchllm" / "status.json").is_file():
            return None
        try:
            status, group = read_status(run_dir), self.groups.get(record.run_id)
        except (UserError, OSError, ValueError, KeyError):
            return None
        nodes = [node for name, node in status.nodes.items() if group.owns_node(record.id, name)]
        done = sum(node.committed - node.failed for node in nodes)
        failed = sum(node.failed for node in nodes)
        runnable = max(record.total - record.invalid, 0)
        etas = [node.eta_s for node in nodes if node.eta_s is not None and node.committed < node.total]
        eta = max(etas) if etas else status.rest_s
        return Progress(min(done, runnable), min(record.invalid + failed, record.total), eta if status.state == "running" else None,
                        sum(node.output_tokens_per_s for node in nodes))

    def counts(self, record: BatchRecord) -> tuple[int, int, int] | None:
        progress = self.progress(record)
        return None if progress is None else (record.total, progress.completed, progress.failed)

    # --- the loop: each turn does the most urgent thing there is
    def _loop(self) -> None:
        while not self._stopping.is_set():
            records = self._turn()
            if not records:
                self._wake.wait(min(1.0, max(self.gather_s, 0.05)))
                self._wake.clear()
                continue
            try:
                self._advance(records)
            except Exception:  # a bug must not end the worker: the batches fail with its cause, the others go on
                cause = traceback.format_exc(limit=4).strip().splitlines()[-1]
                for record in records:
                    self._fail(record, "server_error", cause)

    def _turn(self) -> list[BatchRecord]:
        """What to advance now: a batch to end or finalize; else the members of the started group to
        run on; else a new group of the queued batches, once `gather_s` passed since the newest was created."""
        active = self.batches.active()
        for record in active:
            if record.status == S.FINALIZING or (record.status == S.CANCELLING and record.run_id is None):
                return [record]
        for record in active:
            if record.status == S.CANCELLING:
                return [record]
        queued = [r for r in active if r.status == S.IN_PROGRESS]
        started = [r for r in queued if r.run_id is not None]
        if started:
            return [r for r in queued if r.run_id == started[0].run_id]
        newest_ns = max((r.order for r in active), default=0)
        if len(queued) < MAX_BATCHES and time.time_ns() - newest_ns < self.gather_s * 1e9:
            return []  # a batch created just now: the next may come with it (a client creating several in a row)
        return queued[:MAX_BATCHES]

    def _advance(self, records: list[BatchRecord]) -> None:
        first = records[0]
        if first.status == S.FINALIZING:
            self._finish(first, S.COMPLETED)
        elif first.run_id is None and first.status == S.CANCELLING:
            self._end_unstarted(first, S.CANCELLED, "batch_cancelled", "the batch was cancelled before this request ran")
        elif first.run_id is None:
            self._start_group(records)
        elif first.status == S.CANCELLING:
            self._run(self.groups.get(first.run_id), [first], partial="the batch was cancelled")
        else:
            self._run(self.groups.get(first.run_id), records)

    def _start_group(self, queued: list[BatchRecord]) -> None:
        members = []
        for record in queued:
            if time.time() > record.expires_at:
                self._end_unstarted(record, S.EXPIRED, "batch_expired", "the batch expired before this request ran")
            else:
                members.append(record)
        if members:
            group = self.groups.make([r.id for r in members])
            members = [r for r in members if r.id in group.prefixes]  # a group made before a crash keeps its members
            self._run(group, [self.batches.update(r.id, run_id=group.id) for r in members])

    def _run(self, group: RunGroup, members: list[BatchRecord], partial: str | None = None) -> None:
        job = self.groups.job(group, [(r.id, self.files.content_path(r.input_file_id)) for r in members], partial)
        for batch in job.batches:
            batch.results.unlink(missing_ok=True)
        handle = self.runner.start(job)
        ids = [r.id for r in members]
        while (code := handle.poll()) is None:
            if self._stopping.is_set():
                self._end(handle)
                return  # resumed at the next start
            if partial is None and any(self.batches.get(i).status == S.CANCELLING for i in ids):
                self._end(handle)
                return  # the next turn finishes the cancelled batch, the one after resumes the others
            self._cancel_unstarted()
            time.sleep(self.poll_s)
        if code in (0, 1) and all(batch.results.is_file() for batch in job.batches):
            for record in members:
                if partial is not None:
                    self._finish(record, S.CANCELLED)
                    continue
                try:
                    self.batches.transition(record.id, S.FINALIZING, expect=S.IN_PROGRESS)
                except InvalidTransition:
                    continue  # cancelled just as it ended: a later turn finishes it as cancelled
                self._finish(self.batches.get(record.id), S.COMPLETED)
        elif code == 2:
            for record in members:
                self._fail(record, "invalid_batch", _last_error(job.log) or "the batch cannot run")
        else:
            for record in members:
                record = self.batches.update(record.id, attempts=self.batches.get(record.id).attempts + 1)
                if record.attempts >= MAX_ATTEMPTS:
                    self._fail(record, "run_failed", f"the run ended {record.attempts} times without finishing (exit {code}); "
                                                     f"last lines: {_last_error(job.log)}")

    def _end(self, handle: RunHandle) -> None:
        handle.interrupt()
        deadline = time.monotonic() + self.stop_wait_s
        while handle.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        handle.kill()

    def _cancel_unstarted(self) -> None:
        for record in self.batches.active():
            if record.status == S.CANCELLING and record.run_id is None:
                self._end_unstarted(record, S.CANCELLED, "batch_cancelled", "the batch was cancelled before this request ran")

    def _fail(self, record: BatchRecord, code: str, message: str) -> None:
        try:
            self.batches.transition(record.id, S.FAILED, errors=[{"code": code, "message": message, "param": None, "line": None}])
        except InvalidTransition:
            pass

    def _end_unstarted(self, record: BatchRecord, status: BatchStatus, code: str, message: str) -> None:
        outcome = unstarted_errors(self.files, record.id, self.files.content_path(record.input_file_id), code, message)
        self._end_with(record, status, outcome, usage=False)

    def _finish(self, record: BatchRecord, status: BatchStatus) -> None:
        """The batch's files from its results file, and its last status."""
        assert record.run_id is not None, f"{record.id} finishes without having run"
        results = self.groups.results(record.run_id, record.id)
        self._end_with(record, status, split_results(self.files, record.id, results, cancelled=status == S.CANCELLED))

    def _end_with(self, record: BatchRecord, status: BatchStatus, outcome: Outcome, usage: bool = True) -> None:
        changes: dict[str, Any] = {"usage": outcome.usage} if usage else {}
        try:
            self.batches.transition(record.id, status, output_file_id=outcome.output_file_id, error_file_id=outcome.error_file_id,
                                    total=outcome.total, completed=outcome.completed, failed=outcome.failed, **changes)
        except InvalidTransition:
            pass


def _last_error(log: Path) -> str:
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    errors = [line for line in lines if line.startswith(("error:", "run incomplete:"))]
    return (errors or lines or [""])[-1][:2000]
