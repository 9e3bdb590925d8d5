"""Writing a file or a folder so that a reader, or a crash, sees the old one or the new one
whole, never half of one: the one way batchllm replaces what it wrote before.

    with replacing(path) as new:
        write(new.path)            # a temporary beside `path`
    # here `path` is what was written; on an error it is as it was, and no temporary is left

The temporary is hidden beside the target (same folder, so the rename is atomic), named
for the process and thread that write it, and ends in `.tmp`.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

TEMPORARY_SUFFIX = ".tmp"


@dataclass
class Replacement:
    path: Path  # where to write the new file or folder
    keep_old: bool = False  # set to leave the target as it is (the new one is removed)


def temporary_beside(path: Path, tag: str = "") -> Path:
    return path.with_name(f".{path.name}{tag}.{os.getpid()}-{threading.get_ident()}{TEMPORARY_SUFFIX}")


@contextmanager
def replacing(path: Path, *, fsync: bool = False) -> Iterator[Replacement]:
    """`fsync`: the new file's bytes are on disk before it replaces the old one."""
    new = Replacement(temporary_beside(path))
    try:
        yield new
        if not new.keep_old:
            if fsync:
                with open(new.path, "rb") as handle:
                    os.fsync(handle.fileno())
            _replace(new.path, path)
    finally:
        _remove(new.path)


def write_text_atomically(path: Path, text: str) -> None:
    with replacing(path) as new:
        new.path.write_text(text, encoding="utf-8")


def _replace(new: Path, path: Path) -> None:
    if new.is_dir() and path.exists():  # a folder cannot be renamed onto a folder that has files
        old = temporary_beside(path, ".old")
        os.replace(path, old)
        os.replace(new, path)
        _remove(old)
    else:
        os.replace(new, path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
