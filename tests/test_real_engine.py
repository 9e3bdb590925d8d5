"""End-to-end on the real vLLM engine and the embedded model (slow: marked `engine`).

The in-process tests share one engine for the whole session; the CLI tests run
`batchllm` as a user would, in a subprocess, so `kill -9` hits a real driver.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchllm.engines.devices import parse_devices
from batchllm.engines.process_engine import start_vllm_engine
from batchllm.io.node_journal import read_records
from batchllm.runtime.launch import run_dag_file
from tests.example_rows import example_dag

pytestmark = pytest.mark.engine
REPO = Path(__file__).resolve().parent.parent
# Persistent within a checkout (gitignored), so the one-time model conversion is paid once.
MODEL_HOME = REPO / ".batchllm-home"
BATCHLLM = str(Path(sys.executable).parent / "batchllm")


@pytest.fixture
def model_home(monkeypatch):
    monkeypatch.setenv("BATCHLLM_HOME", str(MODEL_HOME))
    return MODEL_HOME


def results(out: Path, node: str) -> list[dict]:
    """A finished run's results of a node (its node file: row_id, step, text, tokens, finish_reason)."""
    return pq.read_table(out / "nodes" / f"{node}.parquet").to_pylist()


def committed(out: Path, node: str) -> int:
    """Results committed so far, read while a run may be appending to its journal."""
    folder = out / ".batchllm" / "journal" / node
    return read_records(folder).num_rows if folder.exists() else 0


def expected_units(dag_name: str, folder: Path) -> dict[str, int]:
    """Units per node of an example DAG over the inputs in `folder` (as `example_dag` wrote them)."""
    if dag_name == "ensemble_judge":
        questions = pq.read_table(folder / "questions.parquet").num_rows
        return {"concise": questions, "creative": questions, "judge": questions}
    if dag_name == "chain_summary":
        documents = pq.read_table(folder / "documents.parquet")
        return {"summarize": sum(len(c) for c in documents.column("chunks").to_pylist()), "evaluate": documents.num_rows}
    return {}


EXAMPLE_ROWS = {"ensemble_judge": 6, "router": 8, "chain_summary": 3}  # of 24 questions, 24, 12 documents


@pytest.fixture(scope="module")
def ensemble_run(tmp_path_factory, shared_engines):
    """The ensemble example run once through `run_dag_file`, as the command runs it: (its folder, its run's output folder)."""
    folder = tmp_path_factory.mktemp("ensemble")
    dag, out = example_dag("ensemble_judge", folder, EXAMPLE_ROWS["ensemble_judge"]), folder / "out"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHLLM_HOME", str(MODEL_HOME))
        result, _ = run_dag_file(dag, out, parse_devices("cpu:2"), console=Console(quiet=True), engine_factory=shared_engines)
    assert result.nodes_failed == {}
    return folder, out


@pytest.mark.parametrize("dag_name", ["ensemble_judge", "router", "chain_summary"])
def test_example_dag_runs_to_completion(dag_name, tmp_path, model_home, shared_engines, request):
    if dag_name == "ensemble_judge":  # shared with the Python API's test
        tmp_path, out = request.getfixturevalue("ensemble_run")
        dag = tmp_path / "ensemble_judge.yaml"
    else:
        out = tmp_path / "out"
        dag = example_dag(dag_name, tmp_path, EXAMPLE_ROWS[dag_name])
        result, _ = run_dag_file(dag, out, parse_devices("cpu:2"), console=Console(quiet=True), engine_factory=shared_engines)
        assert result.nodes_failed == {}
    from batchllm.dag.loader import load_dag

    spec = load_dag(dag)
    for node in spec.nodes:
        records = results(out, node)
        keys = [(r["row_id"], r["step"]) for r in records]
        assert len(keys) == len(set(keys)) == committed(out, node), f"{node}: a unit was produced twice"
        assert all(r["text"].strip() for r in records), f"{node}: empty output"  # structured output too
        assert all(r["num_output_tokens"] > 0 for r in records)
        if node in expected_units(dag_name, tmp_path):
            assert len(keys) == expected_units(dag_name, tmp_path)[node], node
    if dag_name == "router":  # every question is answered by exactly one specialist, then judged through the merge
        routes = {r["row_id"]: r["text"] for r in results(out, "route")}
        assert set(routes.values()) <= {"code", "other"}, "structured output allows the two labels only"
        tech = {r["row_id"] for r in results(out, "tech_expert")}
        general = {r["row_id"] for r in results(out, "generalist")}
        assert tech == {r for r, label in routes.items() if label == "code"} and not tech & general
        assert len(tech | general) == len(routes)
        judged = {r["row_id"]: r["text"] for r in results(out, "judge")}
        assert set(judged) == tech | general and set(judged.values()) <= {"yes", "no"}
        routed = pq.read_table(out / "routed.parquet").to_pylist()
        assert all(row["answer"] and row["verdict"] in ("yes", "no") for row in routed)
    for output in spec.outputs:
        assert pq.read_table(out / f"{output}.parquet").num_rows > 0


