"""`batchllm serve` without the command line: the service on uvicorn, until Ctrl-C or SIGTERM.

On the way out uvicorn stops taking requests and the worker interrupts the running batch,
which stays in_progress: started again on the same data folder, the server resumes it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import uvicorn

from batchllm.serve.app import create_app, open_service
from batchllm.serve.files import Limits
from batchllm.serve.runner import ChildRunner, RunSettings


def serve(data: Path, settings: RunSettings, *, host: str = "127.0.0.1", port: int = 8000, limits: Limits = Limits(),
          api_key: str | None = None, say: Callable[[str], None] = print) -> None:
    data = data.absolute()
    service = open_service(data, ChildRunner(settings), dict(settings.models), limits=limits, api_key=api_key)
    active = service.batches.active()
    where = f"http://{host}:{port}"
    say(f"batchllm serve: {where}/v1 (OpenAI's Files and Batches API), page {where}/; data in {data}"
        + (f"; {len(active)} batches to resume or run" if active else ""))
    say(f"models: {', '.join(sorted(settings.models)) or 'the embedded models by their own names'}"
        + ("; API key required" if api_key else "; no API key (--api-key-env to require one)"))
    config = uvicorn.Config(create_app(service), host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run()
