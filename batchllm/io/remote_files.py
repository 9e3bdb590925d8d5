"""Inputs and outputs named by a URI that a pyarrow filesystem opens (`s3://`, `gs://`,
`hdfs://`, `abfs://`, `file://`), with the user's own credentials for it.

The driver keeps its ledger, journal and run folder on local disk (exactly-once needs a
local rename), so a URI input is copied once into `$BATCHLLM_HOME/remote/<key>/` and read
from there as a local file or folder of any input format, and an output data set with
`copy_to:` is copied to its URI after it is written in the run folder. Invariant: the key
covers the URI and each remote file's path, size and modification time, so a changed
remote file is fetched again and an unchanged one never is; a copy appears whole (fetched
beside its place and renamed) or not at all.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from batchllm.core.errors import UserError
from batchllm.core.files import replacing
from batchllm.models.registry import batchllm_home

HINT = "check the URI, and that your credentials for it are set (pyarrow opens s3://, gs://, hdfs://, abfs://, file://)"


def _open(uri: str, where: str) -> tuple[pafs.FileSystem, str]:
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise UserError(f"cannot open {uri!r}: {exc}", where=where, hint=HINT) from None


def local_copy(uri: str, *, where: str) -> Path:
    """The file or folder at `uri` as a local path (fetched now, or found fetched)."""
    filesystem, path = _open(uri, where)
    try:
        info = filesystem.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise UserError(f"input {uri!r} does not exist", where=where, hint=HINT)
        files = [info] if info.type == pafs.FileType.File else sorted(
            (f for f in filesystem.get_file_info(pafs.FileSelector(path, recursive=True)) if f.type == pafs.FileType.File),
            key=lambda f: f.path)
        key = hashlib.sha256(uri.encode())
        for f in files:
            key.update(f"\n{f.path} {f.size} {f.mtime_ns}".encode())
        folder = batchllm_home() / "remote" / key.hexdigest()[:32]
        target = folder / (Path(path.rstrip("/")).name or "data")
        if folder.is_dir() and (folder / ".complete").is_file():
            return target
        folder.parent.mkdir(parents=True, exist_ok=True)
        with replacing(folder) as building:  # replaces an incomplete copy of an interrupted one
            building.path.mkdir()
            if info.type == pafs.FileType.Directory:
                (building.path / target.name).mkdir()
            pafs.copy_files(path, str(building.path / target.name), source_filesystem=filesystem,
                            destination_filesystem=pafs.LocalFileSystem())
            (building.path / ".complete").write_text(uri)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"cannot read {uri!r}: {exc}", where=where, hint=HINT) from None
    return target


def _parent(path: str) -> str:
    """The folder a filesystem path is in ("" at the top)."""
    return path.rsplit("/", 1)[0] if "/" in path.strip("/") else ""


def check_copy_target(uri: str, *, where: str) -> None:
    """Before a run: `uri` can take the output file, as far as can be told without writing.
    Its filesystem opens (scheme, credentials), it is not a folder, and its nearest existing
    parent is a folder (writable, on local disk). Nothing is created."""
    filesystem, path = _open(uri, where)
    try:
        if filesystem.get_file_info(path).type == pafs.FileType.Directory:
            raise UserError(f"copy_to {uri!r} is a folder", where=where, hint="name the file to write, e.g. .../results.parquet")
        parent = _parent(path.rstrip("/"))
        while parent:
            info = filesystem.get_file_info(parent)
            if info.type == pafs.FileType.File:
                raise UserError(f"copy_to {uri!r} cannot be written: {parent!r} is a file, not a folder", where=where,
                                hint="pick a path whose parents are folders (or do not exist yet)")
            if info.type == pafs.FileType.Directory:
                if isinstance(filesystem, pafs.LocalFileSystem) and not os.access(parent, os.W_OK):
                    raise UserError(f"copy_to {uri!r} cannot be written: folder {parent!r} is not writable", where=where,
                                    hint="pick a folder you can write to")
                return
            parent = _parent(parent)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"cannot reach {uri!r}: {exc}", where=where, hint=HINT) from None


def copy_out(local: Path, uri: str, *, where: str) -> None:
    """A written output file to its URI (the URI names the file)."""
    filesystem, path = _open(uri, where)
    try:
        parent = _parent(path)
        if parent:
            filesystem.create_dir(parent, recursive=True)
        pafs.copy_files(str(local), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=filesystem)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"cannot write {uri!r}: {exc}", where=where, hint=HINT) from None
