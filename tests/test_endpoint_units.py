"""Endpoints without a server: the DAG's `endpoints:` and `--endpoint`, the checks that need
no answer, request bodies and streamed answers, and the executor running a node on servers
beside nodes on devices (scripted engines stand in for both)."""

from __future__ import annotations

import json
import socket

import pyarrow.parquet as pq
import pytest
from rich.console import Console
from typer.testing import CliRunner

from batchllm.cli import app
from batchllm.core.endpoint import Endpoint
from batchllm.core.errors import UserError
from batchllm.core.latency_slo import LatencySlo
from batchllm.core.output_constraint import OutputConstraint
from batchllm.core.requests import EngineRequest, FinishReason
from batchllm.core.sampling import SamplingSpec
from batchllm.costmodel import server_pace
from batchllm.dag.endpoints_section import with_endpoint_options
from batchllm.dag.loader import load_dag
from batchllm.engines.devices import DeviceSet
from batchllm.engines.endpoint.request_body import StreamedAnswer, request_body
from batchllm.runtime import launch
from tests.fakes import FakeEngineFactory

MIXED = """
inputs:
  questions: {path: questions.parquet, id_column: id}
nodes:
  answer:
    model: served-model
    prompt: "{{ question }}"
  critique:
    model: ./tiny-model
    prompt: "{{ question }} {{ answer }}"
outputs:
  critiqued:
    columns: {question: question, answer: answer, critique: critique}
endpoints:
  served-model:
    urls: [http://127.0.0.1:9/v1, "http://gpu-box:8000/v1/"]
    api_key_env: BATCHLLM_TEST_KEY
    slo: {ttft_p99_s: 0.5}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_endpoints_section_and_the_command_lines_endpoint(workspace):
    dag = load_dag(workspace.dag(MIXED))
    spec = dag.endpoints["served-model"]
    assert spec.urls == ("http://127.0.0.1:9/v1", "http://gpu-box:8000/v1")
    assert (spec.api_key_env, spec.slo, spec.max_in_flight, spec.served_model) == ("BATCHLLM_TEST_KEY", LatencySlo(0.5, None), 64, None)
    assert dag.on_endpoints("answer") and not dag.on_endpoints("critique")
    devices_part = dag.on_devices()
    assert list(devices_part.nodes) == ["critique"] and devices_part.nodes["critique"].upstream == ()
    given = with_endpoint_options(dag, ["served-model=http://other:8000/v1"])
    assert given.endpoints["served-model"].urls == ("http://other:8000/v1",)
    assert given.endpoints["served-model"].slo == LatencySlo(0.5, None)  # the DAG's other settings stay
    with pytest.raises(UserError, match="--endpoint names model 'nope', which no node uses"):
        with_endpoint_options(dag, ["nope=http://x:1/v1"])
    with pytest.raises(UserError, match="is not MODEL=URL"):
        with_endpoint_options(dag, ["served-model"])


@pytest.mark.parametrize("body, message", [
    ("    urls: [gpu-box:8000]\n", "endpoints.served-model.urls must be a list of server URLs"),
    ("    urls: [http://x:1/v1]\n    api_key_env: sk-123\n", "endpoints.served-model.api_key_env must be the name of an environment variable"),
    ("    urls: [http://x:1/v1]\n    slo: {ttft_p99: 1}\n", "unknown key 'ttft_p99' in endpoints.served-model.slo"),
    ("    urls: [http://x:1/v1]\n    max_in_flight: 0\n", "endpoints.served-model.max_in_flight must be an integer >= 1"),
])
def test_a_bad_endpoint_entry_names_its_key(workspace, body, message):
    text = MIXED[:MIXED.index("endpoints:")] + "endpoints:\n  served-model:\n" + body
    with pytest.raises(UserError, match=message):
        load_dag(workspace.dag(text))


def test_a_missing_api_key_and_an_unreachable_server_are_exit_2_before_anything_runs(workspace, monkeypatch):
    text = MIXED.replace("http://127.0.0.1:9/v1, \"http://gpu-box:8000/v1/\"", f"http://127.0.0.1:{free_port()}/v1")
    dag = workspace.dag(text)
    monkeypatch.delenv("BATCHLLM_TEST_KEY", raising=False)
    result = CliRunner().invoke(app, ["run", str(dag), "--out", str(workspace.out)])
    assert result.exit_code == 2
    assert "the API key variable BATCHLLM_TEST_KEY (for http://127.0.0.1:" in result.output
    assert "export BATCHLLM_TEST_KEY=<key>" in result.output
    monkeypatch.setenv("BATCHLLM_TEST_KEY", "secret")
    result = CliRunner().invoke(app, ["run", str(dag), "--out", str(workspace.out)])
    assert result.exit_code == 2 and "cannot reach the server http://127.0.0.1:" in result.output
    assert "start the server, or correct the URL" in result.output and "secret" not in result.output
    assert not workspace.out.exists()


def test_a_chat_request_body_carries_the_sampling_the_constraint_and_the_batch_priority():
    sampling = SamplingSpec(max_tokens=16, seed=3, stop=(",",), top_k=5, repetition_penalty=1.2, logprobs=True, top_logprobs=2)
    request = EngineRequest(7, "Hi", "Be brief.", sampling=sampling, output=OutputConstraint(choices=("yes", "no")))
    body = request_body(request, "smol", "vllm", 100)
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (body["model"], body["max_tokens"], body["stop"], body["top_k"], body["repetition_penalty"]) == ("smol", 16, [","], 5, 1.2)
    assert body["logprobs"] is True and body["top_logprobs"] == 2 and body["priority"] == 100
    assert body["structured_outputs"] == {"choice": ["yes", "no"]} and body["stream"] is True
    assert "presence_penalty" not in body and "min_p" not in body  # defaults are left to the server
    plain = request_body(EngineRequest(8, "Once upon", chat=False, output=OutputConstraint(json_schema='{"type": "object"}')),
                         "m", "openai", None)
    assert plain["prompt"] == "Once upon" and "priority" not in plain
    assert plain["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}}
    assert request_body(EngineRequest(9, "x", output=OutputConstraint(regex="a+")), "m", "sglang", -100)["regex"] == "a+"


def test_a_chunk_of_several_tokens_counts_them_by_the_servers_running_usage():
    answer = StreamedAnswer(1)
    usage = lambda tokens: {"prompt_tokens": 5, "completion_tokens": tokens}  # noqa: E731
    assert answer.add({"choices": [{"index": 0, "delta": {"content": "a"}}], "usage": usage(1)}) == 1
    assert answer.add({"choices": [{"index": 0, "delta": {"content": "bcd"}}], "usage": usage(4)}) == 3
    assert answer.add({"choices": [], "usage": usage(4)}) == 0
    # a token that decodes to no text yet (half of a character) is counted when it comes, not in the next chunk's gap
    assert answer.add({"choices": [{"index": 0, "delta": {"content": ""}}], "usage": usage(5)}) == 1
    assert answer.add({"choices": [{"index": 0, "delta": {"content": "é"}}], "usage": usage(6)}) == 1
    assert answer.add({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}], "usage": usage(7)}) == 1
    assert request_body(EngineRequest(1, "x"), "m", "vllm", None)["stream_options"] == {"include_usage": True,
                                                                                          "continuous_usage_stats": True}
    assert request_body(EngineRequest(1, "x"), "m", "sglang", None)["stream_options"] == {"include_usage": True}


def test_streamed_chunks_add_up_to_the_result():
    request = EngineRequest(5, "Hi", sampling=SamplingSpec(n=2, logprobs=False))
    answer = StreamedAnswer(2)
    assert answer.add({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}) == 0
    assert answer.add({"choices": [{"index": 0, "delta": {"content": "Hel"}}, {"index": 1, "delta": {"content": "Yo"}}]}) == 1
    answer.add({"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length"},
                            {"index": 1, "delta": {}, "finish_reason": "stop"}]})
    assert answer.add({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 7}}) == 0  # the only count: not a token
    result = answer.result(request)
    assert result.texts == ("Hello", "Yo") and result.finish_reason is FinishReason.LENGTH
    assert (result.num_prompt_tokens, result.num_output_tokens, result.logprobs) == (11, 7, None)
    chat_logprobs = StreamedAnswer(1)
    chat_logprobs.add({"choices": [{"index": 0, "delta": {"content": "Yes"}, "logprobs": {"content": [
        {"token": "Yes", "logprob": -0.1, "top_logprobs": [{"token": "Yes", "logprob": -0.1}, {"token": "No", "logprob": -2.5}]}]}}]})
    logged = chat_logprobs.result(EngineRequest(6, "q", sampling=SamplingSpec(logprobs=True, top_logprobs=2))).logprobs
    assert logged[0].token == "Yes" and logged[0].top == (("Yes", -0.1), ("No", -2.5))


def endpoint(url: str) -> Endpoint:
    return Endpoint(url, "served-model", None, None, 4, "vllm", 100, 2048)


def test_a_node_on_servers_runs_beside_the_nodes_on_devices_and_its_consumer_follows(workspace, monkeypatch):
    servers = (endpoint("http://a:1/v1"), endpoint("http://b:1/v1"))
    monkeypatch.setattr(launch, "check_endpoints", lambda dag: {"served-model": servers})
    factory = FakeEngineFactory()
    result, _ = launch.run_dag_file(workspace.dag(MIXED), workspace.out, DeviceSet("cpu", (0, 1)), console=Console(quiet=True),
                               engine_factory=factory, schedule="sequential", pilot=None, prefix_order=False)
    on_servers = [e for e in factory.started if e.config.endpoint is not None]
    assert sorted(e.config.endpoint.url for e in on_servers) == ["http://a:1/v1", "http://b:1/v1"]
    assert {r.prompt for e in on_servers for r in e.seen} == {q for q in pq.read_table(workspace.root / "questions.parquet")
                                                              .column("question").to_pylist()}
    on_devices = [e for e in factory.started if e.config.endpoint is None]
    assert on_devices and all(e.config.replica.kind == "cpu" for e in on_devices)
    assert all(r.prompt.endswith(">") for e in on_devices for r in e.seen)  # the critique read the answers: it ran after them
    rows = pq.read_table(result.outputs["critiqued"]).to_pylist()
    assert len(rows) == 4 and all(row["answer"] == f"<{row['question']}>" for row in rows)
    report = json.loads((workspace.out / "run.json").read_text())
    assert report["stages"][0]["nodes"]["answer"]["plan"] == "2 server(s)" and "critique" not in report["stages"][0]["nodes"]


def test_the_plan_leaves_nodes_on_servers_out_and_estimates_them_from_their_measured_pace(isolated_home):
    import yaml

    from batchllm.dag.loader import load_dag_mapping
    from batchllm.planner.plan_file import plan_dag

    REPO = __import__("pathlib").Path(__file__).resolve().parent.parent
    mapping = yaml.safe_load((REPO / "dags" / "ensemble_judge.yaml").read_text())
    mapping["nodes"]["creative"]["model"] = "big-served-model"
    mapping["endpoints"] = {"big-served-model": {"urls": ["http://gpu-box:8000/v1"]}}
    report = plan_dag(load_dag_mapping(mapping, REPO / "dags", "mixed.yaml"), "2xA100-80G")
    assert set(report.problem.nodes) == {"concise", "judge"}
    head = "node creative runs on 1 server(s) of big-served-model (http://gpu-box:8000/v1), beside the devices: "
    assert (head + "no pace of these servers measured yet, so its time is not estimated; `run` measures it (its progress "
            "and `status` show the ETA) and later plans use it") in report.problem.notes
    judge_prompt = report.preflight["judge"].prompt_tokens["p50"]  # creative's answer counted at its max_tokens, 48
    server_pace.ServerPaceStore(isolated_home).save(server_pace.ServerPace(
        "big-served-model", ("http://gpu-box:8000/v1",), 120, 1_200, 60.0, "2026-11-20", "a run of nightly"))
    mapping["nodes"]["creative"]["sampling"] = {**mapping["nodes"]["creative"].get("sampling", {}), "n": 2}
    report = plan_dag(load_dag_mapping(mapping, REPO / "dags", "mixed.yaml"), "2xA100-80G")
    assert (head + "about 24 s for its 48 answers, at the pace measured there: 2.00 answers/s (20 output tok/s) in a run "
            "of nightly on 2026-11-20") in report.problem.notes  # 24 questions x n 2 at 2 a second
    # the judge reads creative's answers: now at the 10 tokens an answer the servers gave, not 48
    assert judge_prompt - report.preflight["judge"].prompt_tokens["p50"] == pytest.approx(38, abs=1)
    mapping["nodes"] = {"creative": mapping["nodes"]["creative"]}
    mapping["outputs"] = {"out": {"columns": {"answer": "creative"}}}
    with pytest.raises(UserError, match="every node runs on servers"):
        plan_dag(load_dag_mapping(mapping, REPO / "dags", "mixed.yaml"), "2xA100-80G")


def test_plans_endpoint_option_puts_a_model_on_servers_as_runs_does(isolated_home):
    REPO = __import__("pathlib").Path(__file__).resolve().parent.parent
    dag = str(REPO / "dags" / "ensemble_judge.yaml")  # every node is smollm2-135m
    result = CliRunner().invoke(app, ["plan", dag, "--devices", "2xA100-80G", "--endpoint", "smollm2-135m=http://gpu-box:8000/v1"])
    assert result.exit_code == 2 and "every node runs on servers (endpoints:): there are no devices to plan" in result.output
    result = CliRunner().invoke(app, ["plan", dag, "--devices", "2xA100-80G", "--endpoint", "nope"])
    assert result.exit_code == 2 and "--endpoint 'nope' is not MODEL=URL" in result.output


CHAIN = MIXED.replace('''outputs:''', '''  summary:
    model: ./tiny-model
    prompt: "{{ critique }}"
outputs:''')


def test_a_chain_behind_a_node_on_servers_waits_for_it_and_one_lost_server_does_not_fail_the_node(workspace, monkeypatch):
    servers = (endpoint("http://a:1/v1"), endpoint("http://b:1/v1"))
    monkeypatch.setattr(launch, "check_endpoints", lambda dag: {"served-model": servers})
    factory = FakeEngineFactory(die_after=[1])  # the first engine started, server a's, dies after one answer
    result, _ = launch.run_dag_file(workspace.dag(CHAIN), workspace.out, DeviceSet("cpu", (0, 1)), console=Console(quiet=True),
                               engine_factory=factory, schedule="sequential", pilot=None, prefix_order=False)
    assert [e.config.endpoint.url for e in factory.started[:2]] == ["http://a:1/v1", "http://b:1/v1"]
    assert all(e.config.endpoint is None for e in factory.started[2:])  # server a was not started again in that stage
    assert not result.nodes_failed
    summaries = pq.read_table(workspace.out / "nodes" / "summary.parquet").column("text").to_pylist()
    assert len(summaries) == 4 and all(s.startswith("<") for s in summaries)


ADAPTER_NODES = """
inputs: {questions: {path: questions.parquet, id_column: id}}
nodes:
  base: {model: served-model, prompt: "{{ question }}"}
  tuned: {model: served-model, adapter: %s, prompt: "{{ question }}"}
