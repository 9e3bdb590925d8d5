"""Where an input's rows come from, and the one Parquet file batchllm reads them from.

An input's `path` is a Parquet file, a folder, a glob, a JSONL or CSV file (`.gz` too), or a
Hugging Face `datasets` folder written by `save_to_disk`, on local disk or at a URI a
pyarrow filesystem opens (fetched once, `io.remote_files`); its format comes from `format:`,
else from the extension (a folder: its files' extension, or `state.json` for Hugging Face).

Invariant: one Parquet file is read in place. Anything else is converted once, streaming
(`io.input_convert`), into `$BATCHLLM_HOME/inputs/<digest>.parquet`, where the digest covers
the source files' bytes in row order, the format and `CONVERTER_VERSION`; a second open finds
it there. The cache file appears whole or not at all: it is written beside its place, checked
by the caller, and renamed into place; a source that fails the conversion or the checks
leaves nothing behind, not even the cache folders the conversion created.
"""

from __future__ import annotations

import glob
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar, cast

from batchllm.core.errors import UserError
from batchllm.core.files import replacing
from batchllm.dag.model import INPUT_FORMATS, InputSpec
from batchllm.io.input_convert import InputFiles, convert
from batchllm.io.remote_files import local_copy
from batchllm.models.registry import batchllm_home

CONVERTER_VERSION = 1
EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
              ".csv": "csv", ".tsv": "csv", ".jsonl.gz": "jsonl", ".ndjson.gz": "jsonl", ".csv.gz": "csv", ".tsv.gz": "csv"}
HF_STATE, HF_DICT = "state.json", "dataset_dict.json"
GLOB_CHARACTERS = re.compile(r"[*?[]")
FIX_PATH = "fix `path:` (relative paths start at the DAG file's folder)"
T = TypeVar("T")


@dataclass(frozen=True)
class ParquetInput:
    path: Path  # the Parquet file batchllm reads: the user's own, or the converted one in the cache
    digest: str | None  # what the fingerprint names the data by; None: the file's sha256 (computed when asked)


def parquet_input(spec: InputSpec, check: Callable[[Path], T]) -> tuple[ParquetInput, T]:
    """The input as one Parquet file, converted if need be, and `check`'s verdict on that
    file: `check` raises to refuse it, and a refused conversion is never cached."""
    source = locate(spec)
    if source.format == "parquet" and len(source.files) == 1:
        return ParquetInput(source.files[0], None), check(source.files[0])
    digest = source_digest(source)
    target = batchllm_home() / "inputs" / f"{digest}.parquet"
    if target.is_file():
        return ParquetInput(target, digest), check(target)
    created = _make_folders(target.parent)
    try:
        with replacing(target) as new:
            convert(source, new.path)
            verdict = check(new.path)
    except BaseException:
        for folder in reversed(created):
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return ParquetInput(target, digest), verdict


def input_digest(spec: InputSpec) -> str:
    """What `InputSource.fingerprint` names the data by, without converting it."""
    source = locate(spec)
    if source.format == "parquet" and len(source.files) == 1:
        return _sha256(source.files[0])
    return source_digest(source)


def source_digest(source: InputFiles) -> str:
    """sha256 over the converter's version, the format and each file's sha256, in row order."""
    digest = hashlib.sha256(f"batchllm-input {CONVERTER_VERSION} {source.format}\n".encode())
    for file in source.files:
        digest.update(f"{_sha256(file)}\n".encode())
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _make_folders(folder: Path) -> list[Path]:
    """mkdir -p, returning the folders it created, outermost first."""
    missing = [p for p in [folder, *folder.parents] if not p.exists()][::-1]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


# -- which files, which format --------------------------------------------------------------------
def format_of(path: Path) -> str | None:
    name = path.name.lower()
    return next((fmt for ext, fmt in EXTENSIONS.items() if name.endswith(ext) and len(name) > len(ext)), None)


