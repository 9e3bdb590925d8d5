"""A node's journal: the commit log that makes runs resumable, at any size.

Layout of `<out>/.batchllm/journal/<node>/`:

    header.json          the node and its fingerprint (results of a changed node are refused)
    tail-000007.jsonl    the part being appended to: one JSON line per committed (row, step); an
                         embed node's vector is in its line as the base64 of its float32 bytes
                         (binary, exact; not decimal text)
    seg-000003.parquet   a compacted part: the records of tail-000003, sorted by (row, step),
                         with its record count and token sums in the file's metadata

A line is committed once it ends in a newline and was flushed to the OS (that survives
`kill -9` of the process); a torn last line is cut off at reopen. Every `segment_records`
records the tail is compacted: its segment is written beside it and renamed into place,
then the tail file is deleted, and appends go to the next part.

Invariant: every committed record is in exactly one part k: in seg-k if that file exists
(then a leftover tail-k, from a crash between rename and delete, is dropped at reopen),
else in tail-k. So a crash at any moment leaves each record exactly once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchllm.core.errors import UserError
from batchllm.core.files import replacing, write_text_atomically
from batchllm.core.result_schema import SCORE_FIELD, VECTOR_FIELD_NAME, logprobs_rows
from batchllm.io.journal_records import (
    STEP_BITS,
    JournalStats,
    ResultRecord,
    key_of,
    record_of,
    segment_schema,
    tail_lines,
    vector_array,
)

STATS_KEY = b"batchllm.stats"


class ResultJournal:
    """Opened for appending; recovers what an earlier run committed."""

    FSYNC_EVERY = 4096  # records between fsyncs (a flush alone survives a process crash)

    def __init__(self, folder: Path, fingerprint: str, node: str, *, samples: int = 1, logprobs: bool = False,
                 vector_dimensions: int | None = None, scores: bool = False, segment_records: int = 50_000):
        self.folder, self.node, self.samples, self.segment_records = folder, node, samples, segment_records
        self.logprobs, self.vector_dimensions, self.scores_kept = logprobs, vector_dimensions, scores
        self.schema = segment_schema(samples, logprobs, vector_dimensions, scores)
        folder.mkdir(parents=True, exist_ok=True)
        self._check_header(fingerprint)
        self._segments: list[Path] = []
        self._key_ranges: list[tuple[int, int]] = []  # per segment: its first and last (row, step) key
        self._segment_stats = JournalStats()
        self._tail: dict[int, ResultRecord] = {}  # key -> record, in the current tail part
        self._cache: tuple[Path, str, np.ndarray, pa.Array] | None = None  # the last segment column read
        self.damage: list[str] = []  # what opening found damaged and set aside (its units are not committed)
        self._part = self._recover()
        self._file = open(self._tail_path(self._part), "a", encoding="utf-8")
        self._unsynced = 0

    # -- opening -------------------------------------------------------------------------
    def _check_header(self, fingerprint: str) -> None:
        header = self.folder / "header.json"
        if header.exists():
            if json.loads(header.read_text()).get("fingerprint") != fingerprint:
                raise UserError(
                    f"the results already in {str(self.folder.parent.parent.parent)!r} were made by a different version "
                    f"of node {self.node!r} (its prompt, model, sampling, routing or input data changed)",
                    where=f"nodes.{self.node}", hint="pass --fresh (Python: fresh=True) to discard the old results (what the result store holds is taken from "
                         "it, not computed again), or choose another --out (out=)")
            return
        write_text_atomically(header, json.dumps({"node": self.node, "fingerprint": fingerprint}) + "\n")

    def _tail_path(self, part: int) -> Path:
        return self.folder / f"tail-{part:06d}.jsonl"

    def _segment_path(self, part: int) -> Path:
        return self.folder / f"seg-{part:06d}.parquet"

    def _recover(self) -> int:
        """Drop what a crash left half-done; load the tail; returns the part to append to."""
        for stale in self.folder.glob("*.tmp"):
            stale.unlink()
        segments = {int(p.stem[4:]): p for p in self.folder.glob("seg-*.parquet")}
        tails = {int(p.stem[5:]): p for p in self.folder.glob("tail-*.jsonl")}
        for part in set(tails) & set(segments):  # compacted; the delete did not happen
            tails.pop(part).unlink()
        self._segments = []
        for part in sorted(segments):
            try:
                metadata = pq.read_metadata(segments[part])
                key_range = _key_range(metadata)
                stats = JournalStats(**json.loads(metadata.schema.to_arrow_schema().metadata[STATS_KEY]))
            except (OSError, ValueError, KeyError, TypeError, IndexError) as error:  # pyarrow's errors are OSError/ValueError
                self.damage.append(self._set_aside(segments[part], f"does not read ({_first_line(error)})"))
                continue
            self._segments.append(segments[part])
            self._key_ranges.append(key_range)
            self._segment_stats = self._segment_stats.plus(stats)
        if len(tails) > 1:
            for part in sorted(tails)[:-1]:  # only the newest part is appended to: an older one is a copy's leftover
                self.damage.append(self._set_aside(tails.pop(part), "is an uncompacted part older than the newest"))
        if not tails:
            return max(segments, default=-1) + 1
        part, path = next(iter(tails.items()))
        self._load_tail(path)
        return part

    def _load_tail(self, path: Path) -> None:
        """The tail's committed lines into `_tail`. The torn end of an interrupted write (no
        newline yet) is cut off; a whole line that does not parse, or repeats a committed
        (row, step), is damage (a disk or copy error): it is moved to a `.damaged` file
        beside the journal and its unit is computed again."""
        data = path.read_bytes()
        committed_end = data.rfind(b"\n") + 1
        kept: list[bytes] = []
        damaged: list[tuple[int, bytes, str]] = []
        for number, raw in enumerate(data[:committed_end].split(b"\n")[:-1], start=1):
            try:
                record = record_of(raw)
            except (UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
                damaged.append((number, raw, _first_line(error)))
                continue
            key = record.row << STEP_BITS | record.step
            if key in self._tail:
                damaged.append((number, raw, f"a second result for row {record.row} step {record.step}"))
                continue
            if record.vector is not None and len(record.vector) != self.vector_dimensions:
                damaged.append((number, raw, f"a vector of {len(record.vector)} floats, not {self.vector_dimensions}"))
                continue
            self._tail[key] = record
            kept.append(raw)
        if damaged:
            aside = path.with_name(f"{path.name}.damaged")
            with open(aside, "ab") as handle:
                handle.write(b"".join(raw + b"\n" for _, raw, _ in damaged))
            with replacing(path, fsync=True) as new:
                new.path.write_bytes(b"".join(raw + b"\n" for raw in kept))
            lines = ", ".join(f"{number} ({why})" for number, _, why in damaged[:3]) + (" ..." if len(damaged) > 3 else "")
            self.damage.append(f"{path}: {len(damaged):,} damaged line(s) set aside in {aside.name}: line {lines}; "
                               "their units run again")
        elif committed_end < len(data):  # the torn end of an interrupted write
            with open(path, "r+b") as handle:
                handle.truncate(committed_end)

    def _set_aside(self, path: Path, why: str) -> str:
        aside = path.with_name(f"{path.name}.damaged")
        os.replace(path, aside)
        return f"{path} {why}: set aside as {aside.name}; its units run again"

    # -- reading ---------------------------------------------------------------------------
    def committed_keys(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, steps) of every committed record, in arrays of the final size (120 MB at 10M
        records; a resume reads `committed_key_batches` instead, and holds one segment's)."""
        total = self._segment_stats.committed + len(self._tail)
        rows, steps = np.empty(total, np.int64), np.empty(total, np.int32)
        at = 0
        for batch_rows, batch_steps in self.committed_key_batches():
            rows[at:at + len(batch_rows)], steps[at:at + len(batch_rows)] = batch_rows, batch_steps
            at += len(batch_rows)
        return rows, steps

    def committed_key_batches(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(rows, steps) of the committed records, a segment at a time (only those two columns
        are read), then the tail's."""
        for path in self._segments:
            try:
                table = pq.read_table(path, columns=["row", "step"])
            except (OSError, ValueError) as error:  # its footer read at opening; its pages do not
                raise UserError(f"journal segment {str(path)!r} of node {self.node!r} is damaged: {_first_line(error)}",
                                where=str(path), hint=f"move it aside (mv {path} {path}.damaged) and run again: its units "
                                "run again, everything else stays committed") from error
            yield table.column("row").to_numpy(), table.column("step").to_numpy()
        if self._tail:
            yield (np.fromiter((r.row for r in self._tail.values()), np.int64, len(self._tail)),
                   np.fromiter((r.step for r in self._tail.values()), np.int32, len(self._tail)))

    def texts(self, rows: np.ndarray, steps: np.ndarray) -> list[str | None]:
        """The main text of each (row, step), None where nothing is committed."""
        return self._values(rows, steps, "text", lambda record: record.text, lambda column, at: column[at].as_py())

    def vectors(self, rows: np.ndarray, steps: np.ndarray) -> list[np.ndarray | None]:
        """An embed node's vector of each (row, step), None where nothing (or a failure) is committed."""
        if self.vector_dimensions is None:
            raise ValueError(f"node {self.node!r} is no embed node: its journal holds no vectors")
        return self._values(rows, steps, "vector", lambda record: record.vector,
                            lambda column, at: column[at].values.to_numpy() if column[at].is_valid else None)

    def scores(self, rows: np.ndarray, steps: np.ndarray) -> list[float | None]:
        """A score node's number for each (row, step), None where nothing (or a failure) is committed."""
        if not self.scores_kept:
            raise ValueError(f"node {self.node!r} is no score node: its journal holds no scores")
        return self._values(rows, steps, "score", lambda record: record.score, lambda column, at: column[at].as_py())

    def answer_sizes(self, rows: np.ndarray, steps: np.ndarray) -> list[tuple[int, int, str] | None]:
        """(prompt tokens, output tokens, finish reason as stored) of each (row, step), None where
        nothing is committed."""
        as_int = lambda column, at: int(column[at].as_py())  # noqa: E731
        prompts = self._values(rows, steps, "num_prompt_tokens", lambda record: record.num_prompt_tokens, as_int)
        outputs = self._values(rows, steps, "num_output_tokens", lambda record: record.num_output_tokens, as_int)
        reasons = self._values(rows, steps, "finish_reason", lambda record: record.finish_reason, lambda column, at: column[at].as_py())
        return [None if p is None or o is None or r is None else (p, o, r) for p, o, r in zip(prompts, outputs, reasons)]

    def _values(self, rows: np.ndarray, steps: np.ndarray, column: str, of_record: Callable[[ResultRecord], Any],
                of_segment: Callable[[pa.Array, int], Any]) -> list:
        """A column's value of each (row, step): from the tail's record (`of_record`), else from
        the segment that holds it (`of_segment(column array, position)`); None where nothing is committed."""
        keys = key_of(rows, steps)
        found: list = [None] * len(keys)
        missing = []
        for k, key in enumerate(keys.tolist()):
            record = self._tail.get(key)
            if record is None:
                missing.append(k)
            else:
                found[k] = of_record(record)
        if missing:
            wanted = keys[missing]
            low, high = int(wanted.min()), int(wanted.max())
            for path, (first, last) in zip(self._segments, self._key_ranges):
                if last < low or first > high:
                    continue
                segment_keys, values = self._segment_column(path, column)
                at = np.searchsorted(segment_keys, wanted).clip(max=len(segment_keys) - 1)
                hit = segment_keys[at] == wanted
                for k, position in zip(np.asarray(missing)[hit].tolist(), at[hit].tolist()):
                    found[k] = of_segment(values, position)
        return found

    def _segment_column(self, path: Path, column: str) -> tuple[np.ndarray, pa.Array]:
        """A segment's sorted keys and one column (the last segment and column read are kept)."""
        if self._cache is None or self._cache[:2] != (path, column):
            table = pq.read_table(path, columns=["row", "step", column])
            keys = key_of(table.column("row").to_numpy(), table.column("step").to_numpy())
            self._cache = (path, column, keys, table.column(column).combine_chunks())
        return self._cache[2], self._cache[3]

    def stats(self) -> JournalStats:
        return self._segment_stats.plus(JournalStats.of(list(self._tail.values())))

    def segment_paths(self) -> list[Path]:
        return list(self._segments)

    # -- writing ---------------------------------------------------------------------------
    def append_many(self, records: Sequence[ResultRecord]) -> None:
        lines, batch = [], {}
        for record in records:
            key = record.row << STEP_BITS | record.step
            if key in self._tail or key in batch:  # refused whole: nothing of the batch is taken
                raise RuntimeError(f"node {self.node!r}: row {record.row} step {record.step} was already committed")
            batch[key] = record
            lines.append(record.json_line())
        if not lines:
            return
        self._file.write("\n".join(lines) + "\n")
        self._file.flush()
        self._tail.update(batch)
        self._unsynced += len(lines)
        if self._unsynced >= self.FSYNC_EVERY:
            self.sync()
        if len(self._tail) >= self.segment_records:
            self.compact()

    def compact(self) -> None:
        """The tail becomes a sorted Parquet segment (see the module's invariant)."""
        if not self._tail:
            return
        self.sync()
        keys = sorted(self._tail)
        records = [self._tail[k] for k in keys]
        rows, steps, texts, prompt_tokens, output_tokens, reasons, logprobs, vectors, scores = zip(*records)  # the fields as columns
        columns = {"row": rows, "step": steps, "text": [t[0] for t in texts], "num_prompt_tokens": prompt_tokens,
                   "num_output_tokens": output_tokens, "finish_reason": reasons}
        if self.samples > 1:
            columns["texts"] = [list(t) for t in texts]
        if self.logprobs:
            columns["logprobs"] = [logprobs_rows(lp) for lp in logprobs]
        if self.vector_dimensions is not None:
            columns[VECTOR_FIELD_NAME] = vector_array(vectors, self.vector_dimensions)
        if self.scores_kept:
            columns[SCORE_FIELD[0]] = scores
        stats = JournalStats.of(records)
        schema = self.schema.with_metadata({STATS_KEY: json.dumps(stats.__dict__).encode()})
        segment = self._segment_path(self._part)
        with replacing(segment, fsync=True) as new:
            pq.write_table(pa.table(columns, schema=schema), new.path, row_group_size=8192)
        self._file.close()
        self._tail_path(self._part).unlink()
        self._segments.append(segment)
        self._key_ranges.append((keys[0], keys[-1]))
        self._segment_stats = self._segment_stats.plus(stats)
        self._tail = {}
        self._part += 1
        self._file = open(self._tail_path(self._part), "a", encoding="utf-8")

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._unsynced = 0

    def close(self) -> None:
        if not self._file.closed:
            self.sync()
            self._file.close()


def _key_range(metadata: pq.FileMetaData) -> tuple[int, int]:
    """The first and last (row, step) key of a sorted segment, from its statistics."""
    first_group, last_group = metadata.row_group(0), metadata.row_group(metadata.num_row_groups - 1)
    row_min, row_max = first_group.column(0).statistics.min, last_group.column(0).statistics.max
    return int(row_min) << STEP_BITS, (int(row_max) << STEP_BITS) | ((1 << STEP_BITS) - 1)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def read_records(folder: Path) -> pa.Table:
    """Every committed record of a journal folder, read without opening it for writing
    (for tests and tools): segments and the tail's complete lines."""
    tables = [pq.read_table(p) for p in sorted(folder.glob("seg-*.parquet"))]
    compacted = {int(p.stem[4:]) for p in folder.glob("seg-*.parquet")}
    for tail in sorted(folder.glob("tail-*.jsonl")):
        if int(tail.stem[5:]) in compacted:
            continue
        data = tail.read_bytes()
        lines = [json.loads(line) for line in tail_lines(data[:data.rfind(b"\n") + 1])]
        if lines:
            tables.append(pa.table({"row": [x["row"] for x in lines], "step": [x["step"] for x in lines],
                                    "text": [x["texts"][0] for x in lines],
                                    "num_prompt_tokens": [x["num_prompt_tokens"] for x in lines],
                                    "num_output_tokens": [x["num_output_tokens"] for x in lines],
                                    "finish_reason": [x["finish_reason"] for x in lines]}))
    columns = segment_schema(1).names
    tables = [t.select(columns).cast(segment_schema(1)) for t in tables]
    return pa.concat_tables(tables) if tables else segment_schema(1).empty_table()
