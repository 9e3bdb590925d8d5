"""What the online traffic of a shared server must keep while a batch runs beside it."""

from __future__ import annotations

from dataclasses import dataclass

BASELINE_MARGIN = 1.25  # without an SLO: online latency within 1.25x of what the server showed before the batch


@dataclass(frozen=True)
class LatencySlo:
    """Bounds on the server's online latency, p99 over a sliding window, in seconds (None: no bound)."""

    ttft_p99_s: float | None = None  # time to first token
    itl_p99_s: float | None = None  # inter-token latency

    def __post_init__(self) -> None:
        for name in ("ttft_p99_s", "itl_p99_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