def cli(args: list[str], **kwargs) -> subprocess.Popen:
    env = {**os.environ, "BATCHLLM_HOME": str(MODEL_HOME)}
    return subprocess.Popen([BATCHLLM, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def children_of(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def alive(pid: int) -> bool:
    """Whether the process runs: gone, or a zombie, is not alive. A process can be reaped
    between opening its /proc file and reading it (ProcessLookupError)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:  # gone: no file (FileNotFoundError), or reaped mid-read (ProcessLookupError)
        return False
    return state != "Z"


KILL_TEST_DAG = """
inputs:
  questions: {path: %s, id_column: id}
engine:
  max_model_len: 1024
  max_num_seqs: 4        # results arrive in waves, so a kill can land mid-node
nodes:
  answer:
    model: smollm2-135m
    prompt: "{{ question }}"
    sampling: {max_tokens: 24}
  critique:
    model: smollm2-135m
    prompt: "Question: {{ question }} Answer: {{ answer }} Is the answer correct? Reply yes or no."
    sampling: {max_tokens: 8}
outputs:
  critiqued:
    columns: {question: question, answer: answer, critique: critique}
"""


def test_kill_9_of_the_driver_then_of_a_worker_gives_each_unit_exactly_once(tmp_path, model_home):
    out = tmp_path / "out"
    dag = tmp_path / "dag.yaml"
    dag.write_text(KILL_TEST_DAG % (REPO / "examples" / "questions.parquet"))
    driver = cli(["run", str(dag), "--out", str(out), "--devices", "cpu:2"])
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and committed(out, "answer") < 4:
        assert driver.poll() is None, driver.stderr.read()
        time.sleep(0.05)
    workers = children_of(driver.pid)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    answered = committed(out, "answer")
    assert 4 <= answered < 24, answered
    time.sleep(2)
    assert workers and not any(alive(w) for w in workers), "the engine worker must die with its driver"

    # The resumed run loses an engine worker to kill -9 mid-run: it is restarted, and its
    # requests in flight are served again, once.
    resumed = cli(["run", str(dag), "--out", str(out), "--devices", "cpu:2"])
    done = lambda: committed(out, "answer") + committed(out, "critique")  # noqa: E731
    before = done()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and done() < before + 2:
        assert resumed.poll() is None, resumed.stderr.read()
        time.sleep(0.05)
    assert done() < 48 - 8, "the kill must land with work left"
    engine_workers = [w for w in children_of(resumed.pid) if b"spawn_main" in Path(f"/proc/{w}/cmdline").read_bytes()]
    assert engine_workers
    os.kill(engine_workers[0], signal.SIGKILL)
    stdout, stderr = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, stderr
    assert "lost; restarting (1/2)" in stderr
    for node in ("answer", "critique"):
        keys = [(r["row_id"], r["step"]) for r in results(out, node)]
        assert len(keys) == 24 and len(set(keys)) == 24 and committed(out, node) == 24, node
    critiqued = pq.read_table(out / "critiqued.parquet").to_pylist()
    assert len(critiqued) == 24 and all(row["answer"] and row["critique"] for row in critiqued)
    assert stdout == f"critiqued: {out}/critiqued.parquet\n"

    # A finished run, run again, is a no-op that starts no engine (its log does not grow).
    logs = {p: p.stat().st_size for p in (out / ".batchllm" / "logs").glob("*.log")}
    again = cli(["run", str(dag), "--out", str(out), "--devices", "cpu:2"])
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert "Nothing to do" in stderr and "no engine was started" in stderr
    assert {p: p.stat().st_size for p in (out / ".batchllm" / "logs").glob("*.log")} == logs


def test_a_prompt_longer_than_the_context_fails_its_row_only(tmp_path, model_home, shared_engines):
    import pyarrow as pa

    pq.write_table(pa.table({"id": ["short", "long"], "text": ["Say hello.", "word " * 3000]}), tmp_path / "rows.parquet")
    dag = tmp_path / "dag.yaml"
    dag.write_text(
        "inputs:\n  rows: {path: rows.parquet, id_column: id}\n"
        "engine:\n  max_model_len: 2048\n"
        "nodes:\n  echo:\n    model: smollm2-135m\n    prompt: '{{ text }}'\n    sampling: {max_tokens: 8}\n"
    )
    result, _ = run_dag_file(dag, tmp_path / "out", parse_devices("cpu:2"), console=Console(quiet=True), engine_factory=shared_engines)
    assert result.nodes_failed == {}
    rows = {r["row_id"]: r for r in results(tmp_path / "out", "echo")}
    assert rows["short"]["finish_reason"] in ("stop", "length") and rows["short"]["text"]
    assert rows["long"]["finish_reason"].startswith("error: prompt has ") and "max_model_len is 2048" in rows["long"]["finish_reason"]


def test_an_engine_vllm_refuses_at_start_fails_its_node_with_vllms_words_everywhere(tmp_path, model_home, monkeypatch):
    """The settings check before the run would refuse this DAG (tests/test_model_checks.py); a
    caller that brings its own engine factory skips it, so the real engine meets the setting. One
    start, no restart: restarts up to the limit, then the node's failure, are
    tests/test_executor.py's (two more refusals here cost two engine starts)."""
    import json

    monkeypatch.setattr("batchllm.runtime.stage_engines.MAX_ENGINE_RESTARTS", 0)

    import pyarrow as pa
    from typer.testing import CliRunner

    from batchllm.cli import app
    from batchllm.core.errors import RunIncomplete

    pq.write_table(pa.table({"id": ["a"], "text": ["Say hello."]}), tmp_path / "rows.parquet")
    dag = tmp_path / "dag.yaml"
    dag.write_text("inputs:\n  rows: {path: rows.parquet, id_column: id}\nengine:\n  max_model_len: 100000\n"
                   "nodes:\n  echo:\n    model: smollm2-135m\n    prompt: '{{ text }}'\n    sampling: {max_tokens: 8}\n")
    out = tmp_path / "out"
    with pytest.raises(RunIncomplete) as incomplete:
        run_dag_file(dag, out, parse_devices("cpu:1"), console=Console(quiet=True), engine_factory=start_vllm_engine,
                     schedule="sequential")
    refusal = "User-specified max_model_len (100000) is greater than the derived max_model_len"
    assert str(incomplete.value).startswith("node echo: engine for ") and refusal in str(incomplete.value)
    assert refusal in json.loads((out / "run.json").read_text())["failed"]["echo"]
    status = CliRunner().invoke(app, ["status", str(out), "--json"])
    assert refusal in json.loads(status.output)["nodes"]["echo"]["failure"]
    assert incomplete.value.outputs == {} and not (out / "nodes").exists()


@pytest.mark.starts_no_engine
def test_the_embedded_models_shipped_config_is_the_converted_models(model_home):
    """An embedded model's settings are checked against the config shipped with batchllm
    (before the model is converted): it must be the config the conversion writes."""
    import json

    from batchllm.models.embedded import SMOLLM2_135M

    converted = SMOLLM2_135M.prepare(model_home) / "config.json"
    assert json.loads(converted.read_text()) == json.loads((SMOLLM2_135M.config_dir() / "config.json").read_text())


def test_stop_penalties_and_logprobs_on_the_real_engine(tmp_path, model_home, shared_engines):
    import pyarrow as pa

    question = "Count from one to twenty in words, separated by commas."
    pq.write_table(pa.table({"id": ["q"], "question": [question]}), tmp_path / "rows.parquet")

    def run(nodes: dict[str, dict], out: str) -> dict:
        import yaml

        columns = {name: name for name in nodes} | ({"total": "scored.logprob", "tokens": "scored.logprobs"} if "scored" in nodes else {})
        dag = {"inputs": {"rows": {"path": "rows.parquet", "id_column": "id"}},
               "nodes": {name: {"model": "smollm2-135m", "prompt": "{{ question }}", "sampling": {"max_tokens": 40, **extra}}
                         for name, extra in nodes.items()},
               "outputs": {"o": {"columns": columns}}}
        (tmp_path / f"{out}.yaml").write_text(yaml.safe_dump(dag))
        run_dag_file(tmp_path / f"{out}.yaml", tmp_path / out, parse_devices("cpu:2"), console=Console(quiet=True),
                     engine_factory=shared_engines, schedule="sequential")
        return pq.read_table(tmp_path / out / "o.parquet").to_pylist()[0]

    row = run({"plain": {}, "penalised": {"repetition_penalty": 1.8}, "scored": {"logprobs": True, "top_logprobs": 2}}, "first")
    plain = row["plain"]
    assert len(plain) > 10
    assert row["penalised"] != plain
    assert row["scored"] == plain  # logprobs change nothing of the text at temperature 0
    scored = results(tmp_path / "first", "scored")[0]
    assert len(row["tokens"]) == scored["num_output_tokens"] > 0
    # As vLLM's OpenAI server does, the logprobs hold every generated token, the end-of-sequence
    # one too when the answer ends by it (one host's greedy answer does, another's runs to max_tokens);
    # the text leaves it out. test_run_batch_vs_vllm.py compares both with vLLM's server.
    from batchllm.models.embedded import SMOLLM2_135M

    eos = json.loads((SMOLLM2_135M.prepare(model_home) / "tokenizer_config.json").read_text())["eos_token"]
    ended_by_eos = scored["finish_reason"] == "stop"
    assert "".join(t["token"] for t in row["tokens"]) == plain + (eos if ended_by_eos else "")
    assert row["total"] == pytest.approx(sum(t["logprob"] for t in row["tokens"]))
    assert all(len(t["top_logprobs"]) == 2 and t["top_logprobs"][0]["logprob"] >= t["logprob"] - 1e-6 for t in row["tokens"])

    # A delimiter taken from the greedy answer itself (what the model writes differs between
    # CPU kinds): the stopped answer is the plain one cut just before its first occurrence.
    delimiter = next(plain[i:i + 3] for i in range(len(plain) // 2, len(plain) - 2) if plain.index(plain[i:i + 3]) >= 3)
    stopped = run({"stopped": {"stop": [delimiter]}}, "second")["stopped"]
    assert stopped == plain[:plain.index(delimiter)]


@pytest.mark.starts_no_engine
def test_messages_render_the_chat_the_tokenizer_renders(model_home, tmp_path):
    """A few-shot `messages:` node and a conversation-column node give the token ids of the
    tokenizer's own apply_chat_template (no engine: the driver's tokenizer)."""
    import pyarrow as pa
    from transformers import AutoTokenizer

    from batchllm.core.requests import EngineRequest
    from batchllm.dag.context import template_context
    from batchllm.dag.loader import load_dag
    from batchllm.dag.node_prompt import NodePrompt
    from batchllm.models.embedded import SMOLLM2_135M
    from batchllm.models.tokens import PromptTokenizer

    model_dir = SMOLLM2_135M.prepare(model_home)
    chats = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
              {"role": "user", "content": "Tell me a joke."}]]
    pq.write_table(pa.table({"id": ["a"], "q": ["What is 2+2?"], "chat": chats}), tmp_path / "rows.parquet")
    dag = tmp_path / "dag.yaml"
    dag.write_text("inputs:\n  rows: {path: rows.parquet, id_column: id}\nnodes:\n"
                   "  few:\n    model: smollm2-135m\n    messages:\n"
                   "      - {role: system, content: 'Answer with a number.'}\n"
                   "      - {role: user, content: 'What is 1+1?'}\n      - {role: assistant, content: '2'}\n"
                   "      - {role: user, content: '{{ q }}'}\n"
                   "  conversation: {model: smollm2-135m, messages: '{{ chat }}'}\n")
    spec = load_dag(dag)
    row = pq.read_table(tmp_path / "rows.parquet").to_pylist()[0]
    reference, ours = AutoTokenizer.from_pretrained(str(model_dir)), PromptTokenizer(model_dir)
    expected = {
        "few": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 1+1?"},
                {"role": "assistant", "content": "2"}, {"role": "user", "content": "What is 2+2?"}],
        "conversation": chats[0],
    }
    for name, messages in expected.items():
        node = spec.nodes[name]
        rendered = NodePrompt(node).render(template_context(node, row, {}), where=name)
        request = EngineRequest(0, rendered.prompt, rendered.system, True, messages=rendered.messages)
        ids = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert ours.token_ids(request) == list(ids if isinstance(ids, list) else ids["input_ids"]), name


@pytest.mark.starts_no_engine
def test_prompt_tokens_without_transformers_equal_transformers_on_the_embedded_model(model_home):
    from transformers import AutoTokenizer

    from batchllm.core.requests import EngineRequest
    from batchllm.models.embedded import SMOLLM2_135M
    from batchllm.models.tokens import PromptTokenizer

    model_dir = SMOLLM2_135M.prepare(model_home)
    fast, reference = PromptTokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert fast.loads_without_transformers
    questions = pq.read_table(REPO / "examples" / "questions.parquet").column("question").to_pylist()
    questions += [" a leading space", "\n\nnew lines first", "trailing spaces  ", "<|im_end|> inside", ""]
    requests = [EngineRequest(str(i), q, system="Be brief." if i % 2 else None) for i, q in enumerate(questions)]
    assert fast.stitch(None) is not None and fast.stitch("Be brief.") is not None  # the ids below are stitched
    expected = [reference.apply_chat_template(([{"role": "system", "content": r.system}] if r.system else [])
                                              + [{"role": "user", "content": r.prompt}], add_generation_prompt=True, tokenize=True)
                for r in requests]
    assert fast.token_ids_many(requests) == [list(e if isinstance(e, list) else e["input_ids"]) for e in expected]


def test_python_api_runs_the_ensemble_example_from_a_pandas_frame_with_the_clis_rows(tmp_path, model_home, shared_engines,
                                                                                     ensemble_run):
    import batchllm

    folder, cli_out = ensemble_run
    frame = pq.read_table(folder / "questions.parquet").to_pandas()
    ran = batchllm.run(folder / "ensemble_judge.yaml", inputs={"questions": frame}, out=tmp_path / "api", devices="cpu:2",
                       engine_factory=shared_engines, console=Console(quiet=True))
    from_api, from_cli = ran.tables["judged"], pq.read_table(cli_out / "judged.parquet")
    assert from_api.schema == from_cli.schema and from_api.num_rows == from_cli.num_rows == len(frame)
    for column in ("row_id", "question"):
        assert from_api.column(column) == from_cli.column(column), column
    assert all(row["answer_a"] and row["answer_b"] and row["verdict"] for row in from_api.to_pylist())


BATCH_QUESTIONS = 6  # of the 24 example questions


def batch_request_lines() -> list[str]:
    """The first BATCH_QUESTIONS example questions twice: as a chat for `gpt-4o-mini`, as a completion for `local-base`; one bad line;
    one chat with a JSON-schema response format (a node of its own)."""
    import json

    questions = pq.read_table(REPO / "examples" / "questions.parquet").to_pylist()[:BATCH_QUESTIONS]
    lines = [json.dumps({"custom_id": f"chat-{q['id']}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "gpt-4o-mini", "max_tokens": 48, "temperature": 0,
                                  "messages": [{"role": "system", "content": "Answer briefly."},
                                               {"role": "user", "content": q["question"]}]}}) for q in questions]
    lines += [json.dumps({"custom_id": f"text-{q['id']}", "method": "POST", "url": "/v1/completions",
                          "body": {"model": "local-base", "max_tokens": 32, "prompt": f"Q: {q['question']}\nA:"}})
              for q in questions]
    route = {"type": "object", "properties": {"topic": {"enum": ["code", "other"]}}, "required": ["topic"]}
    lines.append(json.dumps({"custom_id": "json-1", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "gpt-4o-mini", "max_tokens": 24, "messages": [{"role": "user", "content": "Is SQL about code?"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "route", "schema": route}}}}))
    lines.insert(5, json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "gpt-4o-mini", "messages": "not a list"}}))
    return lines


