"""One server of a model, as checked before a run (`engines.endpoint.server_check`): where it is,
what it serves and how to talk to it. A plain record: the engine configs carry it."""

from __future__ import annotations

import os
from dataclasses import dataclass

from batchllm.core.latency_slo import LatencySlo


@dataclass(frozen=True)
class Endpoint:
    """One server of a model, as checked: where it is and how to talk to it."""

    url: str  # its OpenAI base URL, e.g. http://gpu-box:8000/v1
    served_model: str  # the model name the server knows
    api_key_env: str | None
    slo: LatencySlo | None
    max_in_flight: int
    server_kind: str  # "vllm", "sglang", or "openai" (another OpenAI-compatible server)
    priority: int | None  # what batch requests carry (None: the server does not schedule by priority)
    max_model_len: int | None  # as the server reports it (None: it does not say)

    def api_key(self) -> str:
        return os.environ.get(self.api_key_env, "") if self.api_key_env else "none"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key()}"}
