"""`batchllm run-batch`: OpenAI batch request lines in, OpenAI batch output lines out.

Orchestration is tested with the scripted fake engine (tests/fakes.py); the real engine
runs a batch file, is killed and resumed in tests/test_real_engine.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from batchllm.cli import app
from batchllm.core.errors import UserError
from batchllm.core.requests import EngineRequest
from batchllm.engines.devices import DeviceSet
from batchllm.openai_batch import BatchFile, model_map, run_batch, run_batches
from batchllm.openai_batch.request_lines import parse_line
from tests.conftest import make_model_dir
from tests.fakes import DriverCrash, FakeEngine, FakeEngineFactory, fake_score, fake_vector

CPU2 = DeviceSet("cpu", (0, 1))


def chat(custom_id: str, model: str, text: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": text}], **body}}


def completion(custom_id: str, model: str, prompt: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"model": model, "prompt": prompt, **body}}


def embedding(custom_id: str, model: str, text, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": {"model": model, "input": text, **body}}


LINES = [
    json.dumps(chat("c1", "gpt-a", "What is a prime number?", max_tokens=8)),
    json.dumps(chat("c2", "gpt-a", "Why is the sky blue?", max_tokens=8)),
    json.dumps(completion("p1", "gpt-b", "Once upon a time", max_tokens=8)),
    "",  # blank lines are skipped, as OpenAI does
    json.dumps(chat("c3", "gpt-a", "What does SQL stand for?", max_tokens=8)),
    "{not json",
    json.dumps(chat("c1", "gpt-a", "a second line with the same custom_id", max_tokens=8)),
    json.dumps(chat("u1", "gpt-unmapped", "hello")),
    json.dumps(completion("p2", "gpt-b", "In a galaxy far away", max_tokens=8)),
]


@pytest.fixture
def batch(tmp_path) -> dict:
    """A request file, two model directories for the fake engine, and their mapping."""
    for name in ("model-a", "model-b"):
        make_model_dir(tmp_path / name)
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(LINES) + "\n")
    models = {"gpt-a": str(tmp_path / "model-a"), "gpt-b": str(tmp_path / "model-b")}
    return {"requests": requests, "models": models, "root": tmp_path}


def run(batch: dict, factory, fresh: bool = False):
    return run_batch(batch["requests"], batch["root"] / "results.jsonl", batch["models"], run_dir=batch["root"] / "run",
                     devices=CPU2, fresh=fresh, prefix_order=False, schedule="sequential", engine_factory=factory,
                     console=Console(quiet=True))


def output_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def without_created(lines: list[dict]) -> list[dict]:
    for line in lines:
        if line["response"]:
            line["response"]["body"].pop("created")
    return lines


# -- one line ------------------------------------------------------------------------------
def test_a_chat_line_with_a_system_message_and_text_parts():
    line = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
        "max_completion_tokens": 12, "temperature": 0, "seed": 3, "n": 2, "stream": False, "user": "u"}})
    record = parse_line(line, 7, {"m": "smollm2-135m"})
    assert (record.custom_id, record.kind, record.system, record.prompt) == ("x", "chat", "Be brief.", "Hi there")
    sampling = record.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.seed, sampling.n) == (12, 0.0, 1.0, 3, 2)
    assert record.error_code is None


def test_a_completion_line_takes_openais_defaults():
    record = parse_line(json.dumps(completion("x", "m", "Once")), 1, {"m": "smollm2-135m"})
    assert (record.kind, record.prompt, record.sampling.max_tokens, record.sampling.temperature, record.sampling.n) == (
        "completion", "Once", 16, 1.0, 1)


@pytest.mark.parametrize("line, code, message", [
    ("[1, 2]", "invalid_request", "line 3: a request line must be a JSON object, got list"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), "invalid_request",
     "line 3: custom_id must be a non-empty string"),
    (json.dumps(embedding("x", "m", [])), "unsupported_body", "line 3: body.input must be a string or a non-empty list of strings, got []"),
    (json.dumps(embedding("x", "m", [[101, 2023]])), "unsupported_body",
     "line 3: body.input must be a string or a non-empty list of strings, got [[101, 2023]]"),
    (json.dumps({**embedding("x\u001f0", "m", "a")}), "invalid_request", "line 3: custom_id must not hold the control character U+001F"),
    (json.dumps({"custom_id": "x", "url": "/score", "body": {"model": "m", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}}),
     "invalid_request", "line 3: body.text_1 has 2 texts and body.text_2 3: score 1:1, 1:N or N:N texts"),
    (json.dumps({"custom_id": "x", "url": "/score", "body": {"model": "m", "text_1": "a", "text_2": "b", "top_n": 3}}),
     "unsupported_parameter", "line 3: body.top_n = 3 is not supported on /score lines (batchllm takes model and its two sides: "
                              "text_1 and text_2)"),
    (json.dumps({"custom_id": "x", "url": "/rerank", "body": {"model": "m", "query": ["a"], "documents": ["b"]}}),
     "unsupported_body", 'line 3: body.query must be a string, got ["a"]'),
    (json.dumps({"custom_id": "x", "url": "/v1/rerank", "body": {"model": "m", "query": "a", "documents": ["b"], "top_n": -1}}),
     "invalid_request", "line 3: body.top_n must be an integer >= 0 (0: every document), got -1"),
    (json.dumps(embedding("x", "m", "a", encoding_format="base64")), "unsupported_parameter",
     "line 3: body.encoding_format = 'base64' is not supported on /v1/embeddings lines (batchllm takes model and input, "
     "and encoding_format float)"),
    (json.dumps({**completion("x", "m", "p"), "url": "/v1/moderations"}), "unsupported_url",
     "line 3: url '/v1/moderations' is not supported; use /v1/chat/completions, /v1/completions, /v1/embeddings, /score or /rerank"),
    (json.dumps(completion("x", "nope", "p")), "model_not_found",
     "line 3: model 'nope' is not mapped to a local model; map it with --model nope=<local model>"),
    (json.dumps(completion("x", "m", "p", tools=[{"type": "function"}])), "unsupported_parameter",
     'line 3: body.tools = [{"type": "function"}] is not supported (batchllm takes max_tokens, temperature, top_p, seed, n, '
     "stop, presence_penalty, frequency_penalty, repetition_penalty, top_k, min_p, logit_bias, ignore_eos, min_tokens, "
     "logprobs, top_logprobs, max_completion_tokens)"),
    (json.dumps(completion("x", "m", "p", logprobs=3)), "unsupported_parameter",
     "line 3: body.logprobs is supported on /v1/chat/completions lines only"),
    (json.dumps(chat("x", "m", "q", logprobs=True, top_logprobs=21)), "invalid_request",
     "line 3: body.top_logprobs must be an integer in [0, 20], got 21"),
    (json.dumps(chat("x", "m", "q", top_logprobs=2)), "invalid_request",
     "line 3: body.top_logprobs = 2 needs logprobs: true"),
    (json.dumps(chat("x", "m", "q", presence_penalty=2.5)), "invalid_request",
     "line 3: body.presence_penalty must be a number in [-2, 2], got 2.5"),
    (json.dumps(chat("x", "m", "q", stop=["a", ""])), "invalid_request",
     "line 3: body.stop must be a non-empty string or a list of them, got ['a', '']"),
    (json.dumps(chat("x", "m", "q", max_completion_tokens=0)), "invalid_request",
     "line 3: body.max_completion_tokens must be a positive integer, got 0"),
    (json.dumps(completion("x", "m", "p", temperature=3)), "invalid_request",
     "line 3: body.temperature must be a number in [0, 2], got 3"),
    (json.dumps(completion("x", "m", ["a", "b"])), "unsupported_body", 'line 3: body.prompt must be one string, got ["a", "b"]'),
    (json.dumps({**chat("x", "m", "q"), "body": {"model": "m", "messages": [{"role": "user", "content": "a"},
                                                                              {"role": "tool", "content": "b"}]}}),
     "unsupported_body", "line 3: body.messages[1].role is 'tool'; batchllm runs system, developer, user, assistant messages"),
])
def test_a_bad_line_gets_its_own_error_that_names_the_line(line, code, message):
    record = parse_line(line, 3, {"m": "smollm2-135m"})
    assert (record.error_code, record.error_message) == (code, message)


# -- a whole file ----------------------------------------------------------------------------
def test_every_line_gets_one_output_line_in_order_and_bad_lines_their_own_error(batch):
    done = run(batch, FakeEngineFactory())
    lines = output_lines(done.output)
    assert [line["custom_id"] for line in lines] == ["c1", "c2", "p1", "c3", None, "c1", "u1", "p2"]
    assert [line["error"]["code"] if line["error"] else 200 for line in lines] == [
        200, 200, 200, 200, "invalid_json", "duplicate_custom_id", "model_not_found", 200]
    assert lines[5]["error"]["message"] == 'line 7: custom_id "c1" already appears on line 1'
    assert len({line["id"] for line in lines}) == len(lines)
    assert (done.counts.lines, done.counts.succeeded) == (8, 5)
    assert done.counts.failed == {"duplicate_custom_id": 1, "invalid_json": 1, "model_not_found": 1}
    assert [g.node for g in done.batch.groups] == ["gpt_a_chat", "gpt_b_completion"]


def test_output_bodies_are_shaped_as_the_openai_api_returns_them(batch):
    lines = output_lines(run(batch, FakeEngineFactory()).output)
    chat_line, completion_line = lines[0], lines[2]
    assert chat_line["response"]["status_code"] == 200 and chat_line["error"] is None
    body = chat_line["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "gpt-a" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant" and choice["finish_reason"] == "stop"
    assert "What is a prime number?" in choice["message"]["content"]  # the fake engine echoes the rendered prompt
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    body = completion_line["response"]["body"]
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "<Once upon a time>"


def test_n_completions_become_n_choices(batch):
    batch["requests"].write_text(json.dumps(completion("p1", "gpt-b", "Once", n=3)) + "\n")
    [line] = output_lines(run(batch, FakeEngineFactory()).output)
    assert [c["index"] for c in line["response"]["body"]["choices"]] == [0, 1, 2]


def test_a_crash_then_the_same_command_resumes_each_request_once(batch):
    uninterrupted = without_created(output_lines(run(batch, FakeEngineFactory()).output))
    (batch["root"] / "results.jsonl").unlink()
    with pytest.raises(DriverCrash):
        run(batch, FakeEngineFactory(crash_after_results=2), fresh=True)
    assert not (batch["root"] / "results.jsonl").exists()  # written only at the end
    resumed = FakeEngineFactory()
    done = run(batch, resumed)
    assert len(resumed.requests) == 5 - 2  # the two committed before the crash are not asked again
    assert without_created(output_lines(done.output)) == uninterrupted


def test_several_request_files_run_as_one_dag_each_with_its_own_results_and_a_resume_after_dropping_one(batch):
    """`serve`'s groups: the files' nodes carry their prefixes, the same custom_id in two files is two
    requests, and a run of some of the files on the same folder resumes what they committed."""
    root = batch["root"]
    second = root / "second.jsonl"
    second.write_text(json.dumps(chat("c1", "gpt-b", "Another file's first line", max_tokens=8)) + "\n")
    files = [BatchFile(batch["requests"], root / "first.results.jsonl", "b1_"), BatchFile(second, root / "second.results.jsonl", "b2_")]
    factory = FakeEngineFactory()
    runs = run_batches(files, batch["models"], run_dir=root / "run", devices=CPU2, prefix_order=False, schedule="sequential",
                       engine_factory=factory, console=Console(quiet=True))
    assert len(factory.requests) == 5 + 1
    assert sorted(p.name for p in (root / "run" / "nodes").iterdir()) == [
        "b1_gpt_a_chat.parquet", "b1_gpt_b_completion.parquet", "b2_gpt_b_chat.parquet"]
    first, other = (output_lines(run.output) for run in runs)
    assert [line["custom_id"] for line in first] == ["c1", "c2", "p1", "c3", None, "c1", "u1", "p2"]
    assert [(line["custom_id"], line["response"]["body"]["model"]) for line in other] == [("c1", "gpt-b")]
    assert "Another file's first line" in other[0]["response"]["body"]["choices"][0]["message"]["content"]
    again = FakeEngineFactory()
    [alone] = run_batches(files[1:], batch["models"], run_dir=root / "run", devices=CPU2, prefix_order=False, schedule="sequential",
                          engine_factory=again, console=Console(quiet=True))
    assert again.requests == [] and without_created(output_lines(alone.output)) == without_created(other)
    with pytest.raises(ValueError, match="prefixes must differ"):
        run_batches([files[0], BatchFile(second, root / "x.jsonl", "b1_")], batch["models"], run_dir=root / "run")


def test_a_missing_request_file_is_refused_and_leaves_no_run_folder(batch):
    batch["requests"].unlink()
    with pytest.raises(UserError, match="request file .* does not exist"):
        run(batch, FakeEngineFactory())
    assert not (batch["root"] / "run").exists() and not (batch["root"] / "results.jsonl").exists()


def test_a_model_mapping_from_options_and_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an option's relative directory starts at the current folder
    make_model_dir(tmp_path / "local-model")
    mapping = tmp_path / "models.yaml"
    mapping.write_text("gpt-4o: ./local-model\ngpt-4o-mini: smollm2-135m\n")
    mapped = model_map(["gpt-4o-mini=./local-model"], mapping, tmp_path / "home")
    local = str((tmp_path / "local-model").resolve())
    assert mapped == {"gpt-4o": local, "gpt-4o-mini": local}  # the option wins over the file


def test_cli_refuses_a_malformed_model_option_with_exit_2(batch):
    result = CliRunner().invoke(app, ["run-batch", "-i", str(batch["requests"]), "-o", str(batch["root"] / "r.jsonl"),
                                      "--model", "gpt-a"])
    assert result.exit_code == 2
    assert "--model 'gpt-a' is not NAME=LOCAL" in result.output
    assert not (batch["root"] / "r.jsonl").exists()


# -- structured output -------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"label": {"enum": ["code", "other"]}}, "required": ["label"]}


@pytest.mark.parametrize("response_format, schema", [
    ({"type": "json_schema", "json_schema": {"name": "route", "schema": SCHEMA, "strict": True}}, SCHEMA),
    ({"type": "json_object"}, {"type": "object"}),
    ({"type": "text"}, None),
])
def test_a_chats_response_format_becomes_the_engines_structured_output(response_format, schema):
    record = parse_line(json.dumps(chat("x", "m", "q", response_format=response_format)), 1, {"m": "smollm2-135m"})
    assert record.error_code is None
    assert (json.loads(record.json_schema) if record.json_schema else None) == schema


@pytest.mark.parametrize("response_format, message", [
    pytest.param({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
                 'line 1: body.response_format: the engine cannot use this JSON schema: Unsupported type "nonsense"',
                 marks=[pytest.mark.engine, pytest.mark.starts_no_engine]),  # vLLM's structured-output compiler
    ({"type": "yaml"}, 'line 1: body.response_format = {"type": "yaml"} is not one of {type: text}, {type: json_object}, '
                       "{type: json_schema, json_schema: {name, schema}}"),
])
def test_a_response_format_the_engine_cannot_honour_is_that_lines_error(response_format, message):
    record = parse_line(json.dumps(chat("x", "m", "q", response_format=response_format)), 1, {"m": "smollm2-135m"})
    assert (record.error_code, record.error_message) == ("invalid_request", message)


def test_lines_with_a_response_format_run_in_their_own_node_with_the_constraint(batch):
    structured = {"type": "json_schema", "json_schema": {"name": "route", "schema": SCHEMA}}
    batch["requests"].write_text("\n".join([json.dumps(chat("free", "gpt-a", "Hi", max_tokens=8)),
                                            json.dumps(chat("json", "gpt-a", "Hi", max_tokens=8, response_format=structured))]))
    factory = FakeEngineFactory(answer=lambda request: '{"label": "code"}' if request.output else "hello")
    done = run(batch, factory)
    assert [(g.node, g.json_schema is not None) for g in done.batch.groups] == [("gpt_a_chat", False), ("gpt_a_chat_2", True)]
    [constrained] = [r for r in factory.requests if r.output is not None]
    assert json.loads(constrained.output.json_schema) == SCHEMA
    contents = {line["custom_id"]: line["response"]["body"]["choices"][0]["message"]["content"] for line in output_lines(done.output)}
    assert contents == {"free": "hello", "json": '{"label": "code"}'}


def test_embedding_lines_run_in_an_embed_node_beside_chat_lines_and_give_vllms_response_shape(batch):
    bert = make_model_dir(batch["root"] / "bert-model")
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": FakeEngine.VECTOR_DIMENSIONS}))
    lines = [json.dumps(embedding("e1", "text-embed", "What is a prime number?")),
             json.dumps(chat("c1", "gpt-a", "What is a prime number?", max_tokens=8)),
             json.dumps(embedding("e2", "text-embed", ["Why is the sky blue?"], encoding_format="float")),
             json.dumps(embedding("e3", "text-embed", ["one", "two", "three"]))]
    batch["requests"].write_text("\n".join(lines) + "\n")
    factory = FakeEngineFactory()
    done = run({**batch, "models": {**batch["models"], "text-embed": str(bert)}}, factory)
    assert sorted(engine.config.task.value for engine in factory.started) == ["embed", "generate"]
    e1, c1, e2, e3 = output_lines(done.output)
    assert [line["custom_id"] for line in (e1, c1, e2, e3)] == ["e1", "c1", "e2", "e3"]
    assert c1["response"]["body"]["object"] == "chat.completion"
    vectors = [fake_vector(EngineRequest("", text, chat=False), FakeEngine.VECTOR_DIMENSIONS).tolist() for text in ("one", "two", "three")]
    assert e3["response"]["body"]["data"] == [{"index": k, "object": "embedding", "embedding": pytest.approx(vector)}
                                              for k, vector in enumerate(vectors)]
    assert e3["response"]["body"]["usage"]["prompt_tokens"] == len("onetwothree")
    body = e1["response"]["body"]
    assert body["object"] == "list" and body["model"] == "text-embed" and body["id"].startswith("embd-")
    expected = fake_vector(EngineRequest("", "What is a prime number?", chat=False), FakeEngine.VECTOR_DIMENSIONS)
    assert body["data"] == [{"index": 0, "object": "embedding", "embedding": pytest.approx(expected.tolist())}]
    assert body["usage"] == {"prompt_tokens": len("What is a prime number?"), "total_tokens": len("What is a prime number?"),
                             "completion_tokens": 0, "prompt_tokens_details": None}
    assert len(e2["response"]["body"]["data"][0]["embedding"]) == FakeEngine.VECTOR_DIMENSIONS



def test_score_lines_run_in_a_score_node_and_give_vllms_score_response_shape(batch):
    bert = make_model_dir(batch["root"] / "bert-model")
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": FakeEngine.VECTOR_DIMENSIONS}))
    score = lambda custom_id, url, **body: {"custom_id": custom_id, "method": "POST", "url": url,  # noqa: E731
                                           "body": {"model": "rank", **body}}
    lines = [score("s1", "/score", text_1="What is a prime number?", text_2="A number with two divisors."),
             score("s2", "/v1/score", queries=["Why is the sky blue?"], documents="Rayleigh scattering."),
             score("s3", "/score", text_1="q", text_2=["a", "b"]),
             score("s4", "/score", data_1=["q1", "q2"], data_2=["a", "b"]),
             score("r1", "/rerank", query="q", documents=["a", "b", "c"]),
             score("r2", "/v1/rerank", query="q", documents=["a", "b", "c"], top_n=2)]
    batch["requests"].write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    factory = FakeEngineFactory()
    done = run({**batch, "models": {**batch["models"], "rank": str(bert)}}, factory)
    [engine] = factory.started  # the score and the rerank lines share the model's one engine (two nodes)
    s1, s2, s3, s4, r1, r2 = output_lines(done.output)
    scored = lambda first, second: fake_score(EngineRequest("", first, chat=False, pair=second), FakeEngine.VECTOR_DIMENSIONS)  # noqa: E731
    pairs = [("What is a prime number?", "A number with two divisors."), ("Why is the sky blue?", "Rayleigh scattering.")]
    for line, (first, second) in zip((s1, s2), pairs):
        body = line["response"]["body"]
        assert body["object"] == "list" and body["model"] == "rank" and body["id"].startswith("score-")
        assert body["data"] == [{"index": 0, "object": "score", "score": scored(first, second)}]
        assert body["usage"] == {"prompt_tokens": len(first) + len(second), "total_tokens": len(first) + len(second),
                                 "completion_tokens": 0, "prompt_tokens_details": None}
    assert s3["response"]["body"]["data"] == [{"index": 0, "object": "score", "score": scored("q", "a")},
                                              {"index": 1, "object": "score", "score": scored("q", "b")}]  # 1:N
    assert s4["response"]["body"]["data"] == [{"index": 0, "object": "score", "score": scored("q1", "a")},
                                              {"index": 1, "object": "score", "score": scored("q2", "b")}]  # N:N
    ranked = sorted([(scored("q", text), k, text) for k, text in enumerate("abc")], reverse=True)
    body = r1["response"]["body"]
    assert set(body) == {"id", "model", "usage", "results"} and body["id"].startswith("rerank-")
    assert body["results"] == [{"index": k, "document": {"text": text}, "relevance_score": value} for value, k, text in ranked]
    assert body["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    assert r2["response"]["body"]["results"] == body["results"][:2]


def test_a_model_mapped_to_base_and_adapter_runs_its_lines_with_the_adapter_in_the_bases_engine(batch, monkeypatch):
    from batchllm.openai_batch.model_map import model_map
    from testkit.lora_adapters import TINY_BASE, make_lora_adapter

    adapter = make_lora_adapter(batch["root"] / "adapters" / "sql", TINY_BASE, seed=0)
    monkeypatch.chdir(batch["root"])
    models = model_map(["gpt-a=./model-a", "sql-expert=./model-a:adapters/sql"], None, batch["root"])
    assert models["sql-expert"] == f"{batch['root'] / 'model-a'}:{adapter.resolve()}"
    batch["requests"].write_text("\n".join([json.dumps(chat("base", "gpt-a", "Hi", max_tokens=8)),
                                            json.dumps(chat("tuned", "sql-expert", "Hi", max_tokens=8)),
                                            json.dumps(embedding("e", "sql-expert", "Hi"))]) + "\n")
    factory = FakeEngineFactory()
    done = run({**batch, "models": models}, factory)
    [engine] = factory.started
    assert (engine.config.max_loras, engine.config.max_lora_rank) == (1, 8)
    assert sorted((r.adapter or "") for r in factory.requests) == ["", str(adapter.resolve())]
    base, tuned, embedded = output_lines(done.output)
    assert base["response"]["body"]["model"] == "gpt-a" and tuned["response"]["body"]["model"] == "sql-expert"
    assert embedded["error"] == {"code": "invalid_request", "message": "line 3: model 'sql-expert' is mapped to a LoRA adapter, "
                                                                       "which applies to chat and completion lines, not to /v1/embeddings lines"}
    with pytest.raises(UserError) as refused:
        model_map(["sql-expert=./model-a:adapters/none"], None, batch["root"])
    assert str(refused.value) == f"adapter directory '{batch['root'] / 'adapters' / 'none'}' does not exist"


def test_image_parts_of_a_chats_user_message_reach_the_engine_before_its_text_and_a_text_only_model_is_that_lines_error(batch):
    vlm = make_model_dir(batch["root"] / "vlm")
    (vlm / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"],
                                                 "vision_config": {"image_size": 336, "patch_size": 14}}))
    picture = "data:image/png;base64,iVBORw0KGgo="

    def seeing(custom_id, model, *parts, messages=None):
        content = [{"type": "text", "text": "What is it? "}, *({"type": "image_url", "image_url": {"url": p}} for p in parts)]
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": model, "max_tokens": 4, "messages": messages or [{"role": "user", "content": content}]}})

    batch["requests"].write_text("\n".join([
        seeing("one", "vision", picture), seeing("two", "vision", picture, "https://example.com/b.jpg"),
        json.dumps(chat("plain", "vision", "Hi", max_tokens=4)), seeing("blind", "gpt-a", picture),
        seeing("turns", "vision", messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture}}]}]),
    ]) + "\n")
    factory = FakeEngineFactory()
    done = run({**batch, "models": {**batch["models"], "vision": str(vlm)}}, factory)
    sent = {r.prompt: r.images for r in factory.requests}
    assert sent == {"What is it? ": (picture, "https://example.com/b.jpg"), "Hi": ()}  # one request a line; "one" and "two" share a prompt
    assert sorted(len(r.images) for r in factory.requests) == [0, 1, 2]
    lines = {line["custom_id"]: line for line in output_lines(done.output)}
    assert all(lines[k]["error"] is None for k in ("one", "two", "plain"))
    assert lines["blind"]["error"] == {"code": "invalid_request", "message": (
        f"line 4: body.messages holds images, but model 'gpt-a' ({batch['models']['gpt-a']}) sees none: its config has no "
        "vision_config; map the model to a vision-language model")}
    assert lines["turns"]["error"] == {"code": "unsupported_body", "message": (
        "line 5: body.messages[2].content[0] is an image: batchllm takes images in the one user message of a chat of [system,] user")}
