"""LoRA adapters (`adapter:` on a node, its base as `model:`) on a scripted engine: the base's
nodes and its adapters' share one engine with the LoRA settings the DAG implies, each request
names its adapter, the adapter's content is in the fingerprint, and bad adapters are exit 2
before anything runs. The real engine's tokens against vLLM's own LoRA requests are in
test_real_adapters.py."""

from __future__ import annotations

import json
import shutil

import pytest
from rich.console import Console

from batchllm.core.errors import UserError
from batchllm.dag.loader import load_dag
from batchllm.engines.devices import parse_devices
from batchllm.runtime.fingerprint import node_fingerprints
from batchllm.runtime.launch import run_dag_file
from testkit.lora_adapters import TINY_BASE, make_lora_adapter
from tests.conftest import QUESTIONS
from tests.fakes import FakeEngineFactory

ADAPTER_DAG = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      base:
        model: ./tiny-model
        prompt: "{{ question }}"
      tuned_a:
        model: ./tiny-model
        adapter: adapters/a
        prompt: "A: {{ question }}"
      tuned_b:
        model: ./tiny-model
        adapter: adapters/b
        prompt: "B: {{ question }}"
"""


@pytest.fixture
def adapter_workspace(workspace):
    (workspace.root / "tiny-model" / "config.json").write_text(json.dumps(TINY_BASE))
    for seed, name in enumerate("ab"):
        make_lora_adapter(workspace.root / "adapters" / name, TINY_BASE, seed=seed, rank=4 + 4 * seed)
    return workspace


def run(workspace, factory, dag_text=ADAPTER_DAG):
    return run_dag_file(workspace.dag(dag_text), workspace.out, parse_devices("cpu:2"), console=Console(quiet=True),
                        engine_factory=factory, prefix_order=False, schedule="sequential")


def test_the_base_and_its_adapters_run_in_one_engine_and_each_request_names_its_adapter(adapter_workspace):
    factory = FakeEngineFactory()
    result, _ = run(adapter_workspace, factory)
    assert result.nodes_failed == {}
    [engine] = factory.started
    assert (engine.config.max_loras, engine.config.max_lora_rank) == (2, 8)  # ranks 4 and 8: vLLM's smallest rank that holds both
    adapters = {r.prompt.split(": ")[0] if ": " in r.prompt else "base": r.adapter for r in factory.requests}
    root = adapter_workspace.root.resolve()
    assert adapters == {"base": None, "A": str(root / "adapters" / "a"), "B": str(root / "adapters" / "b")}
    assert len(factory.requests) == 3 * len(QUESTIONS)


def test_an_adapters_weights_are_in_its_fingerprint_and_its_folder_is_not(adapter_workspace):
    before = node_fingerprints(load_dag(adapter_workspace.dag(ADAPTER_DAG)))
    shutil.move(adapter_workspace.root / "adapters" / "a", adapter_workspace.root / "adapters" / "moved")
    moved = node_fingerprints(load_dag(adapter_workspace.dag(ADAPTER_DAG.replace("adapters/a", "adapters/moved"))))
    assert moved == before
    make_lora_adapter(adapter_workspace.root / "adapters" / "moved", TINY_BASE, seed=9, rank=4)
    retrained = node_fingerprints(load_dag(adapter_workspace.dag(ADAPTER_DAG.replace("adapters/a", "adapters/moved"))))
    assert {name for name in before if before[name] != retrained[name]} == {"tuned_a"}


def test_an_adapter_on_a_pooling_node_is_refused(adapter_workspace):
    dag = ADAPTER_DAG.replace("        adapter: adapters/b\n", "        adapter: adapters/b\n        task: embed\n")
    with pytest.raises(UserError) as refused:
        load_dag(adapter_workspace.dag(dag))
    assert str(refused.value) == "nodes.tuned_b.adapter: a LoRA adapter applies to a generation node, not to one with `task: embed`"


@pytest.mark.parametrize("spoil, message, hint", [
    (lambda root: shutil.rmtree(root / "adapters" / "b"), "adapter directory '{root}/adapters/b' does not exist",
     "give the folder PEFT's save_pretrained wrote"),
    (lambda root: (root / "adapters" / "b" / "adapter_model.safetensors").unlink(),
     "adapter directory '{root}/adapters/b' has no adapter_model.safetensors",
     "give the folder PEFT's save_pretrained wrote (adapter_config.json and adapter_model.safetensors)"),
    (lambda root: make_lora_adapter(root / "adapters" / "b", TINY_BASE, seed=1, rank=600),
     "adapter '{root}/adapters/b' has rank 600, over the 512 vLLM's engine takes", "use an adapter of rank <= 512"),
    (lambda root: make_lora_adapter(root / "adapters" / "b", {**TINY_BASE, "hidden_size": 32}, seed=1),
     "adapter '{root}/adapters/b' was made for another base than './tiny-model': its q_proj takes 32 inputs where the base's "
     "takes 16", "give the node the model the adapter was trained on, or an adapter trained on this one"),
    (lambda root: make_lora_adapter(root / "adapters" / "b", {**TINY_BASE, "num_hidden_layers": 5}, seed=1),
     "adapter '{root}/adapters/b' was made for another base than './tiny-model': it adapts layer 4, and the base has 2 layers",
     "give the node the model the adapter was trained on, or an adapter trained on this one"),
])
def test_a_bad_adapter_is_exit_2_at_the_checks_naming_the_node_and_the_fix(adapter_workspace, spoil, message, hint):
    root = adapter_workspace.root.resolve()
    spoil(root)
    with pytest.raises(UserError) as refused:
        run(adapter_workspace, FakeEngineFactory())
    assert str(refused.value) == message.format(root=root) and refused.value.hint == hint
    assert refused.value.where.endswith("nodes.tuned_b.adapter") and not adapter_workspace.out.exists()
