"""`batchllm store info` and `batchllm store prune`: the result store (`io/result_store.py`)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import typer

from batchllm.cli.shell import fail
from batchllm.core.errors import UserError
from batchllm.io.result_store import STORE_FILE, ResultStore, StoreUsage, default_store_path, format_bytes
from batchllm.models.registry import batchllm_home

STORE_HELP = ("Results of earlier requests, reused by later runs: a request asked again with the same model, settings "
              "and prompt is not computed again. One SQLite file, $BATCHLLM_HOME/results.sqlite unless --store says; "
              "see docs/reuse.md.")
STORE_OPTION = typer.Option(None, "--store", help=f"The store's file (default: $BATCHLLM_STORE, else $BATCHLLM_HOME/{STORE_FILE}).", show_default=False)
DAY_S = 86_400.0
SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)
UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4, "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_size(text: str, where: str) -> int:
    """'2GB' -> 2_000_000_000, '500MiB' -> 524_288_000, '1024' -> 1024 (bytes)."""
    match = SIZE.fullmatch(text)
    if match is None:
        raise UserError(f"{text!r} is not a size", where=where, hint="write a number of bytes with a unit, e.g. 500MB, 2GB or 1.5GiB")
    return int(float(match[1]) * UNITS[(match[2] or "").lower()])


def _open(store: Path | None) -> ResultStore | None:
    """The store, or None when there is none yet (nothing is created)."""
    path = store if store is not None else default_store_path(batchllm_home())
    if not path.exists():
        typer.echo(f"store: {path}\nempty: no run has stored results there yet")
        return None
    return ResultStore(path)


def _date(unix_s: float | None) -> str:
    return "-" if unix_s is None else datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%d %H:%M UTC")


def _size(usage: StoreUsage) -> str:
    return f"{format_bytes(usage.payload_bytes)} of {format_bytes(usage.cap_bytes)}"


def store_info(store: Path | None = STORE_OPTION) -> None:
    """Show what the result store holds.

    Its entries, their size against its cap, damaged entries set aside (they are computed
    again), and when an entry was last used, the oldest and the newest."""
    try:
        opened = _open(store)
        if opened is None:
            return
        with opened:
            usage = opened.usage()
        typer.echo(f"store: {opened.path}\n"
                   f"entries: {usage.entries:,}\n"
                   f"size: {_size(usage)}\n"
                   f"damaged entries set aside: {usage.damaged:,}\n"
                   f"oldest use: {_date(usage.oldest_use_s)}\n"
                   f"newest use: {_date(usage.newest_use_s)}")
    except UserError as error:
        fail(error)


def store_prune(
    store: Path | None = STORE_OPTION,
    max_size: str | None = typer.Option(None, "--max-size", help="Remove the least recently used entries until the results "
                                        "take at most SIZE (e.g. 500MB, 2GB, 1.5GiB).", metavar="SIZE", show_default=False),
    older_than: float | None = typer.Option(None, "--older-than", help="Remove the entries no run has used for DAYS days.",
                                            metavar="DAYS", show_default=False),
) -> None:
    """Remove entries from the result store; later runs compute them again.

    First those unused for --older-than days, then the least recently used down to --max-size
    (down to the store's cap when neither is given)."""
    try:
        max_bytes = None if max_size is None else parse_size(max_size, "--max-size")
        if older_than is not None and not older_than >= 0:
            raise UserError(f"{older_than} is not a number of days", where="--older-than", hint="give 0 or more, e.g. 30")
        opened = _open(store)
        if opened is None:
            return
        with opened:
            before = opened.usage()
            removed = opened.prune(max_bytes, None if older_than is None else older_than * DAY_S)
            after = opened.usage()
        typer.echo(f"removed {removed:,} entries ({format_bytes(before.payload_bytes - after.payload_bytes)})\n"
                   f"store: {opened.path}: {after.entries:,} entries, {_size(after)}")
    except UserError as error:
        fail(error)
