"""Names of places: a URI that a pyarrow filesystem opens, as opposed to a local path."""

from __future__ import annotations

import re

URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_uri(text: str) -> bool:
    return bool(URI.match(text))