def locate(spec: InputSpec) -> InputFiles:
    """The input's files in row order and their format; a UserError for anything else."""
    where, shown = f"inputs.{spec.name}", spec.uri or str(spec.path)
    if spec.uri is not None:
        spec = replace(spec, path=local_copy(spec.uri, where=f"{where}.path"))
    if spec.format is not None and spec.format not in INPUT_FORMATS:
        raise UserError(f"unknown input format {spec.format!r}", where=where, hint=f"formats: {', '.join(INPUT_FORMATS)}")
    if GLOB_CHARACTERS.search(shown):
        files = tuple(sorted(Path(p) for p in glob.glob(shown, recursive=True) if Path(p).is_file()))
        if not files:
            raise UserError(f"input pattern {shown!r} matches no file", where=where, hint=FIX_PATH)
        return InputFiles(spec.format or _common_format(files, where), files, shown, where)
    if not spec.path.exists():
        raise UserError(f"input file {shown!r} does not exist", where=where, hint=FIX_PATH)
    if spec.path.is_dir():
        return _folder(spec, where)
    if spec.format == "hf":
        raise UserError(f"format hf reads a folder written by `save_to_disk`, but {shown!r} is a file", where=where,
                        hint="point `path:` at the dataset's folder (it holds state.json and data-*.arrow files)")
    fmt = spec.format or format_of(spec.path)
    if fmt is None:
        raise UserError(f"cannot tell the format of {shown!r} from its extension", where=where,
                        hint=f"add `format:` ({', '.join(INPUT_FORMATS)}), or name it .parquet, .jsonl or .csv")
    return InputFiles(fmt, (spec.path,), shown, where)


def _common_format(files: tuple[Path, ...], where: str) -> str:
    formats = {file: format_of(file) for file in files}
    unknown = [f for f, fmt in formats.items() if fmt is None]
    if unknown:
        raise UserError(f"cannot tell the format of {str(unknown[0])!r} from its extension", where=where,
                        hint=f"add `format:` ({', '.join(INPUT_FORMATS)}), or match only .parquet, .jsonl or .csv files")
    kinds = sorted(cast("set[str]", set(formats.values())))  # no None: unknown formats raised above
    if len(kinds) > 1:
        example = {fmt: next(str(f) for f, k in formats.items() if k == fmt) for fmt in kinds}
        raise UserError(f"the input mixes formats: {', '.join(f'{example[k]!r} ({k})' for k in kinds)}", where=where,
                        hint="one input reads files of one format")
    return kinds[0]


def _folder(spec: InputSpec, where: str) -> InputFiles:
    folder, shown = spec.path, str(spec.path)
    if spec.format in (None, "hf") and (folder / HF_STATE).is_file():
        return _hf_files(folder, where)
    if (folder / HF_DICT).is_file():
        splits = sorted(p.name for p in folder.iterdir() if (p / HF_STATE).is_file())
        raise UserError(f"{shown!r} holds a Hugging Face DatasetDict (splits: {', '.join(splits) or 'none'}), not one data set",
                        where=where, hint=f"point `path:` at one split's folder, e.g. {str(folder / (splits or ['train'])[0])!r}")
    if spec.format == "hf":
        raise UserError(f"{shown!r} has no {HF_STATE}, so it is not a folder written by `save_to_disk`", where=where, hint=FIX_PATH)
    files = tuple(sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith((".", "_"))
                         and format_of(p) is not None and (spec.format is None or format_of(p) == spec.format)))
    if not files:
        wanted = f"{spec.format} files" if spec.format else ".parquet, .jsonl or .csv files"
        raise UserError(f"input folder {shown!r} has no {wanted}", where=where, hint=FIX_PATH)
    return InputFiles(spec.format or _common_format(files, where), files, shown, where)


def _hf_files(folder: Path, where: str) -> InputFiles:
    """The Arrow files `state.json` lists, in its order (`save_to_disk` writes them so)."""
    state_path = folder / HF_STATE
    try:
        names = [entry["filename"] for entry in json.loads(state_path.read_text(encoding="utf-8"))["_data_files"]]
        if not names or not all(isinstance(n, str) for n in names):
            raise ValueError("no data files")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{str(state_path)!r} does not list the data set's files ({type(exc).__name__}: {exc})", where=where,
                        hint="point `path:` at a folder written by `Dataset.save_to_disk`") from None
    files = tuple(folder / name for name in names)
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise UserError(f"{str(missing[0])!r}, listed in {HF_STATE}, does not exist", where=where,
                        hint="the folder is incomplete: save the data set again")
    return InputFiles("hf", files, str(folder), where)
