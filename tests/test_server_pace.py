"""The pace a run measures on servers (runtime.server_paces) and its store (costmodel.server_pace)."""

from __future__ import annotations

import datetime

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

from batchllm.core.endpoint import Endpoint
from batchllm.costmodel import server_pace
from batchllm.costmodel.server_pace import ServerPace, ServerPaceStore
from batchllm.dag.loader import load_dag
from batchllm.engines.devices import DeviceSet
from batchllm.runtime import launch
from batchllm.runtime.ledger import UnitCounts
from batchllm.runtime.progress import NodeStats
from batchllm.runtime.server_paces import server_paces
from tests.fakes import FakeEngineFactory, fake_text

DAG = """
inputs:
  questions: {path: questions.parquet, id_column: id}
nodes:
  answer:
    model: served
    prompt: "{{ question }}"
  again:
    model: served
    prompt: "Once more: {{ question }}"
    sampling: {n: 2}
  local:
    model: ./tiny-model
    prompt: "{{ question }}"
outputs:
  out:
    columns: {answer: answer, again: again, local: local}
endpoints:
  served:
    urls: [http://b:8000/v1, http://a:8000/v1]
"""


def stats(node: str, done: int, failed: int, tokens: int, first_commit: tuple | None, finished_at: float | None,
          done_before: int = 0) -> NodeStats:
    counts = UnitCounts(total=done + done_before, committed=done + done_before, expected=done + done_before)
    return NodeStats(node, "served", lambda: counts, units_done_before=done_before, failed=failed, output_tokens=tokens,
                     started_at=0.0, finished_at=finished_at, first_commit=first_commit)


def test_a_models_nodes_on_servers_give_one_pace_from_their_first_answers_to_their_end(workspace):
    dag = load_dag(workspace.dag(DAG))
    today = datetime.date(2026, 11, 26)
    # `answer` waited 100 s (an upstream node, the guard's baseline) before its first commit of 2 units (200 tokens);
    # `again` (n = 2) had 3 of its 11 units fail, none in its first commit
    ran = {"answer": stats("answer", 42, 0, 4_200, (102.0, 2, 0, 200), 122.0),
           "again": stats("again", 11, 3, 3_100, (105.0, 1, 0, 100), 142.0, done_before=7)}
    (pace,) = server_paces(dag, ran, "a run of dag", today)
    answers = 40 + (11 - 1 - 3) * 2
    assert pace == ServerPace("served", ("http://b:8000/v1", "http://a:8000/v1"), answers, 7_000, 40.0, "2026-11-26",
                              "a run of dag")
    assert (pace.answers_per_s, pace.output_tokens_per_s) == (answers / 40, 175.0)
    assert server_paces(dag, {**ran, "again": stats("again", 10, 0, 3_000, (105.0, 1, 0, 100), None)}, "r", today) == []  # runs
    assert server_paces(dag, {"answer": ran["answer"]}, "r", today) == []  # `again` never started here
    assert server_paces(dag, {**ran, "again": stats("again", 0, 0, 0, None, 0.0, done_before=11)}, "r", today) == []  # done before
    few = {"answer": stats("answer", 9, 0, 900, (1.0, 1, 0, 100), 9.0), "again": stats("again", 5, 0, 500, (1.0, 1, 0, 100), 9.0)}
    assert server_paces(dag, few, "r", today) == []  # 16 answers: too few to say


def test_the_store_keeps_one_pace_per_model_and_set_of_servers(isolated_home):
    store = ServerPaceStore(isolated_home)
    pace = ServerPace("org/served", ("http://b/v1", "http://a/v1"), 100, 5_000, 50.0, "2026-11-26", "a run of x")
    assert pace.describe() == "2.00 answers/s (100 output tok/s) in a run of x on 2026-11-26"
    path = store.save(pace)
    assert path.parent == isolated_home / "servers" and path.name.startswith("org_served-")
    assert store.load("org/served", ("http://a/v1", "http://b/v1")) == pace  # the servers in any order
    assert store.load("org/served", ("http://a/v1",)) is None and store.load("other", pace.urls) is None
    store.save(ServerPace("org/served", pace.urls, 0, 0, 0.0, "2026-11-26", "a run of x"))  # written by hand, say
    assert store.load("org/served", pace.urls) is None  # too little measured: no pace (no division by 0 later)
    path.write_text("{not json")
    assert store.load("org/served", pace.urls) is None
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left


ON_SERVERS = """
inputs:
  questions: {path: many.parquet, id_column: id}
nodes:
  answer:
    model: served
    prompt: "{{ question }}"
outputs:
  out:
    columns: {answer: answer}
endpoints:
  served:
    urls: [http://a:1/v1, http://b:1/v1]
"""


def test_a_run_files_its_servers_pace_and_the_next_plan_reads_it(workspace, monkeypatch, isolated_home):
    questions = [f"Question number {i}?" for i in range(60)]
    pq.write_table(pa.table({"id": [f"q{i}" for i in range(60)], "question": questions}), workspace.root / "many.parquet")
    urls = ("http://a:1/v1", "http://b:1/v1")
    servers = tuple(Endpoint(url, "served", None, None, 4, "vllm", 100, 2048) for url in urls)
    monkeypatch.setattr(launch, "check_endpoints", lambda dag: {"served": servers})
    monkeypatch.setattr(server_pace, "MIN_MEASURED_S", 0.0)  # the stand-in servers answer in milliseconds
    factory = FakeEngineFactory()
    launch.run_dag_file(workspace.dag(ON_SERVERS), workspace.out, DeviceSet("cpu", (0,)), console=Console(quiet=True),
                   engine_factory=factory, schedule="sequential", pilot=None, prefix_order=False)
    pace = ServerPaceStore(isolated_home).load("served", urls)
    assert pace is not None and pace.source == "a run of dag" and pace.measured_s > 0
    # the fakes answer 3 a poll each: the first commit holds 1 to 6 answers, the ones after it are the pace's
    assert 54 <= pace.answers < 60
    tokens = sorted(len(fake_text(r)) for e in factory.started for r in e.seen)
    assert sum(tokens[60 - pace.answers:]) >= pace.output_tokens >= sum(tokens[:pace.answers])
