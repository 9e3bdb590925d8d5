"""LoRA adapters on the real engine and the embedded model (slow: marked `engine`): a node on an
adapter made here (seeded random weights, testkit/lora_adapters.py) gives the tokens vLLM's own
`LLM.chat(..., lora_request=...)` gives with the same adapter at temperature 0, and other
tokens than the base's; the base's node and two adapters' run in one engine. On CPUs both run
batchllm's LoRA ops (engines/cpu_lora_ops.py): their sums differ from vLLM's own ops' in the last
bits (a matrix product a call, not one a token), which flips a greedy token at a near-tie; the
ops are held to vLLM's within rounding in tests/test_cpu_lora_ops.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchllm.engines.devices import engine_dtype, parse_devices
from batchllm.models.embedded import SMOLLM2_135M
from batchllm.runtime.launch import run_dag_file
from testkit.lora_adapters import make_lora_adapter
from tests.killed_run import committed, kill_after_commits

pytestmark = pytest.mark.engine
REPO = Path(__file__).resolve().parent.parent
MODEL_HOME = REPO / ".batchllm-home"  # the prepared models, shared with the other real-engine tests
ROWS = 4
MAX_TOKENS = 12

VLLM_LORA_CHAT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from batchllm.engines.cpu_lora_ops import use_stacked_cpu_lora_ops
use_stacked_cpu_lora_ops()  # the LoRA ops batchllm's engines run on CPUs (their sums against vLLM's: test_cpu_lora_ops.py)
questions, adapter = json.load(sys.stdin)
llm = LLM(model=sys.argv[1], enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=1, enforce_eager=True, dtype=sys.argv[2],
          seed=0)
outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0),
                   lora_request=LoRARequest("adapter", 1, adapter))
print("TEXTS " + json.dumps([output.outputs[0].text for output in outputs]))
"""

DAG = """
inputs:
  questions: {{path: questions.parquet, id_column: id}}
nodes:
  base: {{model: smollm2-135m, prompt: "{{{{ question }}}}", sampling: {{max_tokens: {tokens}}}}}
  tuned: {{model: smollm2-135m, adapter: adapters/a, prompt: "{{{{ question }}}}", sampling: {{max_tokens: {tokens}}}}}
  other: {{model: smollm2-135m, adapter: adapters/b, prompt: "{{{{ question }}}}", sampling: {{max_tokens: {tokens}}}}}
engine:
  max_num_seqs: 1   # one request at a time, as the reference runs them: a batch's shape moves float32 sums, and a tie flips a token
"""


def test_an_adapters_node_gives_vllms_own_lora_tokens_and_not_the_bases(tmp_path, monkeypatch, shared_engines):
    monkeypatch.setenv("BATCHLLM_HOME", str(MODEL_HOME))
    model_dir = SMOLLM2_135M.prepare(MODEL_HOME)
    base_config = json.loads((model_dir / "config.json").read_text())
    adapter = make_lora_adapter(tmp_path / "adapters" / "a", base_config, seed=1)
    make_lora_adapter(tmp_path / "adapters" / "b", base_config, seed=2, rank=16)
    questions = pq.read_table(REPO / "examples" / "questions.parquet").slice(0, ROWS)
    pq.write_table(questions, tmp_path / "questions.parquet")
    dag = tmp_path / "dag.yaml"
    dag.write_text(DAG.format(tokens=MAX_TOKENS))
    started = []
    factory = lambda config: started.append(config) or shared_engines(config)  # noqa: E731
    result, _ = run_dag_file(dag, tmp_path / "out", parse_devices("cpu:2"), console=Console(quiet=True), engine_factory=factory)
    assert result.nodes_failed == {}
    # one engine a replica, holding the base and both adapters (the plan's replicas depend on what this home's
    # profile learnt: the shared model home's, which other tests' runs teach)
    assert {(c.max_loras, c.max_lora_rank) for c in started} == {(2, 16)}
    assert len({c.sharing_key() for c in started}) == len({c.replica for c in started})
    texts = {node: pq.read_table(tmp_path / "out" / "nodes" / f"{node}.parquet").column("text").to_pylist()
             for node in ("base", "tuned", "other")}
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", VLLM_LORA_CHAT, str(model_dir), engine_dtype("cpu") or "auto", str(MAX_TOKENS)],
                          input=json.dumps([questions.column("question").to_pylist(), str(adapter)]), env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("TEXTS ")).removeprefix("TEXTS "))
    assert texts["tuned"] == theirs
    assert sum(a != b for a, b in zip(texts["tuned"], texts["base"])) >= ROWS - 1  # the adapter changes the answers
    assert texts["other"] != texts["tuned"]


# routed over the base and two adapters (a pilot of 64 rows each first): a kill after 6 commits lands with work
# left (600 rows took 33 s more of LoRA steps to resume on an AVX-512 host, 1.5 s a step of 2,000 prompt tokens)
KILL_ROWS = 240
ROUTER_DAG = """
inputs:
  questions: {path: questions.parquet, id_column: id}
nodes:
  base: {model: smollm2-135m, where: "route = 0", prompt: "{{ question }}", sampling: {max_tokens: 4}}
  tuned: {model: smollm2-135m, adapter: adapters/a, where: "route = 1", prompt: "{{ question }}", sampling: {max_tokens: 4}}
  other: {model: smollm2-135m, adapter: adapters/b, where: "route = 2", prompt: "{{ question }}", sampling: {max_tokens: 4}}
"""


