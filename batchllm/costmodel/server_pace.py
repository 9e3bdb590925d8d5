"""How fast a model's servers (`endpoints:`) answered a batch, measured by a run and kept for
the plans after it:

    $BATCHLLM_HOME/servers/<model>-<hash of its URLs>.json

one record per (model, set of servers): the last run's pace while its nodes answered, from
their first committed answer to their last (waits for upstream nodes before it are not the
servers' pace). An answer is one of a request's `n` samples; failed requests do not count.
The planner places no devices for nodes on servers; it estimates their time from this pace
and says where the pace came from. The pace is what the servers gave beside their online
traffic then: a busier day is slower.

No vLLM import: the cost model's layer. Every write replaces the file whole.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from batchllm.core.files import replacing

FOLDER = "servers"
MIN_ANSWERS = 20  # fewer answers than this say little of a pace
MIN_MEASURED_S = 5.0


@dataclass(frozen=True)
class ServerPace:
    model: str
    urls: tuple[str, ...]
    answers: int  # in the measured time (each of a request's `n` samples counts)
    output_tokens: int
    measured_s: float
    measured_on: str  # the date, YYYY-MM-DD
    source: str  # what ran, e.g. "a run of summaries"

    @property
    def answers_per_s(self) -> float:
        return self.answers / self.measured_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.measured_s

    def enough(self) -> bool:
        return self.answers >= MIN_ANSWERS and self.measured_s >= MIN_MEASURED_S and self.measured_s > 0

    def describe(self) -> str:
        return (f"{self.answers_per_s:,.2f} answers/s ({self.output_tokens_per_s:,.0f} output tok/s) "
                f"in {self.source} on {self.measured_on}")


@dataclass(frozen=True)
class ServerPaceStore:
    home: Path

    def path(self, model: str, urls: tuple[str, ...]) -> Path:
        servers = hashlib.sha256("\n".join(sorted(urls)).encode()).hexdigest()[:12]
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
        return Path(self.home) / FOLDER / f"{name}-{servers}.json"

    def save(self, pace: ServerPace) -> Path:
        path = self.path(pace.model, pace.urls)
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as new:
            new.path.write_text(json.dumps({**asdict(pace), "urls": list(pace.urls)}, indent=1) + "\n")
        return path

    def load(self, model: str, urls: tuple[str, ...]) -> ServerPace | None:
        """The last pace measured on these servers (None: none, unreadable, or too little measured)."""
        try:
            record = json.loads(self.path(model, urls).read_text())
            pace = ServerPace(**{**record, "urls": tuple(record["urls"])})
        except (OSError, ValueError, TypeError, KeyError):
            return None
        if pace.model != model or sorted(pace.urls) != sorted(urls) or not pace.enough():
            return None
        return pace
