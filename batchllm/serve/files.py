"""The service's files: uploaded request files and the output and error files batches write.

    <data>/files/<id>.jsonl   the bytes
    <data>/files/<id>.json    what the Files API says of it (written last: a file is there once this is)

Invariant: a file's bytes are complete before its record appears (both written beside their
place and renamed), so after a crash a file is there whole or not at all; bytes without a
record are removed at start. Uploads are counted as they stream in and refused past the
limits (file size, lines, bytes stored in all), leaving nothing behind.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

from batchllm.core.files import TEMPORARY_SUFFIX, replacing, write_text_atomically
from batchllm.serve.api_errors import ApiError, not_found

CHUNK = 1 << 20
UPLOAD_PURPOSES = ("batch",)  # what this service runs; OpenAI's other purposes are refused


@dataclass(frozen=True)
class Limits:
    max_file_bytes: int = 200 * 1000**2  # OpenAI's: 200 MB a batch file
    max_file_lines: int = 50_000  # OpenAI's: 50,000 requests a batch
    max_stored_bytes: int = 10 * 1000**3


@dataclass(frozen=True)
class StoredFile:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    lines: int

    def to_object(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "expires_at": None, "status_details": None}


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


class FileStore:
    def __init__(self, root: Path, limits: Limits = Limits()):
        self.root, self.limits = root, limits
        self._lock = threading.Lock()
        root.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, StoredFile] = {}
        for meta in root.glob("file-*.json"):
            try:
                stored = StoredFile(**json.loads(meta.read_text()))
            except (ValueError, TypeError):
                continue
            if self.content_path(stored.id).is_file():
                self._files[stored.id] = stored
        for path in root.iterdir():  # bytes without a record, temporaries of an interrupted write
            if path.name.endswith(TEMPORARY_SUFFIX) or (path.suffix == ".jsonl" and path.stem not in self._files):
                path.unlink(missing_ok=True) if path.is_file() else shutil.rmtree(path, ignore_errors=True)

    def content_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.jsonl"

    def _meta_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.json"

    def stored_bytes(self) -> int:
        with self._lock:
            return sum(f.bytes for f in self._files.values())

    def upload(self, stream: BinaryIO, filename: str, purpose: str, declared_bytes: int | None = None) -> StoredFile:
        """An uploaded file, read from `stream` a chunk at a time; ApiError past a limit."""
        if purpose not in UPLOAD_PURPOSES:
            raise ApiError(400, f"purpose {purpose!r} is not supported here; this service runs batches: use purpose 'batch'",
                           param="purpose", code="invalid_value")
        if not filename:
            raise ApiError(400, "the uploaded file has no name", param="file")
        if declared_bytes is not None and declared_bytes > self.limits.max_file_bytes + 64 * 1024:  # the form's own bytes aside
            raise self._too_large()
        file_id = new_file_id()
        size = lines = 0
        last = b"\n"
        with replacing(self.content_path(file_id)) as new:
            with open(new.path, "wb") as out:
                for chunk in iter(lambda: stream.read(CHUNK), b""):
                    size += len(chunk)
                    if size > self.limits.max_file_bytes:
                        raise self._too_large()
                    lines += chunk.count(b"\n")
                    last = chunk[-1:]
                    out.write(chunk)
            lines += last != b"\n"
            if lines > self.limits.max_file_lines:
                raise ApiError(400, f"the file has {lines:,} lines; this service takes at most {self.limits.max_file_lines:,} "
                               "lines a file (--max-file-lines)", param="file", code="too_many_lines")
            with self._lock:
                stored_now = sum(f.bytes for f in self._files.values())
                if stored_now + size > self.limits.max_stored_bytes:
                    raise ApiError(413, f"storing this file ({size:,} bytes) would pass the service's limit of "
                                   f"{self.limits.max_stored_bytes:,} bytes stored ({stored_now:,} in use; --max-stored); delete "
                                   "files you no longer need", param="file", code="storage_limit_exceeded")
                stored = StoredFile(file_id, size, int(time.time()), os.path.basename(filename), purpose, lines)
                self._files[file_id] = stored  # taken now, so two uploads at once count each other
        try:
            write_text_atomically(self._meta_path(file_id), json.dumps(asdict(stored)) + "\n")
        except BaseException:
            with self._lock:
                self._files.pop(file_id, None)
            self.content_path(file_id).unlink(missing_ok=True)
            raise
        return stored

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the file is larger than this service takes ({self.limits.max_file_bytes:,} bytes; "
                        "--max-file-size)", param="file", code="file_too_large")

    def put(self, file_id: str, lines: Iterable[str], filename: str, purpose: str) -> StoredFile:
        """A file the service writes (a batch's output or errors) under a fixed id: written again, the same file."""
        path = self.content_path(file_id)
        count = 0
        with replacing(path) as new, open(new.path, "w", encoding="utf-8") as out:
            for line in lines:
                out.write(line if line.endswith("\n") else line + "\n")
                count += 1
        stored = StoredFile(file_id, path.stat().st_size, int(time.time()), filename, purpose, count)
        write_text_atomically(self._meta_path(file_id), json.dumps(asdict(stored)) + "\n")
        with self._lock:
            self._files[file_id] = stored
        return stored

    def get(self, file_id: str) -> StoredFile:
        with self._lock:
            stored = self._files.get(file_id)
        if stored is None:
            raise not_found("file", file_id, "file_id")
        return stored

    def listing(self, *, purpose: str | None = None, after: str | None = None, limit: int = 10_000,
             order: str = "desc") -> tuple[list[StoredFile], bool]:
        with self._lock:
            files = sorted(self._files.values(), key=lambda f: (f.created_at, f.id), reverse=order != "asc")
        if purpose:
            files = [f for f in files if f.purpose == purpose]
        if after:
            ids = [f.id for f in files]
            files = files[ids.index(after) + 1:] if after in ids else []
        return files[:limit], len(files) > limit

    def delete(self, file_id: str) -> None:
        self.get(file_id)
        self._meta_path(file_id).unlink(missing_ok=True)  # the record first: no record, no file
        with self._lock:
            self._files.pop(file_id, None)
        self.content_path(file_id).unlink(missing_ok=True)

