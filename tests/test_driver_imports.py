"""The driver stays light: what `batchllm run` imports before it knows it needs it (issue 68's
light driver). vLLM, torch and transformers load in the engine processes (and the tokenizer's
thread); the OpenAI client with a DAG's servers; sklearn and scipy.stats with a length model's
fit or its first prediction."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("vllm", "torch", "transformers", "openai", "sklearn", "scipy.stats")


def test_the_run_commands_modules_import_none_of_the_heavy_packages():
    code = ("import sys, batchllm.cli, batchllm.cli.run_commands, batchllm.runtime.launch, batchllm.openai_batch.run, "
            "batchllm.runtime.executor, batchllm.runtime.prepare, batchllm.engines.process_engine, batchllm.planner.plan_file; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == ""