endpoints: {served-model: {urls: [%s]}}
"""


class ModelCards:
    """A server on 127.0.0.1 that lists `cards` at /v1/models (as vLLM lists a base and its LoRA
    modules) and takes any completion; started and stopped by the test."""

    def __init__(self, cards: list[dict]):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._answer({"object": "list", "data": cards})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                self._answer({"choices": [{"index": 0, "text": "k", "finish_reason": "length"}]})

            def _answer(self, payload: dict) -> None:
                body = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> ModelCards:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def test_a_node_on_an_adapter_of_a_served_model_names_it_and_an_adapter_the_server_lacks_is_exit_2(workspace):
    """On endpoints `adapter:` is the adapter's name on the servers (their --lora-modules name): the
    check finds it among the served models on this base, and the node's requests name it."""
    from batchllm.engines.endpoint.server_check import check_endpoints

    cards = [{"id": "served-model", "object": "model", "owned_by": "vllm", "parent": None},
             {"id": "sql", "object": "model", "owned_by": "vllm", "parent": "served-model"},
             {"id": "other-base", "object": "model", "owned_by": "vllm", "parent": None},
             {"id": "poet", "object": "model", "owned_by": "vllm", "parent": "other-base"}]
    with ModelCards(cards) as server:
        dag = load_dag(workspace.dag(ADAPTER_NODES % ("sql", server.url)))
        [checked] = check_endpoints(dag)["served-model"]
        assert checked.served_model == "served-model"
        assert dag.nodes["tuned"].request_adapter(dag.on_endpoints("tuned")) == "sql" and dag.nodes["base"].adapter_name is None
        for adapter, message, hint in [
                ("sqll", f"the server {server.url} does not serve the adapter 'sqll'; it serves 'sql', 'poet' as adapters",
                 "start it with --enable-lora --lora-modules sqll=<adapter directory>, or name an adapter it serves"),
                ("poet", f"the server {server.url} serves the adapter 'poet' on 'other-base', not on 'served-model'",
                 "give the node the adapter's base as its model, or an adapter of 'served-model'")]:
            result = CliRunner().invoke(app, ["run", str(workspace.dag(ADAPTER_NODES % (adapter, server.url))), "--out", str(workspace.out)])
            assert result.exit_code == 2 and message in result.output and hint in " ".join(result.output.split())
            assert "nodes.tuned.adapter" in result.output and not workspace.out.exists()
    body = request_body(EngineRequest(1, "Hi", adapter="sql"), "served-model", "vllm", 100)
    assert body["model"] == "sql" and request_body(EngineRequest(1, "Hi"), "served-model", "vllm", 100)["model"] == "served-model"
