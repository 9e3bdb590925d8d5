"""What would fail at run time fails at validate (and at run, before anything is written):
models that are not on this machine or not complete, and engine settings vLLM refuses."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from batchllm.cli import app
from batchllm.core.errors import UserError
from batchllm.models.registry import missing_model_files, resolve_model
from tests.conftest import make_model_dir

runner = CliRunner()

DAG = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    %s
    nodes:
      answer:
        model: %s
        prompt: "{{ question }}"
"""


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty local Hugging Face cache (this machine has no network: nothing is fetched)."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    return cache


def cache_model(cache, hub_id: str, files: dict[str, str]):
    """A model in the cache's own layout: refs/main names a snapshot of links to blobs."""
    repo = cache / f"models--{hub_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


def refused(workspace, command: str, dag_text: str) -> str:
    dag = workspace.dag(dag_text)
    args = ["validate", str(dag)] if command == "validate" else ["run", str(dag), "--out", str(workspace.out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert not workspace.out.exists(), "nothing may be written"
    return " ".join(result.output.split())


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_hub_model_not_in_the_local_cache_is_refused_with_how_to_get_it(workspace, hub_cache, command):
    text = refused(workspace, command, DAG % ("", "Qwen/Qwen2.5-0.5B-Instruct"))
    assert (f"dag.yaml, line 5, nodes.answer.model: model 'Qwen/Qwen2.5-0.5B-Instruct' is not in the local Hugging Face cache "
            f"({hub_cache}), and batchllm does not download models (LocalEntryNotFoundError). Fix: download it where there is "
            f"network (`hf download Qwen/Qwen2.5-0.5B-Instruct`, into {hub_cache}") in text


def test_a_cached_hub_model_resolves_to_its_snapshot_and_an_incomplete_one_is_refused(tmp_path, hub_cache):
    snapshot = cache_model(hub_cache, "owner/complete", {"config.json": "{}", "model.safetensors": "", "tokenizer.json": "{}"})
    ref = resolve_model("owner/complete", dag_dir=tmp_path, home=tmp_path, where="nodes.a.model")
    assert (ref.kind, ref.location) == ("hub", str(snapshot))
    cache_model(hub_cache, "owner/partial", {"config.json": "{}", "model.safetensors": ""})  # the download stopped early
    with pytest.raises(UserError, match=r"the cached copy of model 'owner/partial' \(.*\) is incomplete: it has no tokenizer"):
        resolve_model("owner/partial", dag_dir=tmp_path, home=tmp_path, where="nodes.a.model")


def test_a_model_directory_must_hold_config_weights_every_shard_and_a_tokenizer(tmp_path):
    model = make_model_dir(tmp_path / "m")
    assert missing_model_files(model) is None
    (model / "tokenizer.json").unlink()
    assert missing_model_files(model) == "tokenizer (no tokenizer.json, tokenizer.model or tokenizer_config.json)"
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").unlink()
    assert missing_model_files(model) == "weights (no *.safetensors, *.bin or *.gguf file)"
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    (model / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert missing_model_files(model) == ("weight shard model-00002-of-00002.safetensors (1 of the 2 shards "
                                          "model.safetensors.index.json names are missing)")


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_model_directory_without_weights_is_refused(workspace, command):
    (workspace.root / "tiny-model" / "model.safetensors").unlink()
    text = refused(workspace, command, DAG % ("", "./tiny-model"))
    assert "nodes.answer.model: model directory" in text and "has no weights (no *.safetensors, *.bin or *.gguf file)" in text
    assert "Fix: point `model:` at a complete Hugging Face model directory (config.json, weights, tokenizer)" in text


# vLLM's own configuration check (a child process: a few seconds each; the verdict is kept in the home's checks/)
@pytest.mark.engine  # vLLM's configuration classes
@pytest.mark.starts_no_engine
@pytest.mark.parametrize("command", ["validate", "run"])
def test_max_model_len_beyond_the_models_positions_is_refused_by_vllms_own_check(workspace, command):
    text = refused(workspace, command, DAG % ("engine: {max_model_len: 100000}", "smollm2-135m"))
    assert ("dag.yaml, line 3, engine.max_model_len: vLLM refuses model 'smollm2-135m' with these engine settings: "
            "ValidationError: User-specified max_model_len (100000) is greater than the derived max_model_len "
            "(max_position_embeddings=8192.0") in text
    assert "Fix: lower engine.max_model_len, or leave it out (the model's own)." in text


@pytest.mark.engine  # vLLM's configuration classes
@pytest.mark.starts_no_engine
def test_a_kv_cache_smaller_than_one_sequence_is_refused_and_the_verdict_is_kept(workspace, isolated_home):
    """The bytes a token come from the model's config and the dtype this host's engine runs (float32
    on a CPU without AVX-512, the model's own bfloat16 elsewhere), and the message names that dtype."""
    from batchllm.engines.devices import engine_dtype, engine_dtype_reason
    from batchllm.models.embedded import SMOLLM2_135M

    config = json.loads((SMOLLM2_135M.config_dir() / "config.json").read_text())
    dtype = engine_dtype("cpu") or config["dtype"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * {"float32": 4, "bfloat16": 2}[dtype]
    why = "the model's own dtype" if engine_dtype("cpu") is None else engine_dtype_reason("cpu")
    text = refused(workspace, "validate", DAG % ("engine: {kv_cache_memory_bytes: 10000000}", "smollm2-135m"))
    assert ("engine.kv_cache_memory_bytes: vLLM refuses model 'smollm2-135m' with these engine settings: a KV cache of "
            f"10,000,000 bytes holds {10_000_000 // per_token:,} tokens, less than one sequence of max_model_len 8,192 tokens "
            f"({8192 * per_token:,} bytes at {per_token:,} bytes a token in {dtype}: {why}). "
            "Fix: lower engine.max_model_len, or raise engine.kv_cache_memory_bytes.") in text
    kept = list((isolated_home / "checks").glob("engine-settings-*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["setting"] == "kv_cache_memory_bytes"
    shutil.rmtree(isolated_home / "checks")  # a good setting passes
    good = runner.invoke(app, ["validate", str(workspace.dag(DAG % ("engine: {kv_cache_memory_bytes: 400000000}", "smollm2-135m")))])
    assert good.exit_code == 0, good.output
