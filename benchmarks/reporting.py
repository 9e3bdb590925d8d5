"""What every benchmark ends with: its report printed, and kept in a file when asked, under a
line that names the host it ran on (its CPU's kernel flags and the engines' dtype: the figures
of an AVX2-only host and an AVX-512 one are not comparable)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchllm.engines.hardware import this_machine  # noqa: E402


def host_line() -> str:
    """`AMD EPYC (avx2; engines float32)`: this machine's CPU, the flags that pick vLLM's kernels."""
    identity = this_machine("cpu")
    flags = ",".join(identity.cpu_flags or ()) or "neither avx2 nor avx512"
    return f"{identity.name} ({flags}; engines {identity.dtype or 'bfloat16'})"


def publish(lines: list[str], out: Path | None) -> None:
    """Print the report; also write it to `out` (its folder made) when given."""
    report = "\n".join(lines)
    print(report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report + "\n")
