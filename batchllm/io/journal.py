"""Per-node result journal: the commit log that makes runs resumable.

Invariant: every line after the header is one finished (row_id, step), and no key
appears twice. A line is committed once it ends in a newline and has been flushed
to the OS, which survives `kill -9` of the process. A torn last line (a crash mid-
write) is not committed and is cut off when the journal is reopened. The header
holds the node's fingerprint, so results of a changed node are never mixed in.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from batchllm.errors import UserError


@dataclass(frozen=True)
class ResultRecord:
    row_id: str
    step: int
    texts: tuple[str, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str

    @property
    def key(self) -> tuple[str, int]:
        return (self.row_id, self.step)

    @property
    def text(self) -> str:
        return self.texts[0]


class ResultJournal:
    """Opened for appending; `records` holds everything committed so far."""

    FSYNC_EVERY = 64  # records between fsyncs (flush alone survives a process crash)

    def __init__(self, path: Path, fingerprint: str, node: str):
        self.path, self.node = path, node
        self.records: dict[tuple[str, int], ResultRecord] = {}
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            self._recover(fingerprint)
        else:
            _write_new(path, json.dumps({"node": node, "fingerprint": fingerprint}) + "\n")
        self._file = open(path, "a", encoding="utf-8")
        self._unsynced = 0

    def _recover(self, fingerprint: str) -> None:
        data = self.path.read_bytes()
        committed_end = data.rfind(b"\n") + 1
        lines = data[:committed_end].decode("utf-8").splitlines()
        header = json.loads(lines[0]) if lines else {}
        if header.get("fingerprint") != fingerprint:
            raise UserError(
                f"the results already in {str(self.path.parent.parent.parent)!r} were made by a different version of node {self.node!r} "
                "(its prompt, model, sampling, routing or input data changed)",
                where=f"nodes.{self.node}",
                hint="pass --fresh to discard the old results, or choose another --out",
            )
        for number, line in enumerate(lines[1:], start=2):
            record = ResultRecord(**{**json.loads(line), "texts": tuple(json.loads(line)["texts"])})
            if record.key in self.records:
                raise RuntimeError(f"{self.path}:{number}: duplicate result for {record.key}: journal is corrupt")
            self.records[record.key] = record
        if committed_end < len(data):  # drop the torn tail of an interrupted write
            with open(self.path, "r+b") as handle:
                handle.truncate(committed_end)

    def append(self, record: ResultRecord) -> None:
        if record.key in self.records:
            raise RuntimeError(f"node {self.node!r}: {record.key} was already committed")
        self._file.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")
        self._file.flush()
        self.records[record.key] = record
        self._unsynced += 1
        if self._unsynced >= self.FSYNC_EVERY:
            self.sync()

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._unsynced = 0

    def close(self) -> None:
        if not self._file.closed:
            self.sync()
            self._file.close()


def _write_new(path: Path, text: str) -> None:
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)
