"""The pace a run measures on servers (runtime.server_paces) and its store (costmodel.server_pace)."""

from __future__ import annotations

import datetime

from batchllm.runtime.ledger import UnitCounts
from batchllm.costmodel.server_pace import ServerPace, ServerPaceStore
from batchllm.dag.loader import load_dag
from batchllm.runtime.progress import NodeStats
from batchllm.runtime.server_paces import server_paces

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


def stats(node: str, done: int, tokens: int, started_at: float, finished_at: float | None) -> NodeStats:
    return NodeStats(node, "served", lambda: UnitCounts(total=done, committed=done, expected=done), output_tokens=tokens,
                     started_at=started_at, finished_at=finished_at)


def test_a_models_nodes_on_servers_give_one_pace_once_all_of_them_finished(workspace):
    dag = load_dag(workspace.dag(DAG))
    today = datetime.date(2026, 11, 26)
    ran = {"answer": stats("answer", 40, 4_000, 2.0, 22.0), "again": stats("again", 10, 3_000, 5.0, 42.0)}
    (pace,) = server_paces(dag, ran, "a run of dag", today)
    assert pace == ServerPace("served", ("http://b:8000/v1", "http://a:8000/v1"), 40 + 10 * 2, 7_000, 40.0, "2026-11-26",
                              "a run of dag")
    assert (pace.requests_per_s, pace.output_tokens_per_s) == (1.5, 175.0)
    assert server_paces(dag, {**ran, "again": stats("again", 10, 3_000, 5.0, None)}, "r", today) == []  # one still runs
    assert server_paces(dag, {"answer": ran["answer"]}, "r", today) == []  # one never started here
    assert server_paces(dag, {"answer": stats("answer", 5, 500, 0.0, 9.0), "again": stats("again", 5, 500, 0.0, 9.0)},
                        "r", today) == []  # 15 answers: too few to say


def test_the_store_keeps_one_pace_per_model_and_set_of_servers(isolated_home):
    store = ServerPaceStore(isolated_home)
    pace = ServerPace("org/served", ("http://b/v1", "http://a/v1"), 100, 5_000, 50.0, "2026-11-26", "a run of x")
    path = store.save(pace)
    assert path.parent == isolated_home / "servers" and path.name.startswith("org_served-")
    assert store.load("org/served", ("http://a/v1", "http://b/v1")) == pace  # the servers in any order
    assert store.load("org/served", ("http://a/v1",)) is None and store.load("other", pace.urls) is None
    path.write_text("{not json")
    assert store.load("org/served", pace.urls) is None
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