def test_an_openai_batch_file_with_two_models_is_killed_resumed_and_answers_every_line_once(tmp_path, model_home):
    import json

    requests, results_file, run_dir = tmp_path / "requests.jsonl", tmp_path / "results.jsonl", tmp_path / "run"
    requests.write_text("\n".join(batch_request_lines()) + "\n")
    command = ["run-batch", "-i", str(requests), "-o", str(results_file), "--run-dir", str(run_dir), "--devices", "cpu:2",
               "--model", "gpt-4o-mini=smollm2-135m", "--model", "local-base=smollm2-135m"]
    first = cli(command)
    done = lambda: committed(run_dir, "gpt_4o_mini_chat") + committed(run_dir, "local_base_completion")  # noqa: E731
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and done() < 1:
        assert first.poll() is None, first.stderr.read()
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    before = done()
    assert 1 <= before < 2 * BATCH_QUESTIONS, "the kill must land with work left"
    assert not results_file.exists(), "the results file is written whole, at the end"

    resumed = cli(command)
    stdout, stderr = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, stderr
    total = 2 * BATCH_QUESTIONS + 2
    assert stdout == f"{results_file}: {total} lines, {total - 1} succeeded, 1 failed (1 invalid_request)\n"
    lines = [json.loads(line) for line in results_file.read_text().splitlines()]
    ids = [line["custom_id"] for line in lines]
    assert len(ids) == len(set(ids)) == total
    bad = lines[5]
    assert bad["custom_id"] == "bad" and bad["response"] is None and bad["error"]["code"] == "invalid_request"
    for line in lines[:5] + lines[6:]:
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        body = line["response"]["body"]
        choice = body["choices"][0]
        assert body["usage"]["completion_tokens"] > 0 and choice["finish_reason"] in ("stop", "length"), line
        if line["custom_id"].startswith("chat-"):  # a completion may rightly be one end-of-text token: empty
            assert choice["message"]["content"].strip(), line
    assert json.loads(lines[-1]["response"]["body"]["choices"][0]["message"]["content"])["topic"] in ("code", "other")
    for node in ("gpt_4o_mini_chat", "local_base_completion"):
        keys = [r["row_id"] for r in results(run_dir, node)]
        assert len(keys) == len(set(keys)) == committed(run_dir, node) == BATCH_QUESTIONS, node


