"""The request language of a DAG node: chats as turns or from a conversation column, every
sampling parameter checked in one place and handed to the engine, and logprobs kept per
output token (the scripted fake engine stands in for vLLM; the real one is in
test_real_engine.py and test_run_batch_vs_vllm.py)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console
from typer.testing import CliRunner

from batchllm.cli import app
from batchllm.core.sampling import SamplingSpec
from batchllm.engines.devices import DeviceSet
from batchllm.runtime.launch import run_dag_file
from tests.fakes import FakeEngineFactory

CPU2 = DeviceSet("cpu", (0, 1))
runner = CliRunner()

FEW_SHOT = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      answer:
        model: ./tiny-model
        messages:
          - {role: system, content: "Answer in one word."}
          - {role: user, content: "Capital of France?"}
          - {role: assistant, content: "Paris"}
          - {role: user, content: "{{ question }}"}
        sampling: {max_tokens: 8, stop: ["\\n", "###"], repetition_penalty: 1.3, top_k: 20, min_p: 0.05, presence_penalty: 0.5,
                   frequency_penalty: -0.5, logit_bias: {"42": -100}, ignore_eos: true, min_tokens: 2, logprobs: true,
                   top_logprobs: 2}
    outputs:
      answers:
        columns: {question: question, answer: answer, logprob: answer.logprob, tokens: answer.logprobs}
"""


def run(workspace, dag_text: str, factory=None):
    factory = factory or FakeEngineFactory()
    run_dag_file(workspace.dag(dag_text), workspace.out, CPU2, console=Console(quiet=True), engine_factory=factory,
                 prefix_order=False, schedule="sequential")
    return factory


def test_a_few_shot_node_sends_its_turns_and_every_sampling_parameter(workspace):
    factory = run(workspace, FEW_SHOT)
    first = next(r for r in factory.requests if "prime" in r.messages[-1][1])
    assert first.messages == (("system", "Answer in one word."), ("user", "Capital of France?"), ("assistant", "Paris"),
                              ("user", "What is a prime number?"))
    assert first.prompt == "" and first.system is None
    assert first.sampling == SamplingSpec(max_tokens=8, stop=("\n", "###"), repetition_penalty=1.3, top_k=20, min_p=0.05,
                                          presence_penalty=0.5, frequency_penalty=-0.5, logit_bias=((42, -100.0),), ignore_eos=True,
                                          min_tokens=2, logprobs=True, top_logprobs=2)


def test_logprobs_are_kept_per_output_token_and_summed_in_the_logprob_column(workspace):
    run(workspace, FEW_SHOT)
    node = pq.read_table(workspace.out / "nodes" / "answer.parquet").to_pylist()
    for row in node:
        assert len(row["logprobs"]) == len(row["text"]) == row["num_output_tokens"]  # the fake engine: a token per character
        assert [t["token"] for t in row["logprobs"]] == list(row["text"])
        assert all(len(t["top_logprobs"]) == 2 for t in row["logprobs"])
    answers = pq.read_table(workspace.out / "answers.parquet").to_pylist()
    for row in answers:
        assert row["logprob"] == pytest.approx(sum(t["logprob"] for t in row["tokens"])) == pytest.approx(-0.5 * len(row["answer"]))


def test_a_conversation_column_continues_where_it_stops(workspace):
    conversations = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                      {"role": "user", "content": "Tell me a joke."}],
                     [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "2+2?"}]]
    pq.write_table(pa.table({"id": ["a", "b"], "chat": conversations}), workspace.root / "chats.parquet")
    dag = """
        inputs:
          chats: {path: chats.parquet, id_column: id}
        nodes:
          reply:
            model: ./tiny-model
            messages: "{{ chat }}"
    """
    factory = run(workspace, dag)
    assert sorted(r.messages for r in factory.requests) == [
        (("system", "Be terse."), ("user", "2+2?")),
        (("user", "Hi"), ("assistant", "Hello!"), ("user", "Tell me a joke."))]
    texts = dict(zip(*pq.read_table(workspace.out / "nodes" / "reply.parquet", columns=["row_id", "text"]).to_pydict().values()))
    assert texts["b"] == "<system: Be terse. | user: 2+2?>"


