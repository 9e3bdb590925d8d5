"""Layout of a run's output folder, and the lock that keeps two runs out of it.

    <out>/<output>.parquet         final data sets (`.jsonl` for an output with `format: jsonl`)
    <out>/nodes/<node>.parquet     every (row, step) result of a node
    <out>/.batchllm/journal/<node>/  the commit log that makes resume exact (Parquet segments + a JSONL tail)
    <out>/.batchllm/status.json    what `batchllm status` reads while the run goes and after
    <out>/.batchllm/logs/          engine logs
"""

from __future__ import annotations

import fcntl
import shutil
from pathlib import Path
from typing import IO

from batchllm.core.errors import UserError


class RunDir:
    def __init__(self, root: Path):
        self.root = root
        self.state = root / ".batchllm"
        self._lock_file: IO[str] | None = None

    def journal_folder(self, node: str) -> Path:
        return self.state / "journal" / node

    @property
    def status_path(self) -> Path:
        return self.state / "status.json"

    def node_path(self, node: str) -> Path:
        return self.root / "nodes" / f"{node}.parquet"

    def output_path(self, name: str, file_format: str = "parquet") -> Path:
        return self.root / f"{name}.{file_format}"

    def log_path(self, label: str) -> Path:
        return self.state / "logs" / f"{label}.log"

    def open(self, fresh: bool) -> None:
        """Create the folder and take the lock; with `fresh`, drop earlier results first."""
        if self.root.exists() and not self.root.is_dir():
            raise UserError(f"--out {str(self.root)!r} exists and is not a folder", hint="choose another --out")
        self.state.mkdir(parents=True, exist_ok=True)
        self._lock_file = lock = open(self.state / "lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another batchllm run is using {str(self.root)!r}", hint="wait for it to finish, or choose another --out") from None
        if fresh:
            for path in (self.state / "journal", self.state / "logs", self.root / "nodes"):
                shutil.rmtree(path, ignore_errors=True)
        (self.state / "logs").mkdir(exist_ok=True)

    def close(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None
