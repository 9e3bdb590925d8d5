"""The images of a request, as its row gave them, and what reads them.

An image source is one of:
- a local path (made absolute, relative to the input file's folder) or a `file://` URI;
- a `data:image/...;base64,...` URI;
- an `http://` or `https://` URL (passed on to a server; engines here fetch nothing);
- the image's bytes (a binary column, or the `bytes` of a Hugging Face datasets image struct).

A row's value is one source, a list of them, or a struct `{bytes, path}`. Sources cross the
engine boundary as they are (str or bytes: picklable); the engine reads each one, so a missing
or unreadable image fails its row only (`ImageUnreadable`), never the run.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import unquote, urlparse

ImageSource = str | bytes
ORDER_KEY_TOKENS = 16  # stand-in tokens per image in the prefix order's key (a block's worth here)


class ImageUnreadable(ValueError):
    """A row's image that cannot be read: the message says which and why."""


def row_images(value: object, base_dir: Path) -> tuple[ImageSource, ...]:
    """A row's value (one source, a list of them, a `{bytes, path}` struct) -> its sources, relative
    paths made absolute against `base_dir`; an empty list: none; a null: an empty source."""
    if value is None:  # a null where an image should be: that row's error when it runs
        return ("",)
    if hasattr(value, "tolist") and not isinstance(value, (bytes, bytearray)):  # a NumPy array from a list column
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return tuple(source for item in value for source in row_images(item, base_dir))
    if isinstance(value, Mapping):  # Hugging Face datasets' Image feature: {bytes, path}
        data, path = value.get("bytes"), value.get("path")
        return row_images(data if data is not None else path, base_dir)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return (bytes(value),)
    text = str(value).strip()
    if not text or _scheme(text) in ("data", "http", "https", "file"):
        return (text,)
    return (str((base_dir / text).resolve()),)


def image_bytes(source: ImageSource, number: int) -> bytes:
    """The encoded image (PNG, JPEG, ...) of a source; ImageUnreadable saying why not. `number`:
    the image's place in its request, from 1, for the message."""
    if isinstance(source, bytes):
        if not source:
            raise ImageUnreadable(f"image {number} is empty (0 bytes)")
        return source
    scheme = _scheme(source)
    if scheme == "data":
        header, _, payload = source.partition(",")
        if not header.endswith(";base64"):
            raise ImageUnreadable(f"image {number} is a data: URI without ';base64': {source[:60]!r}")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageUnreadable(f"image {number} is a data: URI whose base64 does not decode: {source[:60]!r}") from None
    if scheme in ("http", "https"):
        raise ImageUnreadable(f"image {number} is a URL ({source[:80]}); batchllm's engines fetch nothing over the network: "
                              "download the images and give their paths or bytes")
    path = Path(unquote(urlparse(source).path)) if scheme == "file" else Path(source)
    if not source:
        raise ImageUnreadable(f"image {number} is empty (a null or an empty text): give a path, a data: URI or the image's bytes")
    try:
        return path.read_bytes()
    except OSError as error:
        raise ImageUnreadable(f"image {number} at {str(path)!r} cannot be read: {error.strerror or error}") from None


def data_uri(source: ImageSource, number: int) -> str:
    """The source as a server takes it in a content part: its URL, or a data: URI of its bytes."""
    if isinstance(source, str) and _scheme(source) in ("data", "http", "https"):
        return source
    data = image_bytes(source, number)
    return f"data:{_media_type(data)};base64,{base64.b64encode(data).decode('ascii')}"


def order_key_ids(sources: Sequence[ImageSource]) -> list[int]:
    """Stand-in token ids for a request's images in the prefix order's key: equal for the same
    source (its bytes, or its path or URI), different otherwise; negative, so never a real token."""
    ids: list[int] = []
    for source in sources:
        digest = hashlib.blake2b(source if isinstance(source, bytes) else source.encode(), digest_size=8).digest()
        ids.extend([-1 - int.from_bytes(digest, "big") % (1 << 62)] * ORDER_KEY_TOKENS)
    return ids


def _scheme(text: str) -> str:
    head, sep, _ = text.partition(":")
    return head.lower() if sep and len(head) > 1 and head.isalpha() else ""  # "C:\\x" is a path


def _media_type(data: bytes) -> str:
    for magic, media in ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"GIF8", "image/gif"), (b"RIFF", "image/webp")):
        if data.startswith(magic):
            return media
    return "application/octet-stream"