def test_a_killed_run_over_adapters_resumes_with_every_node_and_row_once_in_one_engine_group(tmp_path, monkeypatch,
                                                                                            shared_engines):
    import pyarrow as pa

    from batchllm.io.node_journal import read_records

    monkeypatch.setenv("BATCHLLM_HOME", str(MODEL_HOME))
    base_config = json.loads((SMOLLM2_135M.prepare(MODEL_HOME) / "config.json").read_text())
    make_lora_adapter(tmp_path / "adapters" / "a", base_config, seed=1)
    make_lora_adapter(tmp_path / "adapters" / "b", base_config, seed=2)
    texts = [p[:200] for p in pq.read_table(REPO / "profiles" / "prompts" / "first_turns.parquet").column("prompt").to_pylist()]
    pq.write_table(pa.table({"id": [f"q{k}" for k in range(KILL_ROWS)], "question": texts[:KILL_ROWS],
                             "route": [k % 3 for k in range(KILL_ROWS)]}), tmp_path / "questions.parquet")
    dag = tmp_path / "dag.yaml"
    dag.write_text(ROUTER_DAG)
    out, nodes = tmp_path / "out", ("base", "tuned", "other")
    journals = [out / ".batchllm" / "journal" / node for node in nodes]
    kill_after_commits(dag, out, nodes, 6)
    assert 6 <= committed(out, nodes) < KILL_ROWS, "the kill must land with work left"
    before = {j.name: dict(zip(t.column("row").to_pylist(), t.column("text").to_pylist()))
              for j in journals if j.exists() for t in [read_records(j)]}
    # resumed in this process on the session's engines: what resumes is the killed run's journal on disk (the CLI's
    # own resume after kill -9 is test_real_engine.py's; its process and engine start cost 8-10 s of the suite)
    resumed, _ = run_dag_file(dag, out, parse_devices("cpu:2"), console=Console(quiet=True), engine_factory=shared_engines)
    assert resumed.nodes_failed == {}
    for route, node in enumerate(("base", "tuned", "other")):
        table = pq.read_table(out / "nodes" / f"{node}.parquet")
        assert sorted(table.column("row_id").to_pylist()) == sorted(f"q{k}" for k in range(route, KILL_ROWS, 3)), node  # each once
    after = {j.name: dict(zip(t.column("row").to_pylist(), t.column("text").to_pylist())) for j in journals for t in [read_records(j)]}
    assert committed(out, nodes) == KILL_ROWS
    assert all(after[node][row] == text for node, rows in before.items() for row, text in rows.items())  # kept, not redone
    assert 1 <= resumed.model_loads <= 2  # one engine a replica (2 cores), not one a node


def test_a_batch_file_naming_two_adapters_validates_against_vllms_response_models(tmp_path, monkeypatch, shared_engines):
    from vllm.entrypoints.launchers.run_batch import BatchRequestOutput
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    from batchllm.openai_batch.model_map import model_map
    from batchllm.openai_batch.run import run_batch

    monkeypatch.setenv("BATCHLLM_HOME", str(MODEL_HOME))
    base_config = json.loads((SMOLLM2_135M.prepare(MODEL_HOME) / "config.json").read_text())
    make_lora_adapter(tmp_path / "adapters" / "a", base_config, seed=1)
    make_lora_adapter(tmp_path / "adapters" / "b", base_config, seed=2)
    monkeypatch.chdir(tmp_path)  # the adapters' folders are relative to where the command runs
    models = model_map(["base=smollm2-135m", "tuned-a=smollm2-135m:adapters/a", "tuned-b=smollm2-135m:adapters/b"], None, MODEL_HOME)
    questions = pq.read_table(REPO / "examples" / "questions.parquet").column("question").to_pylist()[:ROWS]
    lines = [{"custom_id": f"{name}-{k}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": name, "messages": [{"role": "user", "content": q}], "max_tokens": MAX_TOKENS, "temperature": 0}}
             for name in ("base", "tuned-a", "tuned-b") for k, q in enumerate(questions)]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    started = []
    factory = lambda config: started.append(config) or shared_engines(config)  # noqa: E731
    run_batch(tmp_path / "requests.jsonl", tmp_path / "results.jsonl", models, run_dir=tmp_path / "run", devices="cpu:2",
              engine_factory=factory, console=Console(quiet=True))
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(line["custom_id"] for line in lines)  # each once
    for result in results:
        BatchRequestOutput.model_validate(result)
        ChatCompletionResponse.model_validate(result["response"]["body"])
    text = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in results}
    # each adapter's answers, not the base's; and the base's not an adapter's (vLLM's CPU ops gave a base request batched
    # beside adapter ones the adapter in the last slot: engines/cpu_lora_ops.py)
    for adapter in ("tuned-a", "tuned-b"):
        assert sum(text[f"{adapter}-{k}"] != text[f"base-{k}"] for k in range(ROWS)) >= ROWS - 1, (adapter, text)
    assert all(r["response"]["body"]["model"] == r["custom_id"].rsplit("-", 1)[0] for r in results)  # the line's own model name
    assert {c.max_loras for c in started} == {2}  # every engine holds both adapters beside the base
    assert len({c.replica for c in started}) == len(started) <= 2  # one engine a replica (2 cores), not one a model name
