"""The result store: finished request results kept across runs, so that a run of an edited
pipeline computes only what changed (issue 69).

    store = ResultStore.at_home(batchllm_home())          # $BATCHLLM_HOME/results.sqlite, or ResultStore(path)
    if store.has_scope(scope):                             # anything at all for this node's (model, settings)?
        hits = store.get_many(keys)                        # {key: StoredResult} of the keys it holds
    store.put_many([(key, scope, record), ...], run="runs/demo 2026-12-07T18:55:01")

The runtime computes each request's key (a 32-byte digest of all its answer depends on) and
its node's scope digest; the store only keeps them. A record is kept as its journal line
(`ResultRecord.json_line`, row and step 0: the caller puts its own back), so its texts,
logprobs and vector come back bit for bit.

Invariant: `get_many` returns under a key only a record that `put_many` stored under it, whole
(its CRC-32 over key and payload checks, and it parses). An entry that does not is moved to
the `damaged` table with the reason, counted in `usage().damaged`, and is a miss: the caller
computes it again. The first answer stored for a key stays (a later put of it only marks it
used): a key names its request whole, so every run that reuses it gets the same answer.

One SQLite file in WAL mode for several processes at once (two terminals, Ray workers on one
host): every write is one short `BEGIN IMMEDIATE` transaction, and a busy store is waited for
up to BUSY_TIMEOUT_S. WAL needs every process on one host: over a network file system, give
each machine its own store. One `ResultStore` is one connection, for the thread that opened it.

The payload bytes are summed in a one-row `meta` table, updated in the same transactions as
the entries; past the cap a put evicts the least recently used entries (`used_at`, which a
read refreshes at most every TOUCH_AFTER_S). A file that is not a SQLite database, a corrupt
one, a full disk, a read-only file or a newer schema is a UserError naming the file and the fix:
the store never moves or deletes a file itself. A failed write is rolled back whole, so what
was stored before stays readable.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple, TypeVar

from batchllm.core.errors import UserError
from batchllm.io.journal_records import ResultRecord, record_of

STORE_FILE = "results.sqlite"
STORE_ENV = "BATCHLLM_STORE"  # a store path that replaces the home's (e.g. one shared by several homes)
SCHEMA_VERSION = 1  # PRAGMA user_version
KEY_BYTES = 32
DEFAULT_CAP_BYTES = 10 * 1024**3  # of payload
BUSY_TIMEOUT_S = 30.0
TOUCH_AFTER_S = 3600.0  # a read refreshes an entry's used_at when it is older than this
BATCH_KEYS = 500  # keys per `IN (...)`: under the 999 variables of older SQLite builds
CHUNK_ENTRIES = 2000  # entries written or removed per transaction
FIX_ELSEWHERE = "give the store another path with --store PATH, or run with --no-reuse"
_TABLES = {"results", "damaged", "meta", "results_scope", "results_used_at"}
_SCHEMA = (
    # a rowid table: payloads of kilobytes are better beside the key's index than inside its B-tree
    "CREATE TABLE IF NOT EXISTS results (key BLOB NOT NULL UNIQUE, scope BLOB NOT NULL, payload BLOB NOT NULL, "
    "checksum INTEGER NOT NULL, size INTEGER NOT NULL, run TEXT NOT NULL, stored_at REAL NOT NULL, used_at REAL NOT NULL)",
    "CREATE INDEX IF NOT EXISTS results_scope ON results (scope)",
    "CREATE INDEX IF NOT EXISTS results_used_at ON results (used_at)",
    "CREATE TABLE IF NOT EXISTS damaged (key BLOB NOT NULL, payload BLOB, run TEXT, stored_at REAL, reason TEXT NOT NULL, "
    "set_aside_at REAL NOT NULL)",
    "CREATE TABLE IF NOT EXISTS meta (id INTEGER PRIMARY KEY CHECK (id = 0), entries INTEGER NOT NULL, bytes INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO meta VALUES (0, 0, 0)",
)
T = TypeVar("T")


class StoredResult(NamedTuple):
    record: ResultRecord  # row 0, step 0: the caller puts its own (row, step) back
    run: str  # provenance: the run that computed it
    stored_at_s: float  # unix time


class StoreUsage(NamedTuple):
    entries: int
    payload_bytes: int
    cap_bytes: int
    damaged: int  # entries set aside as damaged
    oldest_use_s: float | None  # unix time; None when empty
    newest_use_s: float | None


def payload_of(record: ResultRecord) -> bytes:
    return record._replace(row=0, step=0).json_line().encode("utf-8")


def checksum_of(key: bytes, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(key))


def format_bytes(size: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


@lru_cache(maxsize=8)
def _in(count: int) -> str:
    return f"({','.join('?' * count)})"


class ResultStore:
    def __init__(self, path: Path, *, cap_bytes: int = DEFAULT_CAP_BYTES, clock: Callable[[], float] = time.time,
                 max_pages: int | None = None):
        """Opens the store at `path`, or creates it. `max_pages`: PRAGMA max_page_count (tests of a full disk)."""
        self.path = Path(path)
        self.cap_bytes = cap_bytes
        self._clock = clock
        if self.path.is_dir():
            raise UserError("a folder is in the way of the result store", where=str(self.path),
                            hint=f"move the folder away, or {FIX_ELSEWHERE}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        except (OSError, sqlite3.Error) as error:
            raise UserError(f"cannot open the result store ({error})", where=str(self.path),
                            hint=f"make its folder writable, or {FIX_ELSEWHERE}") from error
        try:
            self._open(max_pages)
        except BaseException:
            self._db.close()
            raise

    @classmethod
    def at_home(cls, home: Path, *, cap_bytes: int = DEFAULT_CAP_BYTES) -> ResultStore:
        return cls(home / STORE_FILE, cap_bytes=cap_bytes)


    def _open(self, max_pages: int | None) -> None:
        with self._errors():
            self._db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            if self._version() > SCHEMA_VERSION:  # the first read: "file is not a database" here
                raise self._newer()
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
            if max_pages is not None:
                self._db.execute(f"PRAGMA max_page_count = {int(max_pages)}")
            current = self._version() == SCHEMA_VERSION
        if not current:
            with self._transaction() as db:
                version = self._version()  # again, under the write lock: another process may have made it
                if version > SCHEMA_VERSION:
                    raise self._newer()
                names = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")}
                if version == 0 and names - _TABLES:
                    raise UserError(f"a SQLite database that is not a result store (it holds {', '.join(sorted(names - _TABLES))})",
                                    where=str(self.path), hint=f"move it away, or {FIX_ELSEWHERE}")
                for statement in _SCHEMA:
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _newer(self) -> UserError:
        return UserError(f"the result store was made by a newer batchllm (schema {self._version()}, this one reads "
                         f"{SCHEMA_VERSION})", where=str(self.path), hint=f"upgrade batchllm, or {FIX_ELSEWHERE}")

    def get_many(self, keys: Sequence[bytes]) -> dict[bytes, StoredResult]:
        """The stored results of those `keys` the store holds (whole ones: see the invariant)."""
        found: dict[bytes, StoredResult] = {}
        damaged: list[tuple[bytes, bytes, str]] = []
        stale: list[bytes] = []
        touch_before = self._clock() - TOUCH_AFTER_S
        with self._errors():
            for batch in _chunks(list(dict.fromkeys(keys)), BATCH_KEYS):
                query = f"SELECT key, payload, checksum, run, stored_at, used_at FROM results WHERE key IN {_in(len(batch))}"
                for key, payload, checksum, run, stored_at, used_at in self._db.execute(query, batch).fetchall():
                    try:
                        if checksum_of(key, payload) != checksum:
                            raise ValueError("its checksum does not match")
                        found[key] = StoredResult(record_of(payload), run, stored_at)
                    except (ValueError, KeyError, TypeError, IndexError) as error:
                        damaged.append((key, payload, str(error) or type(error).__name__))
                        continue
                    if used_at < touch_before:
                        stale.append(key)
        if damaged or stale:
            try:
                self._mend(stale, damaged)
            except UserError as error:  # a busy or full store keeps its old used_at and sets nothing aside this time
                if not isinstance(error.__cause__, sqlite3.OperationalError):
                    raise
        return found

    def _mend(self, stale: Sequence[bytes], damaged: Sequence[tuple[bytes, bytes, str]]) -> None:
        """After a read: refreshes `used_at` of the `stale` hits, moves the `damaged` entries to their table."""
        with self._transaction() as db:
            now = self._clock()
            for batch in _chunks(stale, BATCH_KEYS):
                db.execute(f"UPDATE results SET used_at = ? WHERE key IN {_in(len(batch))}", (now, *batch))
            for key, payload, reason in damaged:
                row = db.execute("SELECT run, stored_at, size FROM results WHERE key = ? AND payload = ?", (key, payload)).fetchone()
                if row is not None:  # not put again meanwhile
                    db.execute("DELETE FROM results WHERE key = ?", (key,))
                    db.execute("INSERT INTO damaged VALUES (?, ?, ?, ?, ?, ?)", (key, payload, row[0], row[1], reason, now))
                    db.execute("UPDATE meta SET entries = entries - 1, bytes = bytes - ? WHERE id = 0", (row[2],))

    def put_many(self, entries: Sequence[tuple[bytes, bytes, ResultRecord]], run: str) -> None:
        """Stores each (key, scope, record); a key held already keeps its answer. Evicts past the cap."""
        now = self._clock()
        rows: dict[bytes, tuple[bytes, bytes, bytes, int, int, str, float, float]] = {}
        for key, scope, record in entries:
            if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                raise ValueError(f"a result store key is {KEY_BYTES} bytes, not {key!r}")
            if key not in rows:
                payload = payload_of(record)
                rows[key] = (key, scope, payload, checksum_of(key, payload), len(payload), run, now, now)
        for chunk in _chunks(list(rows.values()), CHUNK_ENTRIES):
            with self._transaction() as db:
                held: set[bytes] = set()
                for batch in _chunks([row[0] for row in chunk], BATCH_KEYS):
                    held.update(key for (key,) in db.execute(f"SELECT key FROM results WHERE key IN {_in(len(batch))}", batch))
                new = [row for row in chunk if row[0] not in held]
                db.executemany("INSERT INTO results (key, scope, payload, checksum, size, run, stored_at, used_at) "
                               "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", new)
                for batch in _chunks(list(held), BATCH_KEYS):
                    db.execute(f"UPDATE results SET used_at = ? WHERE key IN {_in(len(batch))}", (now, *batch))
                db.execute("UPDATE meta SET entries = entries + ?, bytes = bytes + ? WHERE id = 0", (len(new), sum(row[4] for row in new)))
        with self._errors():
            over = self._meta()[1] > self.cap_bytes
        if over:
            self.prune(self.cap_bytes)

    def has_scope(self, scope: bytes) -> bool:
        """Whether the store holds any entry put with this scope."""
        with self._errors():
            return self._db.execute("SELECT 1 FROM results WHERE scope = ? LIMIT 1", (scope,)).fetchone() is not None

    def usage(self) -> StoreUsage:
        with self._errors():
            entries, payload_bytes = self._meta()
            damaged = self._db.execute("SELECT COUNT(*) FROM damaged").fetchone()[0]
            oldest = self._db.execute("SELECT MIN(used_at) FROM results").fetchone()[0]  # one aggregate a query: from the index
            newest = self._db.execute("SELECT MAX(used_at) FROM results").fetchone()[0]
        return StoreUsage(entries, payload_bytes, self.cap_bytes, damaged, oldest, newest)

    def prune(self, max_bytes: int | None = None, older_than_s: float | None = None) -> int:
        """Removes the entries unused for longer than `older_than_s`, then the least recently used
        until the payload is at most `max_bytes` (the cap when neither is given). How many it removed."""
        if max_bytes is None and older_than_s is None:
            max_bytes = self.cap_bytes
        removed = 0
        while older_than_s is not None:
            cutoff = self._clock() - older_than_s
            with self._transaction() as db:
                rows = db.execute("SELECT key, size FROM results WHERE used_at < ? ORDER BY used_at LIMIT ?",
                                  (cutoff, CHUNK_ENTRIES)).fetchall()
                removed += self._remove(rows)
            if len(rows) < CHUNK_ENTRIES:
                break
        while max_bytes is not None:
            with self._transaction() as db:
                excess = self._meta()[1] - max_bytes
                if excess <= 0:
                    break
                victims: list[tuple[bytes, int]] = []
                for key, size in db.execute("SELECT key, size FROM results ORDER BY used_at LIMIT ?", (CHUNK_ENTRIES,)).fetchall():
                    victims.append((key, size))
                    excess -= size
                    if excess <= 0:
                        break
                if not victims:  # the sum had drifted from the entries (none left): count again
                    db.execute("UPDATE meta SET entries = 0, bytes = 0 WHERE id = 0")
                    break
                removed += self._remove(victims)
        return removed

    def _remove(self, rows: Sequence[tuple[bytes, int]]) -> int:
        for batch in _chunks([key for key, _ in rows], BATCH_KEYS):
            self._db.execute(f"DELETE FROM results WHERE key IN {_in(len(batch))}", batch)
        self._db.execute("UPDATE meta SET entries = entries - ?, bytes = bytes - ? WHERE id = 0", (len(rows), sum(s for _, s in rows)))
        return len(rows)

    def _meta(self) -> tuple[int, int]:
        entries, payload_bytes = self._db.execute("SELECT entries, bytes FROM meta WHERE id = 0").fetchone()
        return int(entries), int(payload_bytes)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One short write transaction: committed whole or rolled back whole."""
        with self._errors():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                raise

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """SQLite's errors a user can act on as UserErrors naming the store and the fix."""
        try:
            yield
        except sqlite3.DatabaseError as error:
            if isinstance(error, (sqlite3.ProgrammingError, sqlite3.InterfaceError, sqlite3.IntegrityError)):
                raise
            raise self._user_error(error) from error

    def _user_error(self, error: sqlite3.Error) -> UserError:
        name, text, where = getattr(error, "sqlite_errorname", ""), str(error), str(self.path)
        if name == "SQLITE_FULL" or "is full" in text:
            return UserError(f"the result store is full ({self._fullness()}); nothing of this write was stored", where=where,
                             hint=f"make room with `batchllm store prune --store {where} --max-size SIZE`, or {FIX_ELSEWHERE}")
        if name in ("SQLITE_NOTADB", "SQLITE_CORRUPT") or "not a database" in text or "malformed" in text:
            return UserError(f"the result store is not a SQLite database or is damaged ({text})", where=where,
                             hint=f"move it away (e.g. to {self.path.name}.damaged) and a new one starts empty, or {FIX_ELSEWHERE}")
        if name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")) or "readonly" in text or "unable to open" in text:
            return UserError(f"cannot write the result store ({text})", where=where,
                             hint=f"make it and its folder writable, or {FIX_ELSEWHERE}")
        if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text:
            return UserError(f"the result store stayed busy for {BUSY_TIMEOUT_S:.0f} s ({text})", where=where,
                             hint=f"wait for the process writing it, or {FIX_ELSEWHERE}")
        return UserError(f"the result store failed ({text})", where=where, hint=f"check its disk, or {FIX_ELSEWHERE}")

    def _fullness(self) -> str:
        try:
            entries, payload_bytes = self._meta()
            text = f"{entries:,} entries, {format_bytes(payload_bytes)} of results, cap {format_bytes(self.cap_bytes)}"
        except sqlite3.Error:
            text = "its size unknown"
        with contextlib.suppress(OSError):
            text += f"; {format_bytes(shutil.disk_usage(self.path.parent).free)} free on its disk"
        return text


def default_store_path(home: Path) -> Path:
    """The store a command uses unless told another: $BATCHLLM_STORE, else `home`'s results.sqlite."""
    return Path(os.environ.get(STORE_ENV) or home / STORE_FILE)