@pytest.mark.parametrize("node_body, message", [
    ('prompt: "{{ question }}"\n        sampling: {temperature: 3}', "nodes.a.sampling.temperature must be a number in [0, 2], got 3"),
    ('prompt: "{{ question }}"\n        sampling: {top_logprobs: 3}', "nodes.a.sampling.top_logprobs = 3 needs logprobs: true"),
    ('prompt: "{{ question }}"\n        sampling: {stop: ""}', "nodes.a.sampling.stop must be a non-empty string or a list of them"),
    ('prompt: "{{ question }}"\n        sampling: {top_k: -2}', "nodes.a.sampling.top_k must be an integer >= 1, or 0 or -1"),
    ('prompt: "{{ question }}"\n        sampling: {logprobs: true, n: 2}', "nodes.a.sampling.logprobs are kept for one completion"),
    ('prompt: "{{ question }}"\n        sampling: {repetition_penalty: 0}', "nodes.a.sampling.repetition_penalty must be a number in (0, 2]"),
    ('prompt: "{{ question }}"\n        sampling: {min_tokens: 9, max_tokens: 8}', "nodes.a.sampling.min_tokens = 9 is more than max_tokens = 8"),
    ('prompt: "{{ question }}"\n        sampling: {stop_words: [x]}', "unknown key 'stop_words' in nodes.a.sampling"),
    ('prompt: "{{ question }}"\n        messages: [{role: user, content: hi}]', "nodes.a gives both `messages:` and `prompt:`"),
    ('messages: [{role: robot, content: hi}]', "nodes.a.messages[0].role is 'robot'; roles are system, user, assistant"),
    ('messages: "question"', 'nodes.a.messages must be a list of {role, content} or one expression such as "{{ conversation }}"'),
    ('messages: "{{ question }}"', "the conversation must be a non-empty list of {role, content}, got 'What is a prime number?'"),
])
def test_a_bad_chat_or_sampling_value_exits_2_naming_its_key_path(workspace, node_body, message):
    dag = workspace.dag(f"""
    inputs:
      questions: {{path: questions.parquet, id_column: id}}
    nodes:
      a:
        model: ./tiny-model
        {node_body}
    """)
    result = runner.invoke(app, ["run", str(dag), "--out", str(workspace.out)])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not workspace.out.exists()


def test_an_output_column_of_logprobs_needs_the_node_to_keep_them(workspace):
    dag = workspace.dag("""
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      a: {model: ./tiny-model, prompt: "{{ question }}"}
    outputs:
      o: {columns: {score: a.logprob}}
    """)
    result = runner.invoke(app, ["validate", str(dag)])
    assert result.exit_code == 2
    assert ("outputs.o.columns.score: 'a.logprob' names unknown field 'logprob'. Fix: set `sampling: {logprobs: true}` on 'a' to "
            "keep them.") in " ".join(result.output.split())


def test_a_batch_file_runs_conversations_penalties_and_logprobs(tmp_path):
    from batchllm.openai_batch.run import run_batch
    from tests.conftest import make_model_dir

    make_model_dir(tmp_path / "model")
    lines = [
        {"custom_id": "few-shot", "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": "m", "max_tokens": 8, "messages": [
                {"role": "system", "content": "One word."}, {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris"}, {"role": "user", "content": "Capital of Italy?"}]}},
        {"custom_id": "scored", "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": "m", "messages": [{"role": "user", "content": "Yes or no?"}], "logprobs": True, "top_logprobs": 3,
            "stop": ["."], "presence_penalty": 0.2, "repetition_penalty": 1.1, "top_k": 5, "min_p": 0.1}},
    ]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    factory = FakeEngineFactory()
    run_batch(requests, tmp_path / "results.jsonl", {"m": str(tmp_path / "model")}, run_dir=tmp_path / "run", devices="cpu:2",
              engine_factory=factory, prefix_order=False, schedule="sequential", console=Console(quiet=True))
    sent = {r.messages[-1][1] if r.messages else r.prompt: r for r in factory.requests}
    assert sent["Capital of Italy?"].messages == (("system", "One word."), ("user", "Capital of France?"), ("assistant", "Paris"),
                                                  ("user", "Capital of Italy?"))
    assert sent["Yes or no?"].sampling == SamplingSpec(max_tokens=256, temperature=1.0, stop=(".",), presence_penalty=0.2,
                                                       repetition_penalty=1.1, top_k=5, min_p=0.1, logprobs=True, top_logprobs=3)
    out = {line["custom_id"]: line for line in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    few, scored = out["few-shot"]["response"]["body"]["choices"][0], out["scored"]["response"]["body"]["choices"][0]
    assert few["message"]["content"] == "<system: One word. | user: Capital of France? | assistant: Paris | user: Capital of Italy?>"
    assert few["logprobs"] is None
    content = scored["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == scored["message"]["content"] == "<Yes or no?>"
    assert content[0] == {"token": "<", "logprob": -0.5, "bytes": [60], "top_logprobs": [
        {"token": "<", "logprob": -0.5, "bytes": [60]}, {"token": "alt1", "logprob": -1.5, "bytes": [97, 108, 116, 49]},
        {"token": "alt2", "logprob": -2.5, "bytes": [97, 108, 116, 50]}]}
