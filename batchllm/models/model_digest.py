"""A model's identity for the result store: a digest of its directory's content (weights, config,
tokenizer: every file that decides its answers), computed once and remembered.

Hashing a model reads every byte of its weights (seconds for the embedded model, minutes for a
large one), so the digest is remembered in `$BATCHLLM_HOME/model-digests.json` per directory,
beside what was seen of its files (relative path, size, modification time). A later command
stats the files and takes the remembered digest while that listing is unchanged: a file
replaced, added or removed hashes the directory again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from batchllm.core.files import write_text_atomically

DIGESTS_FILE = "model-digests.json"
CHUNK_BYTES = 1 << 22


def model_digest(model_dir: Path, home: Path) -> str:
    """The content digest (hex) of the model in `model_dir` (a directory, or one file: an embedded
    model's shipped checkpoint), remembered under `home`."""
    model_dir = model_dir.resolve()
    listing = _listing(model_dir)
    remembered = _remembered(home)
    entry = remembered.get(str(model_dir))
    if entry is not None and entry.get("listing") == listing:
        return str(entry["digest"])
    digest = _hash_files(model_dir, [relative for relative, _, _ in listing])
    remembered[str(model_dir)] = {"listing": listing, "digest": digest}
    try:
        home.mkdir(parents=True, exist_ok=True)
        write_text_atomically(home / DIGESTS_FILE, json.dumps(remembered, indent=1))
    except OSError:
        pass  # not remembered: the next command hashes it again
    return digest


def _listing(model_dir: Path) -> list[list]:
    """Every regular file under the directory (hidden ones aside), as [relative path, size, mtime ns];
    a file, as itself."""
    if model_dir.is_file():
        return [[model_dir.name, (stat := model_dir.stat()).st_size, stat.st_mtime_ns]]
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and not any(part.startswith(".")
                                                                              for part in p.relative_to(model_dir).parts))
    return [[str(p.relative_to(model_dir)), (stat := p.stat()).st_size, stat.st_mtime_ns] for p in files]


def _hash_files(model_dir: Path, relatives: list[str]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for relative in relatives:
        digest.update(relative.encode() + b"\0")
        with open(model_dir if model_dir.is_file() else model_dir / relative, "rb") as file:
            while chunk := file.read(CHUNK_BYTES):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def _remembered(home: Path) -> dict[str, dict]:
    try:
        data = json.loads((home / DIGESTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
