"""The batch lifecycle: one record per batch, its status the one truth of where it is.

    validating -> in_progress -> finalizing -> completed
    validating -> failed (the file cannot run: `errors` names its lines)
    validating | in_progress -> expired (not started within its completion window, 24 h)
    validating | in_progress -> cancelling -> cancelled (what finished is kept)
    in_progress | finalizing | cancelling -> failed (the run could not go on)

Each record is `<data>/batches/<id>.json`, replaced atomically at every change, so a restart
finds every batch where it was: a batch `in_progress` resumes its run folder, one
`finalizing` or `cancelling` writes its files again (under the same file ids).
Invariant: a status changes only along TRANSITIONS; the time of each change is kept in its
OpenAI field (`in_progress_at`, `completed_at`, ...).
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from batchllm.core.files import write_text_atomically
from batchllm.serve.api_errors import ApiError, not_found

COMPLETION_WINDOW_S = {"24h": 24 * 3600}


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


S = BatchStatus
TRANSITIONS: dict[BatchStatus, frozenset[BatchStatus]] = {
    S.VALIDATING: frozenset({S.IN_PROGRESS, S.FAILED, S.CANCELLING, S.EXPIRED}),
    S.IN_PROGRESS: frozenset({S.FINALIZING, S.CANCELLING, S.FAILED, S.EXPIRED}),  # expired: only before it ever ran
    S.FINALIZING: frozenset({S.COMPLETED, S.FAILED}),
    S.CANCELLING: frozenset({S.CANCELLED, S.FAILED}),
    S.COMPLETED: frozenset(), S.FAILED: frozenset(), S.CANCELLED: frozenset(), S.EXPIRED: frozenset(),
}
STAMPS = {S.IN_PROGRESS: "in_progress_at", S.FINALIZING: "finalizing_at", S.COMPLETED: "completed_at", S.FAILED: "failed_at",
          S.CANCELLING: "cancelling_at", S.CANCELLED: "cancelled_at", S.EXPIRED: "expired_at"}
ENDED = frozenset(s for s, nexts in TRANSITIONS.items() if not nexts)


class InvalidTransition(Exception):
    pass


@dataclass(frozen=True)
class BatchRecord:
    id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    created_at: int
    expires_at: int
    status: BatchStatus = BatchStatus.VALIDATING
    metadata: dict[str, str] | None = None
    stamps: dict[str, int] = field(default_factory=dict)  # in_progress_at, completed_at, ... as they happen
    total: int = 0  # non-blank lines of the input file, known once validated
    completed: int = 0  # final counts, at the end (while it runs they are read from the run's progress)
    failed: int = 0
    invalid: int = 0  # lines found bad at validation (they are failed lines from the start)
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None  # [{code, message, param, line}]: why the file cannot run
    usage: dict[str, Any] | None = None
    order: int = 0  # time.time_ns() at creation: batches made in one second keep their order
    attempts: int = 0  # runs started that ended neither done nor stopped on purpose (a crash): bounded
    run_id: str | None = None  # the run group it runs in (run_groups.py), from its first run on

    def to_object(self, counts: tuple[int, int, int] | None = None) -> dict:
        """The Batch object of OpenAI's API; `counts` (total, completed, failed): live ones."""
        total, completed, failed = counts or (self.total, self.completed, self.failed)
        body: dict[str, Any] = {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": None, "input_file_id": self.input_file_id,
            "completion_window": self.completion_window, "status": str(self.status), "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id, "created_at": self.created_at, "expires_at": self.expires_at,
            **{stamp: self.stamps.get(stamp) for stamp in STAMPS.values()},
            "request_counts": {"total": total, "completed": completed, "failed": failed},
            "metadata": self.metadata, "model": None, "usage": self.usage,
        }
        if self.errors:
            body["errors"] = {"object": "list", "data": self.errors}
        return body


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's rules: at most 16 pairs, keys of up to 64 characters, string values of up to 512."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise ApiError(400, "metadata must be an object of at most 16 key-value pairs", param="metadata", code="invalid_value")
    for key, value in metadata.items():
        if not isinstance(key, str) or len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise ApiError(400, "metadata keys are strings of up to 64 characters, values strings of up to 512",
                           param="metadata", code="invalid_value")
    return dict(metadata)


class BatchStore:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._batches: dict[str, BatchRecord] = {}
        for path in root.glob("batch_*.json"):
            data = json.loads(path.read_text())
            data["status"] = BatchStatus(data["status"])
            record = BatchRecord(**data)
            self._batches[record.id] = record

    def _save(self, record: BatchRecord) -> None:
        write_text_atomically(self.root / f"{record.id}.json", json.dumps(asdict(record), indent=1) + "\n")

    def create(self, input_file_id: str, endpoint: str, completion_window: str, metadata: dict[str, str] | None) -> BatchRecord:
        now = int(time.time())
        record = BatchRecord(f"batch_{secrets.token_hex(12)}", input_file_id, endpoint, completion_window, now,
                             now + COMPLETION_WINDOW_S[completion_window], metadata=metadata, order=time.time_ns())
        with self._lock:
            self._save(record)
            self._batches[record.id] = record
        return record

    def get(self, batch_id: str) -> BatchRecord:
        with self._lock:
            record = self._batches.get(batch_id)
        if record is None:
            raise not_found("batch", batch_id, "batch_id")
        return record

    def newest(self, *, after: str | None = None, limit: int = 20) -> tuple[list[BatchRecord], bool]:
        """Newest first, as OpenAI lists them; `after`: the last id of the page before."""
        with self._lock:
            records = sorted(self._batches.values(), key=lambda r: (r.created_at, r.order, r.id), reverse=True)
        if after:
            ids = [r.id for r in records]
            records = records[ids.index(after) + 1:] if after in ids else []
        return records[:limit], len(records) > limit

    def active(self) -> list[BatchRecord]:
        """The batches not ended, oldest first (the order they run in)."""
        with self._lock:
            return sorted((r for r in self._batches.values() if r.status not in ENDED), key=lambda r: (r.created_at, r.order, r.id))

    def uses_file(self, file_id: str) -> bool:
        with self._lock:
            return any(r.input_file_id == file_id and r.status not in ENDED for r in self._batches.values())

    def update(self, batch_id: str, **changes: Any) -> BatchRecord:
        """Fields other than the status (counts, file ids, attempts)."""
        if "status" in changes:
            raise ValueError("a status changes by transition()")
        with self._lock:
            record = replace(self._batches[batch_id], **changes)
            self._save(record)
            self._batches[batch_id] = record
        return record

    def transition(self, batch_id: str, status: BatchStatus, *, expect: BatchStatus | None = None, **changes: Any) -> BatchRecord:
        """Move the batch to `status` (with its time stamp and `changes`); InvalidTransition when
        its status does not lead there, or is not `expect`."""
        with self._lock:
            record = self._batches[batch_id]
            if (expect is not None and record.status != expect) or status not in TRANSITIONS[record.status]:
                raise InvalidTransition(f"{batch_id}: {record.status} -> {status}")
            stamps = {**record.stamps}
            if status in STAMPS:
                stamps[STAMPS[status]] = int(time.time())
            record = replace(record, status=status, stamps=stamps, **changes)
            self._save(record)
            self._batches[batch_id] = record
        return record
