"""batchllm: offline batch inference for multi-LLM pipelines.

`batchllm.run(...)` and `batchllm.plan(...)` are the Python API (`batchllm.api`), imported
on first use so that `import batchllm` (and the command line) stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run", "plan", "RunOutput", "UserError", "RunIncomplete"]

_API = {"run", "plan", "RunOutput"}
_ERRORS = {"UserError", "RunIncomplete"}


def __getattr__(name: str) -> Any:
    if name in _API:
        from batchllm import api

        return getattr(api, name)
    if name in _ERRORS:
        from batchllm.core import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'batchllm' has no attribute {name!r}")
