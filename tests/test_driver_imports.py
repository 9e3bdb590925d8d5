"""The driver stays light: what a run's driver process imports brings in no vLLM, torch or
transformers (the engine processes import them; the settings check runs in a child)."""

from __future__ import annotations

import json
import subprocess
import sys

DRIVER_MODULES = ("batchllm.cli", "batchllm.runtime.launch", "batchllm.runtime.executor", "batchllm.runtime.prepare",
                  "batchllm.engines.process_engine", "batchllm.planner.plan_file", "batchllm.serve.worker")
HEAVY = ("vllm", "torch", "transformers")


def test_the_driver_imports_no_vllm_torch_or_transformers():
    code = (f"import importlib, json, sys\nfor name in {DRIVER_MODULES!r}: importlib.import_module(name)\n"
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