def test_the_readmes_python_api_example_runs_as_a_plain_script(tmp_path, model_home):
    """The example exactly as the README shows it, with no `__main__` guard: engine workers
    must not run the script again (spawn would, and each would start the whole run)."""
    readme = (REPO / "README.md").read_text()
    example = readme.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "__main__" not in example and "batchllm.run(" in example
    (tmp_path / "example.py").write_text(example)
    for folder in ("dags", "examples"):
        (tmp_path / folder).symlink_to(REPO / folder)
    done = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "BATCHLLM_HOME": str(model_home)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == "4 rows judged"
    judged = pq.read_table(tmp_path / "runs" / "api" / "judged.parquet").to_pylist()
    assert len(judged) == 4 and all(row["verdict"] for row in judged)


def test_a_seeded_node_whose_prompts_are_split_over_steps_completes(tmp_path, model_home, shared_engines):
    """16 prompts of about 250 tokens at once pass the engine's 2,048-token step: some are computed
    over two steps, and a seeded request's dropped sample made vLLM's CPU path rewind a generator
    that has no offset (the engine died, three times, and the node failed:
    engines/cpu_seeded_sampling.py)."""
    import pyarrow as pa

    long_prompts = [f"Question {k}: " + "Explain, with care and in plain words, why the sky looks blue by day. " * 18
                    for k in range(16)]
    pq.write_table(pa.table({"id": [f"r{k}" for k in range(16)], "text": long_prompts}), tmp_path / "long.parquet")
    dag = tmp_path / "seeded.yaml"
    dag.write_text(f"""inputs:
  rows: {{path: {tmp_path / 'long.parquet'}, id_column: id}}
nodes:
  sampled:
    model: smollm2-135m
    prompt: "{{{{ text }}}}"
    sampling: {{max_tokens: 4, temperature: 0.8, seed: 7}}
""")
    result, _ = run_dag_file(dag, tmp_path / "out", parse_devices("cpu:2"), console=Console(quiet=True), engine_factory=shared_engines,
                             schedule="sequential")
    assert result.nodes_failed == {}
    assert len(results(tmp_path / "out", "sampled")) == 16
